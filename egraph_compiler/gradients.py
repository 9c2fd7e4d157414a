"""Converters for the ops of AOTAutograd's backward graphs that have no forward
counterpart (slice and select backward, a convolution's and an embedding's
gradients), and for the general `convolution` those graphs hold in place of
conv2d.  capture.py reads them with converters.py's table."""
from __future__ import annotations

import torch

from . import ops
from .converters import _cat, _conv2d, _fill, _unsqueeze
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


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """torch's general convolution (AOTAutograd's form of conv2d): the 2-d, untransposed case."""
    if transposed or len(x.shape) != 4 or len(stride) != 2 or any(output_padding):
        return None
    return _conv2d(x, w, b, stride, padding, dilation, groups)


def _convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                          mask):
    """(input's, weight's, bias's gradient) of a 2-d convolution, None where `mask` asks for none."""
    if transposed or len(x.shape) != 4 or len(stride) != 2 or any(output_padding):
        return None
    attrs = {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation), "groups": groups}
    return [Node.make("conv2d_input_grad", (grad, w), {"shape": x.shape} | attrs) if mask[0] else None,
            Node.make("conv2d_weight_grad", (grad, x), {"shape": w.shape} | attrs) if mask[1] else None,
            Node.make("sum", (grad,), {"dims": (-4, -2, -1), "keepdim": False}) if mask[2] else None]


def _embedding_backward(grad, ids, rows, padding_idx, scale_grad_by_freq):
    if ids.dtype not in ops.INTEGERS:
        return None
    return Node.make("embedding_grad", (grad, ids), {"rows": rows, "padding_idx": padding_idx,
                                                     "scale": bool(scale_grad_by_freq)})


GRADIENTS = {
    aten.slice_backward.default: _slice_backward,
    aten.select_backward.default: lambda g, sizes, dim, i: _slice_backward(
        _unsqueeze(g, dim), sizes, dim, i % sizes[dim], i % sizes[dim] + 1, 1),
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
}
