"""Masks the program itself made: attention's fused kernels run a causal one as `is_causal`, and
one that keeps every key as no mask.

`transformers` builds a decoder's attention mask from positions alone (`arange` and
comparisons), and under torch.compile hands sdpa that tensor rather than `is_causal`
(it cannot tell it may skip the mask while tracing).  Constant folding (folding.py)
computes such a mask once, at compile time, and notes it here (`note`).  A fused
kernel given a noted mask that keeps exactly the keys at or before each query
(`causal`) runs causal instead: no mask to convert per run, and the blocks above
the diagonal skipped (cuDNN's and flash's kernels, torch's CPU flash kernel).  An encoder's
mask that keeps every key (`transformers` 5.17 hands ViT and BERT an all-True one when the
caller gives none) is dropped (`kept`: EVERY).

Only the program's own constants are trusted, never a tensor of the caller's (its
values could change under a recorded CUDA graph).  A training backward receives
the forward's folded mask as a saved activation: the very tensor the forward
program holds (lent, never written), which is how the backward finds it here.
A mask of floats counts as causal where the kept entries are 0 and the others
-inf or at most float16's lowest (-65504; `transformers` fills with its dtype's
lowest): each such score's weight exp(s - 65504 - max) is 0 in float32.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

LIMIT = 256  # constants noted; more forget the oldest
LOWEST = -65504.0

# storage address -> the constant, weakly: once its program lets it go, the address may become
# another tensor's, and a dead reference trusts nothing there
_NOTED: OrderedDict[int, weakref.ref] = OrderedDict()
_SEEN: dict[tuple, str | None] = {}  # (address, shape, strides, offset, dtype of a view) -> what it keeps
# (id of a bool mask, dtype) -> (the mask, weakly; its version; its additive form): `additive`
_ADDITIVE: dict[tuple, tuple] = {}


def note(value: torch.Tensor) -> None:
    """A folded constant that may be an attention mask (bool or float, square in its last two dims)."""
    if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == value.shape[-2] > 0
            and (value.dtype == torch.bool or value.dtype.is_floating_point)):
        return
    address = value.untyped_storage().data_ptr()
    _forget(address)  # (what was decided for an earlier tensor at this address)
    _NOTED[address] = weakref.ref(value)
    while len(_NOTED) > LIMIT:
        _forget(next(iter(_NOTED)))


def _forget(address: int) -> None:
    _NOTED.pop(address, None)
    for key in [k for k in list(_SEEN) if k[0] == address]:  # (a copy: runs in other threads add to it)
        _SEEN.pop(key, None)


CAUSAL, EVERY = "causal", "every key"  # what `kept` finds a noted mask keeps


def causal(mask: torch.Tensor | None, queries: int, keys: int) -> bool:
    return kept(mask, queries, keys) == CAUSAL


def kept(mask: torch.Tensor | None, queries: int, keys: int) -> str | None:
    """What a view of a noted constant keeps for `queries` rows of `keys` keys: EVERY key of every
    row (the mask changes no score: the kernels run without it), CAUSAL (exactly the keys at or
    before each row, `queries == keys`), or None (something else, or not a noted constant).
    Decided once per view; never while a CUDA graph records (deciding reads the values: the
    first, unrecorded call decides)."""
    if mask is None or mask.dim() < 2 or tuple(mask.shape[-2:]) != (queries, keys):
        return None
    address = mask.untyped_storage().data_ptr()
    noted = _NOTED.get(address)
    if noted is None or noted() is None:
        return None
    key = (address, tuple(mask.shape), mask.stride(), mask.storage_offset(), mask.dtype)
    if key not in _SEEN:
        if mask.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        _SEEN[key] = EVERY if _keeps_every_key(mask) else CAUSAL if _keeps_the_past(mask) else None
    return _SEEN.get(key)


def _keeps_every_key(mask: torch.Tensor) -> bool:
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _keeps_the_past(mask: torch.Tensor) -> bool:
    if mask.shape[-1] != mask.shape[-2]:
        return False
    keep = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    kept_zero = bool((mask.masked_fill(~keep, 0) == 0).all())
    return kept_zero and bool((mask.masked_fill(keep, float("-inf")) <= LOWEST).all())


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the scores' additive one in `dtype` (0 where kept, -inf where not), as torch's
    sdpa converts it before choosing a kernel (so every kernel sees the same mask); made once per
    mask tensor and version (a caller's in-place change makes it again), a float mask as it is.
    torch's CPU flash kernel takes only the additive form: a bool mask went through sdpa, which
    converted it per call and layer, and the NaN check read q and k (ViT and BERT with
    `transformers` 5.17, which hands an all-True mask: 135 and 88 us of a 4.2 ms ViT call on 16
    cores)."""
    if mask.dtype != torch.bool:
        return mask
    if mask.is_inference():  # (made under inference_mode: no version counter to see a change by)
        return _additive(mask, dtype)
    key = (id(mask), dtype)
    got = _ADDITIVE.get(key)
    if got is not None and got[0]() is mask and got[1] == mask._version:
        return got[2]
    additive = _additive(mask, dtype)
    if len(_ADDITIVE) >= LIMIT:
        _ADDITIVE.clear()
    _ADDITIVE[key] = (weakref.ref(mask), mask._version, additive)
    return additive


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))
