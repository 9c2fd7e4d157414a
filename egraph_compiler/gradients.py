"""Converters for the ops of AOTAutograd's graphs that have no eager counterpart:
slice and select backward, and an embedding's gradient (a convolution's:
convnets.py), also as an advanced index's (index_put accumulating), as_strided
views that read a whole tensor in order, and training's fused attention and its
backward (flash.py's custom ops).  capture.py reads them with converters.py's table."""
from __future__ import annotations

import math

import torch

from . import flash, ops
from .converters import _cat, _fill, _reshape, _slice, _t, _unsqueeze
from .graph import Node
from .indexing import flat_index

aten = torch.ops.aten


def _slice_backward(grad, sizes, dim, start, end, step):
    """The gradient of a slice: the slice's gradient with zeros around it; of a strided slice
    (Swin's x[:, 0::2]), each of its rows followed by step - 1 rows of zeros first."""
    d = ops.norm_dim(dim, len(sizes))
    start, end, step = slice(start, end, step).indices(sizes[d])
    rows = grad.shape[d]
    end = start + min(rows * step, sizes[d] - start) if rows else start
    if step != 1 and rows:
        gaps = _fill(0.0, [*grad.shape[:d + 1], step - 1, *grad.shape[d + 1:]], like=grad)
        spread = _cat([_unsqueeze(grad, d + 1), gaps], d + 1)
        grad = _slice(_reshape(spread, [*grad.shape[:d], rows * step, *grad.shape[d + 1:]]), d, 0, end - start)
    parts = []
    for length, part in ((start, None), (end - start, grad), (sizes[d] - end, None)):
        if length > 0:
            parts.append(part if part is not None else _fill(0.0, [*sizes[:d], length, *sizes[d + 1:]], like=grad))
    return _cat(parts, d) if parts else grad


def _embedding_backward(grad, ids, rows, padding_idx, scale_grad_by_freq):
    if ids.dtype not in ops.INTEGERS:
        return None
    return Node.make("embedding_grad", (grad, ids), {"rows": rows, "padding_idx": padding_idx,
                                                     "scale": bool(scale_grad_by_freq)})


def _index_put(x, indices, values, accumulate=False):
    """x.index_put_(indices, v, accumulate=True): the gradient of an advanced index (Swin's relative
    position bias table `x[i]`; LeViT's attention biases and bilinear or nearest resampling,
    `x[:, :, r, c]`), x plus v's rows added at the flat index of the indexed dims: an embedding's
    gradient, as `indexing._index` reads them (full slices first: those dims moved behind)."""
    lead = next((k for k, i in enumerate(indices) if i is not None), len(indices))
    picked = list(indices[lead:])
    if (not accumulate or not picked or any(i is None or i.dtype not in ops.INTEGERS for i in picked)
            or lead + len(picked) > len(x.shape) or not x.dtype.startswith(("float", "bfloat"))
            or values.dtype != x.dtype):
        return None
    rank, count = len(x.shape), len(picked)
    dims, front, rest = x.shape[lead:lead + count], x.shape[:lead], x.shape[lead + count:]
    flat = flat_index(picked, dims)
    if tuple(values.shape) != front + flat.shape + rest:
        return None
    k = len(flat.shape)  # values' dims: front, the index's, rest -> the index's, front, rest
    values = Node.make("permute", (values,), {"dims": tuple(range(lead, lead + k)) + tuple(range(lead))
                                              + tuple(range(lead + k, len(values.shape)))})
    n, width = math.prod(flat.shape), math.prod(front) * math.prod(rest)
    added = Node.make("embedding_grad", (_reshape(values, [n, width]), _reshape(flat, [n])),
                      {"rows": math.prod(dims), "padding_idx": -1, "scale": False})
    added = _reshape(added, [*dims, *front, *rest])
    if lead:  # back to x's order: front, the indexed dims, rest
        added = Node.make("permute", (added,), {"dims": tuple(range(count, count + lead)) + tuple(range(count))
                                                + tuple(range(lead + count, rank))})
    return Node.make("add", (x, added))


def _whole_in_order(shape, size, stride, offset) -> bool:
    """Whether as_strided(size, stride, offset) of a dense tensor of `shape` reads all of it in
    order (strides of size-1 dims do not matter): a reshape."""
    if offset or math.prod(size) != math.prod(shape):
        return False
    expected = 1
    for n, st in reversed(list(zip(size, stride))):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def _as_strided(x, size, stride, offset=0):
    """Functionalisation's view by storage strides (adaptive pooling's keepdim result, a gradient
    buffer): a reshape where it reads the whole (dense: capture checks) tensor in order."""
    return _reshape(x, list(size)) if _whole_in_order(x.shape, size, stride, offset or 0) else None


def _as_strided_scatter(base, src, size, stride, offset=0):
    """base with the view as_strided(size, stride, offset) replaced by src: src itself, reshaped,
    where the view is the whole base in order."""
    return _reshape(src, list(base.shape)) if _whole_in_order(base.shape, size, stride, offset or 0) else None


def _fused(args: tuple, mask, scale, causal) -> tuple[tuple, dict, str]:
    """A fused attention node's operands (the mask last, if any), attributes and op suffix."""
    attrs = {"scale": float(scale), "causal": bool(causal)}
    return (args, attrs, "") if mask is None else (args + (_t(mask),), attrs, "_mask")


def _fused_attention(q, k, v, mask, scale, causal):
    """flash.attention: its output and logsumexp as nodes of one call (steps.py)."""
    args, attrs, tail = _fused((q, k, v), mask, scale, causal)
    return [_heads_first(Node.make("sdpa_fwd" + tail, args, attrs)),
            Node.make("sdpa_lse" + tail, args, attrs | {"dtype": "float32"})]


def _fused_attention_grad(dout, q, k, v, out, lse, mask, scale, causal):
    args, attrs, tail = _fused((dout, q, k, v, out, lse), mask, scale, causal)
    return [_heads_first(Node.make("sdpa_grad" + tail, args, attrs | {"which": i})) for i in range(3)]


def _heads_first(bshd: Node) -> Node:
    """The op table's [B, S, H, D] result (as the kernels lay it out) seen as [B, H, S, D]."""
    return Node.make("permute", (bshd,), {"dims": (0, 2, 1, 3)})


GRADIENTS = {
    flash.FORWARD: _fused_attention,
    flash.BACKWARD: _fused_attention_grad,
    aten.as_strided.default: _as_strided,
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten.index_put.default: _index_put,
    aten.slice_backward.default: _slice_backward,
    aten.select_backward.default: lambda g, sizes, dim, i: _slice_backward(
        _unsqueeze(g, dim), sizes, dim, i % sizes[dim], i % sizes[dim] + 1, 1),
    aten.embedding_dense_backward.default: _embedding_backward,
}
