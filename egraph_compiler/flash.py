"""Fused attention for training: the forward that also gives each query row's
logsumexp, and the backward that reads it (torch's cuDNN or flash kernels on
CUDA, its flash kernel on CPU), as the custom ops `egc::attention` and
`egc::attention_backward`.

Training's `_sdpa_math` (training.py) hands attention without dropout (a bool or
additive mask taken, `prepare`) to `egc::attention`, whose autograd formula is
`egc::attention_backward`: AOTAutograd then keeps both whole, the forward saves q, k, v, the output and the logsumexp
(`[B, H, Sq]` float32, never the `[B, H, Sq, Sk]` probabilities), and the op table
runs them as library calls (`sdpa_fwd`/`sdpa_lse` and `sdpa_grad`, one call per
program run for each: steps.py shares it).  The written-out form they replace saved
the probabilities and ran softmax's backward over them: on the H200 a GPT-2 step's
attention was a fifth of its device time that way.

Grouped-query attention (k and v with fewer heads) runs on k and v as they are where
torch's CPU flash kernels take grouped heads both ways (`cpu_groups`, torch 2.13's do),
else on k and v repeated to q's heads, their gradients summed back over each group.  Outputs and gradients are laid
out as torch's kernels give them: [B, S, H, D] in memory (`_canonical`), which the
fake implementation states, so a saved output is never copied to another layout.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

aten = torch.ops.aten


def supported(q, k, v, mask, causal: bool) -> bool:
    """Whether `egc::attention` takes these operands (else training writes attention out): 4-d,
    one dtype, heads that group, and a mask (bool, or additive in q's dtype) of at most 4 dims
    that broadcasts to the scores without widening q's batch."""
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return False
    if mask is not None:
        if mask.dtype not in (torch.bool, q.dtype) or mask.dim() > 4:
            return False
        try:
            if torch.broadcast_shapes(mask.shape, q.shape[:3] + k.shape[2:3]) != q.shape[:3] + k.shape[2:3]:
                return False
        except RuntimeError:
            return False
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if (bk, hk, sk) != tuple(v.shape[:3]) or b != bk or d != dk or v.shape[-1] != d or hk == 0 or h % hk:
        return False
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype or q.dtype == torch.float64:
        return False
    return s > 0 and sk > 0 and d > 0 and b > 0 and (not causal or s == sk)


def _backend(q: torch.Tensor, masked: bool) -> str:
    """Which kernel runs: torch's flash kernel on CPU; cuDNN's (head size up to 128) or, without
    a mask (it takes none), flash's for 16-bit floats on CUDA; otherwise the math written out
    here, in float32 (the efficient kernel, which takes float32, pads its logsumexp's rows and
    was left out, unmeasured)."""
    d = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu"
    half = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0
    if half and d <= 128 and torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available():
        return "cudnn"
    if half and d <= 256 and not masked and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    return "math"


def _strides(shape) -> tuple:
    """Contiguous strides of [B, S, H, D] memory seen as [B, H, S, D]."""
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    if x.stride() == _strides(x.shape) or x.numel() <= 1:
        return x
    return torch.empty_strided(x.shape, _strides(x.shape), dtype=x.dtype, device=x.device).copy_(x)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels read each head's vectors in order (a view of q, k, v by strides otherwise)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _repeat(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


@functools.cache
def cpu_groups() -> bool:
    """Whether this torch's CPU flash kernels, forward and backward, take k and v with fewer heads
    as they are (each serving as many consecutive query heads), giving what they give on k and v
    repeated (dk and dv summed over each group): asked once, of small operands, causal and
    masked.  Then a LLaMA training step repeats no k or v (four `repeat_interleave` a step at
    --size cpu, and the sums of dk and dv over groups)."""
    forward, backward = _KERNELS  # (these very functions, whatever a test puts in the module's names)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 5, 8, generator=gen) for h in (4, 2, 2, 4))
    mask = torch.zeros(1, 4, 5, 5).masked_fill_(torch.rand(1, 1, 5, 5, generator=gen) > 0.6, float("-inf"))
    mask[..., 0] = 0
    try:
        for causal, m in ((True, None), (False, mask)):
            grouped = forward(q, k, v, 0.5, causal, m, grouped=True)
            repeated = forward(q, k, v, 0.5, causal, m, grouped=False)
            grads = [backward(dout, q, k, v, repeated[0], repeated[1], 0.5, causal, m, grouped=g) for g in (True, False)]
            if not all(a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)
                       for a, b in zip(grouped + grads[0], repeated + grads[1])):
                return False
    except RuntimeError:  # (a torch whose kernels check that the heads match)
        return False
    return True


def _grouped(backend: str, q, k, grouped: bool | None) -> bool:
    """Whether k and v go to the kernel with fewer heads than q, as they are."""
    if backend != "cpu" or q.shape[1] == k.shape[1]:
        return False
    return cpu_groups() if grouped is None else grouped


# (q's shape, k's shape, dtype, causal, masked, threads) -> whether torch's CPU flash backward took
# k and v grouped faster than repeated, timed on the first call of that kind (`_backward_pick`)
PICKS: dict[tuple, bool] = {}


def _backward_pick(q, k, causal: bool, mask, run) -> tuple[bool, tuple | None]:
    """Whether the CPU backward takes k and v grouped, and the gradients where this call timed
    them (the faster form's last run; else None): the faster of the two, timed three times
    each, interleaved, on the first call of its kind (`run(grouped)` calls the kernel).  Neither
    wins everywhere: on a 16-core Xeon (torch 2.11) grouped took 0.34-0.84x the repeated form's
    time on seven shapes and 1.5-2.3x on two ([1, 4|8, 512|256, 64] queries on 2 K/V heads); on
    2 cores (torch 2.13) 0.81-0.97x, 1.21x on one ([1, 2, 512, 64] on 1 K/V head)."""
    key = (tuple(q.shape), tuple(k.shape), q.dtype, causal, mask is not None, torch.get_num_threads())
    pick = PICKS.get(key)
    if pick is not None:
        return pick, None
    times: dict[bool, list] = {True: [], False: []}
    got: dict[bool, tuple] = {}
    for _ in range(3):
        for grouped in (True, False):
            start = time.perf_counter()
            got[grouped] = run(grouped)
            times[grouped].append(time.perf_counter() - start)
    pick = PICKS[key] = statistics.median(times[True]) <= statistics.median(times[False])
    return pick, got[pick]


def _dummy(shape, dtype, device) -> torch.Tensor:
    """The random-state tensors the kernels' backward takes (read only with dropout)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def prepare(mask: torch.Tensor | None, q: torch.Tensor, keys: int):
    """(the mask as the kernels take it: additive, q's dtype, 4-d, rows 16-element aligned on CUDA;
    the query rows it removes every key from, [B|1, H|1, Sq]) or (None, None).  A run makes
    it once per mask (steps.py), the layers that share the mask share it."""
    if mask is None:
        return None, None
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    dead = ~mask.any(-1) if mask.dtype == torch.bool else (mask == float("-inf")).all(-1)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], keys)  # (every head, as torch's own path hands the kernels a mask)
    if q.is_cuda and mask.stride(-1) == 1 and (keys % 16 or any(s % 16 for s in mask.stride()[:-1] if s)):
        padded = torch.empty(*mask.shape[:-1], -(-keys // 16) * 16, dtype=q.dtype, device=q.device)
        mask = padded[..., :keys].copy_(mask)
    return mask, dead


def forward(q, k, v, scale: float, causal: bool, mask=None, dead=None,
            grouped: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T * scale + mask [causal]) v, logsumexp of each row's scaled scores as float32);
    `mask`, `dead`: `prepare`'s.  A row with every key masked gives 0 (as training's written-out
    form, `_safe_softmax`) and a logsumexp of +inf (its backward then weighs every key by 0).
    `grouped`: k and v handed to the CPU kernel with their own heads (None: where `cpu_groups`)."""
    q, k, v = (_dense_rows(x) for x in (q, k, v))
    backend = _backend(q, mask is not None)
    if not _grouped(backend, q, k, grouped):
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat(k, groups), _repeat(v, groups)
    if backend == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=mask,
                                                                            scale=scale)
    elif backend == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, causal, False, scale=scale)[:2]
        lse = lse.reshape(lse.shape[:3])
    elif backend == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = _math_forward(q, k, v, scale, causal, mask)
    lse = lse.float()
    if dead is not None:
        out, lse = out.masked_fill_(dead.unsqueeze(-1), 0), lse.contiguous().masked_fill_(dead, float("inf"))
    return _canonical(out), lse.contiguous()


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None,
             grouped: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients of q, k and v (k's and v's summed over the query heads each serves); `grouped`
    as `forward`'s, except that None on CPU is the faster of the two there (`_backward_pick`)."""
    q, k, v = (_dense_rows(x) for x in (q, k, v))
    backend = _backend(q, mask is not None)
    dout = _canonical(dout)  # (the output's own layout: cuDNN reads the two alike)
    if backend == "cpu" and grouped is None and q.shape[1] != k.shape[1] and cpu_groups():
        grouped, got = _backward_pick(q, k, causal, mask,
                                      lambda g: _kernel_backward(dout, q, k, v, out, lse, scale, causal, mask, backend, g))
        if got is not None:  # (timed this call: the faster form's gradients, not a seventh run)
            return got
    return _kernel_backward(dout, q, k, v, out, lse, scale, causal, mask, backend, _grouped(backend, q, k, grouped))


def _kernel_backward(dout, q, k, v, out, lse, scale, causal, mask, backend: str, grouped: bool) -> tuple:
    dev = q.device
    groups = 1 if grouped else q.shape[1] // k.shape[1]
    kr, vr = _repeat(k, groups), _repeat(v, groups)
    if backend == "cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            dout, q, kr, vr, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    elif backend == "cudnn":
        seed = _dummy((), torch.int64, dev)
        grads = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, kr, vr, out, lse.unsqueeze(-1), seed, seed, mask, None, None, q.shape[2], kr.shape[2], 0.0,
            causal, scale=scale)
    elif backend == "flash":
        grads = aten._scaled_dot_product_flash_attention_backward(
            dout, q, kr, vr, out, lse, None, None, q.shape[2], kr.shape[2], 0.0, causal,
            _dummy((2,), torch.uint64, dev), _dummy((), torch.uint64, dev), scale=scale)
    else:
        grads = _math_backward(dout, q, kr, vr, out, lse, scale, causal, mask)
    dq, dk, dv = grads[:3]
    if groups > 1:
        dk, dv = (g.unflatten(1, (k.shape[1], groups)).sum(2) for g in (dk, dv))
    return _canonical(dq), _canonical(dk), _canonical(dv)


_KERNELS = (forward, backward)


def reference(t: list, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The op table's `sdpa_fwd[_mask]`/`sdpa_lse[_mask]` on their operands (q, k, v[, mask])."""
    return forward(t[0], t[1], t[2], a["scale"], a["causal"], *prepare(t[3] if len(t) > 3 else None, t[0],
                                                                        t[1].shape[2]))


def reference_grad(t: list, a: dict) -> tuple[torch.Tensor, ...]:
    """The op table's `sdpa_grad[_mask]` on (dout, q, k, v, out, lse[, mask])."""
    mask = prepare(t[6], t[1], t[2].shape[2])[0] if len(t) > 6 else None
    return backward(*t[:6], a["scale"], a["causal"], mask)


def _scores(q, k, scale: float, causal: bool, mask=None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask.float()
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _math_forward(q, k, v, scale, causal, mask=None):
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, scale, causal, mask=None):
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse.unsqueeze(-1))
    do = dout.float()
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.float().transpose(-2, -1)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) * scale
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-2, -1) @ q.float()).to(q.dtype), dv.to(q.dtype)


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(shape, _strides(shape), dtype=like.dtype, device=like.device)


@torch.library.custom_op("egc::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, scale, causal, *prepare(mask, q, k.shape[2]))


@attention.register_fake
def _(q, k, v, mask, scale, causal):
    return _empty(q.shape, q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("egc::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, scale, causal, prepare(mask, q, k.shape[2])[0])


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, scale, causal):
    return _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, causal = inputs
    ctx.save_for_backward(q, k, v, *output, mask)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, mask, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup)
FORWARD, BACKWARD = torch.ops.egc.attention.default, torch.ops.egc.attention_backward.default  # (as graphs hold them)
