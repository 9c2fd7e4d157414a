"""Views as index maps: where an element of a view (transpose, permute, expand, slice,
repeat_interleave, reshape) lives in its source, and a multi-dimensional index laid out
contiguously in a buffer.  lower.py composes them along a chain of views, so a view is never
a copy inside a generated kernel."""
from __future__ import annotations

from .errors import CodegenError
from .graph import Node
from .loopir import Affine


def linear_index(index, shape) -> Affine:
    """The offset of `index` in a contiguous buffer of `shape` (dims of size 1 add nothing)."""
    out, stride = Affine(), 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] > 1:
            out = out + index[d].scale(stride)
        stride *= shape[d]
    return out


def broadcast_index(index, out_shape, in_shape):
    offset = len(out_shape) - len(in_shape)
    return [Affine() if in_shape[i] == 1 else index[i + offset] for i in range(len(in_shape))]


def view_index(node: Node, index):
    src, a, r = node.args[0].shape, node.a, len(node.args[0].shape)
    if node.op == "transpose":
        out = list(index)
        d0, d1 = a["dim0"] % r, a["dim1"] % r
        out[d0], out[d1] = out[d1], out[d0]
        return out
    if node.op == "permute":
        out = [None] * r
        for i, d in enumerate(a["dims"]):
            out[d % r] = index[i]
        return out
    if node.op == "expand":
        return broadcast_index(index, node.shape, src)
    if node.op == "repeat_interleave":
        out = list(index)
        d = a["dim"] % r
        out[d] = index[d].floordiv(a["repeats"])
        return out
    if node.op == "slice":
        out = list(index)
        d = a["dim"] % r
        out[d] = index[d].scale(a["step"]) + Affine.of(a["start"])
        return out
    if node.op == "reshape":
        if 0 in src:  # an empty tensor: nothing is ever read
            return [Affine() for _ in src]
        flat = linear_index(index, node.shape)
        out, stride = [None] * r, 1
        for d in range(r - 1, -1, -1):
            out[d] = flat.floordiv(stride).mod(src[d]) if src[d] > 1 else Affine()
            stride *= src[d]
        return out
    raise CodegenError(f"no index map for {node.op}")
