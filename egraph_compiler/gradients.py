"""Converters for the ops of AOTAutograd's backward graphs that have no forward
counterpart: slice and select backward, and an embedding's gradient (a
convolution's: convnets.py).  capture.py reads them with converters.py's table."""
from __future__ import annotations

import torch

from . import ops
from .converters import _cat, _fill, _unsqueeze
from .graph import Node

aten = torch.ops.aten


def _slice_backward(grad, sizes, dim, start, end, step):
    """The gradient of a slice: the slice's gradient with zeros around it."""
    d = ops.norm_dim(dim, len(sizes))
    start, end, step = slice(start, end, step).indices(sizes[d])
    if step != 1:
        return None
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


GRADIENTS = {
    aten.slice_backward.default: _slice_backward,
    aten.select_backward.default: lambda g, sizes, dim, i: _slice_backward(
        _unsqueeze(g, dim), sizes, dim, i % sizes[dim], i % sizes[dim] + 1, 1),
    aten.embedding_dense_backward.default: _embedding_backward,
}
