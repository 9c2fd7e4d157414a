"""Causal masks the program itself made: attention's fused kernels run them as `is_causal`.

`transformers` builds a decoder's attention mask from positions alone (`arange` and
comparisons), and under torch.compile hands sdpa that tensor rather than `is_causal`
(it cannot tell it may skip the mask while tracing).  Constant folding (folding.py)
computes such a mask once, at compile time, and notes it here (`note`).  A fused
kernel given a noted mask that keeps exactly the keys at or before each query
(`causal`) runs causal instead: no mask to convert per run, and the blocks above
the diagonal skipped (cuDNN's and flash's kernels, torch's CPU flash kernel).

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
_SEEN: dict[tuple, bool] = {}  # (address, shape, strides, offset, dtype of a view) -> causal


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


def causal(mask: torch.Tensor | None, queries: int, keys: int) -> bool:
    """Whether `mask` is a view of a noted constant that keeps, for each of `queries` rows, exactly the
    keys at or before it (`queries == keys`).  Decided once per view; never while a CUDA graph records
    (deciding reads the values: the first, unrecorded call decides)."""
    if mask is None or queries != keys or mask.dim() < 2 or tuple(mask.shape[-2:]) != (queries, keys):
        return False
    address = mask.untyped_storage().data_ptr()
    noted = _NOTED.get(address)
    if noted is None or noted() is None:
        return False
    key = (address, tuple(mask.shape), mask.stride(), mask.storage_offset(), mask.dtype)
    known = _SEEN.get(key)
    if known is None:
        if mask.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        known = _SEEN[key] = _keeps_the_past(mask)
    return known


def _keeps_the_past(mask: torch.Tensor) -> bool:
    keep = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    kept_zero = bool((mask.masked_fill(~keep, 0) == 0).all())
    return kept_zero and bool((mask.masked_fill(keep, float("-inf")) <= LOWEST).all())
