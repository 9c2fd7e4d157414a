"""Converters for the ops of convolutional networks as torch hands them over:
conv2d, the general `convolution` (AOTAutograd's form of it) and its gradients, conv1d,
batch norm in inference (per-channel arithmetic, which the rules fuse with the
ops around it), adaptive average pooling to sizes that divide the input (a
reshape and a mean; its gradient an expand; 1-d too; `avg_pool2d` where its windows tile
the input likewise), nearest upsampling by whole factors (repeats: in inference; AOTAutograd's
tracing decomposes it into an index), max pooling over windows
that tile the input (a reshape and an amax; other windows the library's
max_pool2d), constant padding (a cat of fills),
and `copy` (a training graph's running statistics, written back).  In training,
batch norm and its backward are decomposed by torch (training.py).  capture.py
reads these with converters.py's table."""
from __future__ import annotations

import torch

from .converters import _cast, _cat, _expand, _fill, _layer_norm, _reshape, _slice
from .graph import Node, const

aten = torch.ops.aten


def _pair(v) -> tuple:
    """A 2-d argument as torch takes it: one number, or a list of one or two."""
    return tuple(v) * (2 // len(v)) if isinstance(v, (list, tuple)) else (v, v)


def _conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    if isinstance(padding, str) or len(x.shape) != 4:  # padding="same"/"valid", unbatched input: ATen
        return None
    return Node.make("conv2d", (x, w, b if b is not None else const(0.0)),
                     {"stride": _pair(stride), "padding": _pair(padding), "dilation": _pair(dilation), "groups": groups})


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """torch's general convolution (AOTAutograd's form of conv1d and conv2d), untransposed."""
    if transposed or any(output_padding):
        return None
    if len(x.shape) == 3 and len(w.shape) == 3 and len(stride) == 1:
        return _conv1d(x, w, b, stride, padding, dilation, groups)
    if len(x.shape) != 4 or len(stride) != 2:
        return None
    return _conv2d(x, w, b, stride, padding, dilation, groups)


def _convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                          mask):
    """(input's, weight's, bias's gradient) of a 2-d convolution, None where `mask` asks for none;
    a 1-d one as the 2-d one over a height of 1 (as `_conv1d`)."""
    if transposed or any(output_padding):
        return None
    if len(x.shape) == 3 and len(w.shape) == 3 and len(stride) == 1:
        tall = lambda t: _reshape(t, [*t.shape[:2], 1, t.shape[2]])  # noqa: E731
        grads = _convolution_backward(tall(grad), tall(x), tall(w), bias_sizes, (1, stride[0]), (0, padding[0]),
                                      (1, dilation[0]), False, (0, 0), groups, mask)
        return grads and [g if g is None or i == 2 else _reshape(g, t.shape)
                          for i, (g, t) in enumerate(zip(grads, (x, w, None)))]
    if len(x.shape) != 4 or len(stride) != 2:
        return None
    attrs = {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation), "groups": groups}
    return [Node.make("conv2d_input_grad", (grad, w), {"shape": x.shape} | attrs) if mask[0] else None,
            Node.make("conv2d_weight_grad", (grad, x), {"shape": w.shape} | attrs) if mask[1] else None,
            Node.make("sum", (grad,), {"dims": (-4, -2, -1), "keepdim": False}) if mask[2] else None]


def _conv1d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """conv1d as conv2d over a height of 1 (the same library call)."""
    one = (lambda v: int(v[0]) if isinstance(v, (list, tuple)) else int(v))
    if isinstance(padding, str) or len(x.shape) != 3 or len(w.shape) != 3:  # ("same"/"valid", unbatched: ATen)
        return None
    out = _conv2d(_reshape(x, [x.shape[0], x.shape[1], 1, x.shape[2]]), _reshape(w, [*w.shape[:2], 1, w.shape[2]]),
                  b, (1, one(stride)), (0, one(padding)), (1, one(dilation)), groups)
    return _reshape(out, [out.shape[0], out.shape[1], out.shape[3]])


def _channels(v: Node, rank: int) -> Node:
    """A per-channel vector [C] laid along dim 1 of a rank-`rank` tensor: [1, C, 1, ...]."""
    return _reshape(v, [1, v.shape[0]] + [1] * (rank - 2))


def _batch_norm_inference(x, w, b, mean, var, momentum, eps):
    """(x - mean) / sqrt(var + eps) * w + b with the running statistics, in float32 for narrower
    inputs (as torch computes it), then x's dtype; the saved mean and rstd are empty, as torch's."""
    rank = len(x.shape)
    if rank < 2 or not x.dtype.startswith(("float", "bfloat")) or mean is None or var is None:
        return None
    out = Node.make("mul", (Node.make("sub", (x, _channels(mean, rank))), Node.make(
        "rsqrt", (Node.make("add", (_channels(var, rank), const(float(eps)))),))))
    if w is not None:
        out = Node.make("mul", (out, _channels(w, rank)))
    if b is not None:
        out = Node.make("add", (out, _channels(b, rank)))
    empty = _fill(0.0, [0], like=mean)
    return [_cast(out, x.dtype), empty, empty]


def _adaptive_avg_pool2d(x, output_size):
    """Average pooling to `output_size` where it divides the input's height and width: equal
    windows, a reshape and a mean (other sizes' uneven windows: ATen)."""
    size = [n if o is None else o for n, o in zip(x.shape[-2:], output_size)]
    if len(x.shape) not in (3, 4) or any(o <= 0 or n % o for n, o in zip(x.shape[-2:], size)):
        return None
    (h, w), (oh, ow) = x.shape[-2:], size
    windows = _reshape(x, [*x.shape[:-2], oh, h // oh, ow, w // ow])
    return Node.make("mean", (windows,), {"dims": (-3, -1), "keepdim": False})


def _max_pool2d_with_indices(x, *args):
    """Training's form: the values and, as a second library call, their positions (int64)."""
    if not _poolable(x):
        return None
    a = _pool_attrs(x, *args)
    return [Node.make("max_pool2d", (x,), a), Node.make("max_pool2d_indices", (x,), a | {"dtype": "int64"})]


def _max_pool2d_backward(grad, x, kernel, stride, padding, dilation, ceil_mode, indices):
    if not _poolable(x):
        return None
    return Node.make("max_pool2d_grad", (grad, x, indices), _pool_attrs(x, kernel, stride, padding, dilation, ceil_mode))


def _adaptive_avg_pool1d(x, output_size):
    (size,) = output_size
    if len(x.shape) not in (2, 3) or size <= 0 or x.shape[-1] % size:
        return None
    windows = _reshape(x, [*x.shape[:-1], size, x.shape[-1] // size])
    return Node.make("mean", (windows,), {"dims": (-1,), "keepdim": False})


def _poolable(x) -> bool:
    """A float [N,] C, H, W input: what max pooling's converters take (integers: ATen)."""
    return len(x.shape) in (3, 4) and x.dtype.startswith(("float", "bfloat"))


def _pool_attrs(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    kernel = _pair(kernel)
    return {"kernel": kernel, "stride": _pair(stride) if stride not in ((), []) else kernel,
            "padding": _pair(padding), "dilation": _pair(dilation), "ceil": bool(ceil_mode)}


def _tiling_avg(x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """avg_pool2d's windows where they tile the input (stride = kernel, no padding, sizes that
    divide): adaptive pooling to the quotient; None otherwise (ATen)."""
    if not _poolable(x) or divisor_override is not None:
        return None
    a = _pool_attrs(x, kernel, stride, padding, 1, ceil_mode)
    if a["kernel"] != a["stride"] or any(a["padding"]) or a["ceil"] or any(
            n % k for n, k in zip(x.shape[-2:], a["kernel"])):
        return None
    return [n // k for n, k in zip(x.shape[-2:], a["kernel"])]


def _max_pool2d(x, *args):
    """Max pooling over windows that tile the input (stride = kernel, no padding or dilation,
    sizes that divide): a reshape and an amax; other windows (ResNet's overlapping 3x3 / 2,
    padded): the library's max_pool2d."""
    if not _poolable(x):
        return None
    a = _pool_attrs(x, *args)
    kernel = a["kernel"]
    if (kernel != a["stride"] or any(a["padding"]) or a["dilation"] != (1, 1) or a["ceil"]
            or any(n % k for n, k in zip(x.shape[-2:], kernel))):
        return Node.make("max_pool2d", (x,), a)
    (h, w), (kh, kw) = x.shape[-2:], kernel
    windows = _reshape(x, [*x.shape[:-2], h // kh, kh, w // kw, kw])
    return Node.make("amax", (windows,), {"dims": (-3, -1), "keepdim": False})


def _adaptive_avg_pool2d_backward(grad, x):
    """Its gradient where the windows are equal: each window's share of its output's gradient."""
    (h, w), (oh, ow) = x.shape[-2:], grad.shape[-2:]
    if len(x.shape) not in (3, 4) or oh <= 0 or ow <= 0 or h % oh or w % ow:
        return None
    batch = list(grad.shape[:-2])
    spread = _expand(_reshape(grad, batch + [oh, 1, ow, 1]), batch + [oh, h // oh, ow, w // ow])
    return Node.make("div", (_reshape(spread, list(x.shape)), const(float(h // oh * (w // ow)))))


def _constant_pad(x, pad, value=None):
    """F.pad(mode="constant") / constant_pad_nd: `value` (0) concatenated on each side of the last
    dims, pair by pair from the last; a negative pad slices instead."""
    if len(pad) % 2 or len(pad) // 2 > len(x.shape):
        return None
    out = x
    for k in range(len(pad) // 2):
        d, (left, right) = len(x.shape) - 1 - k, pad[2 * k:2 * k + 2]
        start, end = max(-left, 0), out.shape[d] - max(-right, 0)
        if end < start:
            return None
        if (start, end) != (0, out.shape[d]):
            out = _slice(out, d, start, end)
        side = lambda n: _fill(0.0 if value is None else value, [*out.shape[:d], n, *out.shape[d + 1:]], like=out)
        parts = ([side(left)] if left > 0 else []) + [out] + ([side(right)] if right > 0 else [])
        out = _cat(parts, d) if len(parts) > 1 else out
    return out


def _copy(x, src, non_blocking=False):
    """copy(x, src): src in x's dtype, broadcast to x's shape (a functional copy_)."""
    return _expand(_cast(src, x.dtype), list(x.shape))


def _upsample_bilinear2d(x, size, align_corners, scales_h=None, scales_w=None):
    """To a size; given scales (which torch uses in the coordinate mapping itself), or an input
    other than float32/bf16/fp16: ATen."""
    if size is None or scales_h is not None or scales_w is not None or \
            x.dtype not in ("float32", "bfloat16", "float16"):
        return None
    return Node.make("upsample_bilinear2d", (x,), {"size": tuple(int(s) for s in size),
                                                   "align_corners": bool(align_corners)})


def _nearest_factors(shape, size=None, scales=None):
    """(s_h, s_w) where nearest upsampling of `shape`'s last two dims repeats each pixel a whole
    number of times (UNet's and FPN's 2x): to a size that is a multiple of the input's, or by
    integer scales; None otherwise.  (torch maps an output pixel to floor(i * scale), which is
    i // s for these.)"""
    if len(shape) not in (3, 4):
        return None
    hw = shape[-2:]
    if scales is not None and any(s is not None for s in scales):
        if size is not None or any(s is None or s != int(s) or s < 1 for s in scales):
            return None
        return tuple(int(s) for s in scales)
    if size is None or any(o <= 0 or n <= 0 or o % n for o, n in zip(size, hw)):
        return None
    return tuple(o // n for o, n in zip(size, hw))


def _upsample_nearest2d(x, size=None, scales=None):
    factors = _nearest_factors(x.shape, size, scales)
    if factors is None:
        return None
    for dim, times in zip((-2, -1), factors):
        if times > 1:
            x = Node.make("repeat_interleave", (x,), {"dim": dim, "repeats": times})
    return x


def _group_norm(x, groups, w=None, b=None, eps=1e-5, cudnn_enabled=True):
    """GroupNorm: a layer norm over each group's channels and positions, then each channel's
    scale and shift (float32; other dtypes round differently between the steps: ATen)."""
    if len(x.shape) < 2 or x.dtype != "float32" or x.numel == 0 or x.shape[1] % groups:
        return None
    grouped = _reshape(x, (x.shape[0], groups, x.numel // (x.shape[0] * groups)))
    out = _reshape(_layer_norm(grouped, grouped.shape[-1:], eps=eps), x.shape)
    channel = (x.shape[1],) + (1,) * (len(x.shape) - 2)
    out = out if w is None else Node.make("mul", (out, _reshape(w, channel)))
    return out if b is None else Node.make("add", (out, _reshape(b, channel)))


CONVNETS = {
    aten.conv2d.default: _conv2d,
    aten.group_norm.default: _group_norm,
    aten.upsample_bilinear2d.default: _upsample_bilinear2d,
    aten.upsample_bilinear2d.vec: lambda x, size, align_corners, scales: _upsample_bilinear2d(
        x, size, align_corners) if scales is None else None,
    aten.upsample_nearest2d.vec: _upsample_nearest2d,
    aten.upsample_nearest2d.default: lambda x, size, scales_h=None, scales_w=None: _upsample_nearest2d(
        x, None if scales_h is not None or scales_w is not None else size,
        None if scales_h is None and scales_w is None else [scales_h, scales_w]),
    aten.convolution.default: _convolution, aten.conv1d.default: _conv1d,
    aten.convolution_backward.default: _convolution_backward,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_inference,
    aten.adaptive_avg_pool2d.default: _adaptive_avg_pool2d,
    aten._adaptive_avg_pool2d.default: _adaptive_avg_pool2d,
    aten._adaptive_avg_pool2d_backward.default: _adaptive_avg_pool2d_backward,
    aten.adaptive_avg_pool1d.default: _adaptive_avg_pool1d,
    aten.max_pool2d.default: _max_pool2d,
    aten.avg_pool2d.default: lambda x, *args: None if (size := _tiling_avg(x, *args)) is None else
    _adaptive_avg_pool2d(x, size),
    aten.avg_pool2d_backward.default: lambda grad, x, *args: None if _tiling_avg(x, *args) is None else
    _adaptive_avg_pool2d_backward(grad, x),
    aten.max_pool2d_with_indices.default: _max_pool2d_with_indices,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
    aten.copy.default: _copy,
    aten.constant_pad_nd.default: _constant_pad,
    aten.pad.default: lambda x, pad, mode="constant", value=None: _constant_pad(x, pad, value) if mode == "constant"
    else None,
}
