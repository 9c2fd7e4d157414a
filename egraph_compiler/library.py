"""Eager implementations of the op table's library calls that take more than
one torch call: attention (masks, grouped-query heads, the CUDA kernels' demands)
and convolutions with their gradients.  ops.py names them as references; the
runtime (steps.py) runs them."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.attention
import torch.nn.functional as F


def gqa(q, k, v) -> bool:
    """Grouped-query attention (torch's `enable_gqa`): k and v have fewer heads (dim -3) than q,
    and each of theirs serves q.shape[-3] // k.shape[-3] of q's.  Equal or single k/v heads
    broadcast instead (a single head serves all of q's either way)."""
    return (len(q) == len(k) == len(v) >= 3 and k[-3] == v[-3] and k[-3] not in (1, q[-3])
            and q[-3] % k[-3] == 0 and k[:-3] == v[:-3])


def conv2d(t, a):
    x, w, b = t
    return F.conv2d(x, w, b if b.dim() == 1 else None, a["stride"], a["padding"], a["dilation"], a["groups"]) + \
        (b if b.dim() == 0 else 0)


def max_pool2d(t, a):
    return F.max_pool2d(t[0], a["kernel"], a["stride"], a["padding"], a["dilation"], a["ceil"])


def max_pool2d_indices(t, a):
    return F.max_pool2d(t[0], a["kernel"], a["stride"], a["padding"], a["dilation"], a["ceil"], return_indices=True)[1]


def max_pool2d_grad(t, a):
    grad, x, indices = t
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, a["kernel"], a["stride"], a["padding"],
                                                           a["dilation"], a["ceil"], indices)


def conv2d_input_grad(t, a):
    """conv2d's gradient with respect to its input (of shape `shape`), from the output's gradient."""
    grad, w = t
    return torch.nn.grad.conv2d_input(a["shape"], w, grad, a["stride"], a["padding"], a["dilation"], a["groups"])


def conv2d_weight_grad(t, a):
    """conv2d's gradient with respect to its weight (of shape `shape`), from the output's gradient."""
    grad, x = t
    return torch.nn.grad.conv2d_weight(x, a["shape"], grad, a["stride"], a["padding"], a["dilation"], a["groups"])


def embedding_grad(t, a):
    """An embedding's weight gradient: each id's gradient row added into its row of a zero matrix of
    `rows` rows (none into `padding_idx`'s; `scale`: divided by the id's count, as torch does).
    Summed in float32 by `index_add_` (atomic adds on CUDA, as Inductor's kernel): ATen's
    `embedding_dense_backward` sorts the ids on CUDA past 3,072 of them, ~75 us of a GPT-2 step's
    token embedding on the H200.  ATen's where the ids' counts scale it, or where torch is asked for
    deterministic algorithms (the order of atomic adds is not)."""
    grad, ids = t
    if a["scale"] or (grad.is_cuda and torch.are_deterministic_algorithms_enabled()):
        return torch.ops.aten.embedding_dense_backward(grad, ids, a["rows"], a["padding_idx"], a["scale"])
    width = grad.shape[-1]
    out = torch.zeros(a["rows"], width, dtype=torch.float32, device=grad.device)
    out.index_add_(0, ids.reshape(-1), grad.reshape(-1, width).float())
    if a["padding_idx"] >= 0:
        out[a["padding_idx"]] = 0
    return out.to(grad.dtype)


def sdpa(t, a, prepared: bool = False):
    """torch's sdpa on t = (q, k, v[, mask]); `prepared`: the mask is fused_kernel_mask's already."""
    q, k, v = t[:3]
    mask = t[3] if len(t) > 3 else None
    if mask is not None and mask.dim() < 2:  # a scalar or per-key mask (rules may leave one): torch wants [..., L, S]
        mask = mask.expand(1, k.shape[-2])
    grouped = gqa(q.shape, k.shape, v.shape)
    expand = _expansions(q.shape, k.shape, v.shape, mask.shape if mask is not None else None, grouped)
    q, k, v = (x if shape is None else x.expand(shape) for x, shape in zip((q, k, v), expand))

    call = _caller(mask, a["causal"], a["scale"], grouped)
    if k.shape[-2] == 0:  # no keys: each row's weights are empty and its sum 0 (torch's CPU kernel returns
        heads = q.shape[-3:-2] if grouped else ()  # q's batch then, not the broadcast one: soak, seed 9323)
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:len(k.shape) - 2 - len(heads)] + heads,
                                       v.shape[:len(v.shape) - 2 - len(heads)] + heads)
        return q.new_zeros((*batch, q.shape[-2], v.shape[-1]))
    if not q.is_cuda:
        return on_cpu(call, q, k, v, mask, a["causal"], a["scale"], grouped)
    if mask is not None and not prepared:
        mask = fused_kernel_mask(mask, k.shape[-2], q.dtype)
    if grouped and mask is not None and not a["causal"] and q.dim() == 4:
        return grouped_queries(q, k, v, query_group_mask(mask, q.shape[-3] // k.shape[-3], q.shape[-2]), a["scale"])
    return on_cuda(call, q, k, v)


# (the op's one overload: through its packet, the keyword arguments took 31 us a call against 23
# at LLaMA's --size test)
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def on_cpu(call, q, k, v, mask=None, causal=False, scale=None, grouped=False, fits=None):
    """A query row that meets only NaN scores (a NaN or inf in it, or in every key, so in the
    first): torch's CPU flash kernel treats the row as masked and gives 0; its math kernel,
    which eager picks for other layouts, gives NaN, as the arithmetic does.  The NaN stands.
    Where the flash kernel takes the operands as they are (4-d and not empty: it dies of a
    division by 0 on no queries; one head size, no grouped heads, no mask or a float one of
    q's dtype), it is called directly for its logsumexp
    too: a row it treats as masked, the only kind that can hide a NaN, has a logsumexp of
    exactly 0, so q is read for the check only when some row's is (on 16 cores the check's
    two sums took 40 us of a 200 us call; 2-3% of a BERT layer's on 2 cores).  The flash kernel
    reads each row as if its last dim were contiguous: a transposed q, k or v (last stride not 1)
    gave every output wrong (soak, seed 12001), so those go through torch's sdpa, which picks the
    math kernel for them as eager does.  `fits`: flash_shapes of these operands, where the caller
    knows them before the call."""
    if fits is None:
        fits = flash_shapes(q.shape, k.shape, v.shape, None if mask is None else mask.shape, grouped)
    if (fits and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.dtype == k.dtype == v.dtype
            and (mask is None or (mask.stride(-1) == 1 and mask.dtype == q.dtype))):
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        if bool(lse.all()) or _finite(q, k):  # (no logsumexp is 0: one op, where `== 0` then `any` took two)
            return out
    elif _finite(q, k):
        return call(q, k, v)
    return call(q, k, v, math=True)


def flash_shapes(qs, ks, vs, mask_shape, grouped: bool) -> bool:
    """Whether torch's CPU flash kernel takes operands of these shapes as they are (on_cpu; their
    strides and dtypes are asked per call): 4-d, not empty, one head size, one batch, one head
    count or grouped heads where this torch's kernel takes them (cpu_flash_groups), as many keys
    as values, no mask or a 4-d one."""
    return ((not grouped or cpu_flash_groups()) and len(qs) == len(ks) == len(vs) == 4
            and 0 not in (*qs, *ks, *vs) and qs[-1] == ks[-1] == vs[-1] and qs[0] == ks[0] == vs[0]
            and (grouped or qs[1] == ks[1]) and ks[1] == vs[1] and ks[2] == vs[2]
            and (mask_shape is None or len(mask_shape) == 4))


@functools.cache
def cpu_flash_groups() -> bool:
    """Whether this torch's CPU flash kernel takes grouped-query heads as they are (k and v with
    fewer heads, each serving as many consecutive heads of q as sdpa's `enable_gqa`; torch 2.13's
    does): asked once, of small operands, against sdpa over k and v repeated.  Then a LLaMA's
    attention is the kernel alone, its logsumexp the NaN check, where sdpa and two sums read back
    took 22 us of a 37 us step (--size test, 2 cores)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 8, generator=gen) for h in (4, 2, 2))
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.5)[0]
    except RuntimeError:
        return False
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          is_causal=True, scale=0.5)
    return out.shape == want.shape and torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def _finite(q, k) -> bool:
    """No NaN or inf in q nor in k's first key (two sums read back: half the host time of one
    `isfinite` of their sum)."""
    return math.isfinite(q.sum().item()) and math.isfinite(k[..., :1, :].sum().item())


def attention(shapes: list, a: dict, cuda: bool):
    """`sdpa` for operands of these shapes (q, k, v[, mask]; a plan's, known before the first
    call), with what `sdpa` decides per call (grouped heads, the mask's broadcast) decided
    once: a small model's forward is bound by the host.  On CUDA a mask must be
    fused_kernel_mask's already (steps.py converts it once per run)."""
    qs, ks, vs = shapes[:3]
    grouped, keys = gqa(qs, ks, vs), ks[-2]
    masked, per_key = len(shapes) > 3, len(shapes) > 3 and len(shapes[3]) < 2
    if keys == 0:
        return lambda t: sdpa(t, a)
    expand = _expansions(qs, ks, vs, shapes[3] if masked else None, grouped)
    causal, scale = a["causal"], a["scale"]
    fits = flash_shapes(*(e or x for e, x in zip(expand, (qs, ks, vs))),
                        (1, keys) if per_key else shapes[3] if masked else None, grouped)
    if not cuda and fits and not masked and not any(expand):
        return _flash_on_cpu(causal, scale, grouped)
    chosen: dict = {}  # (CUDA, heads not grouped) operand layout -> the fused kernel torch picks for it

    def run(t):
        q, k, v = t[0], t[1], t[2]
        mask = t[3] if masked else None
        if per_key:
            mask = mask.expand(1, keys)
        if expand[0]:
            q = q.expand(expand[0])
        if expand[1]:
            k = k.expand(expand[1])
        if expand[2]:
            v = v.expand(expand[2])
        if cuda and not grouped:
            return on_cuda(_picked_once(chosen, mask, causal, scale), q, k, v)
        call = _caller(mask, causal, scale, grouped)
        return on_cuda(call, q, k, v) if cuda else on_cpu(call, q, k, v, mask, causal, scale, grouped, fits)
    return run


def _picked_once(chosen: dict, mask, causal: bool, scale):
    """`_caller` on CUDA, with torch's pick of a fused kernel made once per operand layout
    (shapes, strides, 16-byte alignment, dtypes, the mask's) and the kernel then called
    directly, as Inductor calls it: F.scaled_dot_product_attention checks every kernel's
    constraints per call, 55-69 us of host time per call in a profile of BERT and GPT-2 on an
    H100 against 37 us for Inductor's direct call (.bisect/hostprof.py)."""
    def call(q, k, v, math=False):
        if math:
            return math_attention(q, k, v, mask, causal, scale, False)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, torch.is_grad_enabled(),
               None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.data_ptr() % 16))
        kernel = chosen.get(key)
        if kernel is None:
            if len(chosen) >= 64:
                chosen.clear()
            kernel = chosen[key] = _fused_kernel(q, k, v, mask, causal, scale)
        return kernel(q, k, v, mask)
    return call


def _fused_kernel(q, k, v, mask, causal: bool, scale):
    """(q, k, v, mask) -> sdpa's output through the kernel torch's sdpa picks for operands like
    these (`torch._fused_sdp_choice`), called as torch's sdpa calls it where that takes no
    preparation: flash without a mask and head sizes that need no padding to 8, the efficient
    kernel with no mask or one of q's dtype already aligned to 16 elements (expanded to
    [B, H, L, S] as sdpa expands it), cuDNN without a mask.  Anything else stays with
    F.scaled_dot_product_attention."""
    SDP = torch.nn.attention.SDPBackend
    aten = torch.ops.aten
    backend = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=scale)
    padded = any(x.shape[-1] % 8 for x in (q, k, v))
    if backend == SDP.FLASH_ATTENTION and mask is None and not padded and not torch.is_grad_enabled():
        flash = aten._scaled_dot_product_flash_attention.default
        return lambda q, k, v, m: flash(q, k, v, 0.0, causal, False, scale=scale)[0]
    if backend == SDP.EFFICIENT_ATTENTION and not torch.is_grad_enabled() and (mask is None or _aligned(mask, q)):
        efficient = aten._scaled_dot_product_efficient_attention.default

        def run(q, k, v, m):
            if m is not None:
                m = m.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return efficient(q, k, v, m, False, 0.0, causal, scale=scale)[0]
        return run
    if backend == SDP.CUDNN_ATTENTION and mask is None and not torch.is_grad_enabled():
        cudnn = aten._scaled_dot_product_cudnn_attention.default
        return lambda q, k, v, m: cudnn(q, k, v, None, False, 0.0, causal, False, scale=scale)[0]
    return lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale)


def _aligned(mask, q) -> bool:
    """A 4-d mask of q's dtype that the efficient kernel reads as it is (sdpa pads any other)."""
    return (mask.dim() == 4 and mask.dtype == q.dtype and mask.stride(-1) == 1 and mask.data_ptr() % 16 == 0
            and all(s % 16 == 0 for s in mask.stride()[:-1]))


def _flash_on_cpu(causal: bool, scale, grouped: bool):
    """`attention` without a mask on a CPU, where the flash kernel takes the plan's shapes: on_cpu
    with its caller made once and its shape test passed (an sdpa step of BERT at --size test took
    24 us, the flash kernel alone 12-13)."""
    call = _caller(None, causal, scale, grouped)
    return lambda t: on_cpu(call, t[0], t[1], t[2], None, causal, scale, grouped, True)


def softmax_attention(t, a):
    """`softmax(q k^T * s + m) v` as written (the rules' form of an additive mask): as sdpa,
    but a row whose mask removes every key (all -inf) is NaN, softmax's answer, where torch's
    sdpa kernels give 0 (all of them, on CPU and CUDA: measured, torch 2.11 and 2.13)."""
    return nan_rows(fully_masked_rows(t[3], t[1].shape[-2]), sdpa(t, a))


def fully_masked_rows(mask, keys: int):
    """[..., L, 1]: the rows that softmax makes NaN whatever the scores: the mask removes every
    key (all -inf) or holds a NaN (a fused kernel may give 0 for NaN scores, as torch's CPU flash
    kernel did for NaN queries);
    None without keys (the primitive form's matmul over no keys is 0, as sdpa's)."""
    if keys == 0:
        return None
    if mask.dim() < 2:
        mask = mask.expand(1, keys)
    top = mask.amax(-1, keepdim=True)  # (NaN where the row holds one)
    return (top == float("-inf")) | top.isnan()


def nan_rows(rows, out):
    return out if rows is None else torch.where(rows, float("nan"), out)


def _expansions(qs, ks, vs, mask_shape, grouped: bool) -> list:
    """The shapes q, k and v are expanded to before torch's sdpa (None: as they are): their joint
    batch and the mask's.  torch refuses a mask with more batch than q, and over an empty batch
    returns q's shape (soak 9504: [0, 1, 1, 1] for heads broadcast to 2)."""
    mask_shape = tuple(mask_shape) if mask_shape is not None and len(mask_shape) >= 2 else (1, ks[-2])
    wanted = _attention_shapes(tuple(qs), tuple(ks), tuple(vs), mask_shape, grouped)
    return [tuple(w) if tuple(w) != tuple(x) else None for w, x in zip(wanted, (qs, ks, vs))]


@functools.lru_cache(maxsize=1024)
def _attention_shapes(q, k, v, mask, grouped: bool) -> tuple:
    """q's, k's and v's shapes broadcast to the mask's batch (per shape: a model's layers share one)."""
    batch = torch.broadcast_shapes(q[:-2], k[:-3] + q[-3:-2] if grouped else k[:-2],
                                   v[:-3] + q[-3:-2] if grouped else v[:-2], mask[:-2])
    kv_batch = batch[:-1] + k[-3:-2] if grouped else batch
    return (*batch, *q[-2:]), (*kv_batch, *k[-2:]), (*kv_batch, *v[-2:])


def on_cuda(call, q, k, v):
    # torch's fused CUDA kernels refuse misaligned views ("query is not correctly aligned") and some
    # head sizes with a mask ("no kernel found to launch"): the views as they are (q, k and v are
    # usually slices of one projection, which the kernels read in place), then aligned copies, then
    # the math kernel
    try:
        return call(q, k, v)
    except RuntimeError:
        pass
    q, k, v = (x.contiguous() for x in (q, k, v))
    try:
        return call(q, k, v)
    except RuntimeError:
        return call(q, k, v, math=True)


def _caller(mask, causal: bool, scale, grouped: bool):
    """sdpa of (q, k, v) with these arguments; `math=True`: torch's math kernel (math_attention)."""
    def call(q, k, v, math=False):
        if math:
            return math_attention(q, k, v, mask, causal, scale, grouped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=grouped)
    return call


def math_attention(q, k, v, mask, causal: bool, scale, grouped: bool):
    """torch's math kernel for sdpa, called directly.  `sdpa_kernel(MATH)` sets process-wide
    flags: two threads' contexts interleaving (A enters, B enters and saves A's MATH-only, A
    restores, B restores MATH-only) left every later sdpa of the process on the math kernel, which
    refuses a mask with `is_causal` (a threaded test failed the sdpa tests that ran after it).  As
    torch's sdpa hands it over: a bool mask as 0 / -inf, and here the causal mask added to a mask
    (the math kernel takes one or the other)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        past = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        mask, causal = (past if mask is None else mask + past), False
    return torch.ops.aten._scaled_dot_product_attention_math.default(q, k, v, mask, 0.0, causal, scale=scale,
                                                                     enable_gqa=grouped)[0]


def query_group_mask(mask, groups: int, rows: int):
    """The mask for `grouped_queries`, for `rows` queries: [B, 1 or H, L or 1, S] ->
    [B, 1 or H / groups, groups * L, S] (a copy, made once per run for the layers that share it)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    b, h, _, keys = mask.shape
    if h == 1:
        return mask.unsqueeze(2).expand(b, 1, groups, rows, keys).reshape(b, 1, groups * rows, keys)
    return mask.expand(b, h, rows, keys).reshape(b, h // groups, groups * rows, keys)


def grouped_queries(q, k, v, group_mask, scale):
    """Grouped-query attention with a mask on CUDA.  torch's fused kernels take no `enable_gqa`
    with a mask (it repeats K and V, two copies per layer), so each key/value head's group of
    query heads goes on the query axis instead: q [B, Hk * g, L, d] viewed as [B, Hk, g * L, d],
    the mask repeated per group (query_group_mask).  Exact: the same rows meet the same keys."""
    b, heads, rows, d = q.shape
    kv_heads = k.shape[-3]
    flat = q.reshape(b, kv_heads, heads // kv_heads * rows, d)

    return on_cuda(_caller(group_mask, False, scale, False), flat, k, v).reshape(b, heads, rows, v.shape[-1])


def fused_kernel_mask(mask, keys: int, dtype):
    """A mask torch's fused CUDA attention kernels take (measured on an H200, torch
    2.11): one that broadcasts along the keys (BERT's `q_idx >= 0`, shape
    [1, 1, L, 1]) sends torch to its float32 math kernel, 4-5x slower; a boolean
    mask on cuDNN gives garbage for a fully masked row, where the math kernel
    gives 0.  So: keys materialised (last stride 1), booleans as an additive
    0 / -inf mask in q's dtype, with which the fused kernels give 0 for such a
    row, as the math kernel does.  And a finite mask value below half the
    dtype's lowest (transformers' masks use `finfo.min`) overflows to -inf in
    the fused kernels' exp2 scaling, so a row masked with finfo.min everywhere
    came out 0 where softmax (and the math kernel, and the CPU) gives the mean
    of v: such values are raised to half the lowest, which leaves every softmax
    of finite scores as it was."""
    if mask.dim() < 2:  # (a scalar or per-key mask, as in `sdpa`)
        mask = mask.expand(1, keys)
    if mask.shape[-1] != keys or mask.stride(-1) != 1:
        mask = mask.expand(*mask.shape[:-1], keys).contiguous()
    if mask.dtype == torch.bool:
        key = (mask.device, dtype)
        if key not in _MASK_VALUES:  # (made on a first call, never while a CUDA graph records)
            _MASK_VALUES[key] = (torch.zeros((), dtype=dtype, device=mask.device),
                                 torch.full((), float("-inf"), dtype=dtype, device=mask.device))
        mask = torch.where(mask, *_MASK_VALUES[key])  # one kernel
    elif mask.is_floating_point():
        low = torch.finfo(mask.dtype).min / 2
        mask = torch.where((mask < low) & (mask != float("-inf")), low, mask)
    return mask


_MASK_VALUES: dict = {}  # (device, dtype) -> the 0-d tensors 0 and -inf
