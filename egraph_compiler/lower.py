"""Lower: a plan kernel -> loop IR, mechanically.

The kernel's tree (its ops, with views and constants inlined) is evaluated
at a symbolic index: pointwise ops pass the index to their operands
(broadcasting drops or zeroes dims), views transform it (transpose swaps,
slice offsets, reshape re-linearises), materialised tensors become loads, and
each reduction becomes an inner loop whose accumulator the rest of the body
reads.  Row composites (softmax, layer_norm, ...) are lowered through their
primitive definitions below, so the whole row is one kernel.
"""
from __future__ import annotations

import math

from . import ops
from .errors import CodegenError
from .graph import Node, const
from .loopir import Acc, Affine, Call, Const, Load, LoopKernel, Param, Reduction
from .plan import Kernel


def _mk(op, *args, **attrs):
    return Node.make(op, args, attrs)


def _row_dims(n: int) -> tuple:
    return tuple(range(-n, 0))


def expand_row(node: Node) -> Node:
    """The primitive definition of a row composite (the lowering's view of it)."""
    x = node.args[0]
    if node.op in ("softmax", "log_softmax"):
        d = (node.attr("dim"),)
        shifted = _mk("sub", x, _mk("amax", x, dims=d, keepdim=True))
        total = _mk("sum", _mk("exp", shifted), dims=d, keepdim=True)
        if node.op == "softmax":
            return _mk("div", _mk("exp", shifted), total)
        return _mk("sub", shifted, _mk("log", total))
    dims = _row_dims(node.attr("ndim"))
    eps = const(node.attr("eps"))
    if node.op == "layer_norm":
        centred = _mk("sub", x, _mk("mean", x, dims=dims, keepdim=True))
        var = _mk("mean", _mk("mul", centred, centred), dims=dims, keepdim=True)
        normed = _mk("mul", centred, _mk("rsqrt", _mk("add", var, eps)))
        return _mk("add", _mk("mul", normed, node.args[1]), node.args[2])
    if node.op == "rms_norm":
        ms = _mk("mean", _mk("mul", x, x), dims=dims, keepdim=True)
        return _mk("mul", _mk("mul", x, _mk("rsqrt", _mk("add", ms, eps))), node.args[1])
    raise CodegenError(f"no row lowering for {node.op}")


def lower_kernel(kernel: Kernel, buffer_names: dict[int, str]) -> LoopKernel:
    root = kernel.output
    tree = expand_row(root) if root.group == "row" else root
    if tree.group == "layout":  # an output that is a view: copy it
        tree = _mk("add", tree, const(0.0))
    reduce_root = tree.group == "reduction"
    domain = tree.args[0].shape if reduce_root else tree.shape
    red_dims = _reduced_dims(tree, domain, buffer_names)
    inner_dims = red_dims or ((len(domain) - 1,) if domain else ())
    outer_dims = tuple(d for d in range(len(domain)) if d not in inner_dims)
    lowering = _Lowering(domain, outer_dims, inner_dims, buffer_names, root)
    out_name = buffer_names[id(root)]
    if reduce_root:
        value = lowering.reduction(tree)
        kept = [lowering.index[d] for d in range(len(domain)) if d not in red_dims or tree.attr("keepdim")]
        out_index = lowering.linear(kept, root.shape)
        store_in_inner = False
    else:
        value = lowering.expr(tree, lowering.index)
        out_index = lowering.linear(lowering.index, root.shape)
        store_in_inner = True
    params = [Param(buffer_names[id(n)], n.dtype, "in") for n in kernel.inputs]
    params.append(Param(out_name, root.dtype, "out"))
    return LoopKernel(kernel.name, params, lowering.outer, lowering.inner, lowering.reductions,
                      out_name, out_index, value, store_in_inner)


def _reduced_dims(tree: Node, domain, buffer_names) -> tuple:
    found: set[tuple] = set()
    for n in _walk(tree, buffer_names):
        if n.group == "reduction":
            if n.args[0].shape != tuple(domain):
                raise CodegenError(f"reduction over {list(n.args[0].shape)} inside a kernel over {list(domain)}")
            found.add(tuple(sorted(d % len(domain) for d in n.attr("dims"))))
    if len(found) > 1:
        raise CodegenError(f"reductions over different dims in one kernel: {sorted(found)}")
    return found.pop() if found else ()


def _walk(root: Node, buffer_names):
    """The nodes computed inside the kernel (it stops at materialised tensors)."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if id(n) in seen or (n is not root and id(n) in buffer_names and n.group != "layout"):
            continue
        seen.add(id(n))
        yield n
        stack.extend(n.args)


class _Lowering:
    def __init__(self, domain, outer_dims, inner_dims, buffer_names, root):
        self.domain = tuple(domain)
        self.root = root
        self.outer = math.prod(domain[d] for d in outer_dims)
        self.inner = math.prod(domain[d] for d in inner_dims)
        self.buffer_names = buffer_names
        self.reductions: list[Reduction] = []
        self._accs: dict[int, Acc] = {}
        self.inner_dims = inner_dims
        self.index = [None] * len(domain)
        for var, dims, total in (("o", outer_dims, self.outer), ("r", inner_dims, self.inner)):
            linear = Affine.var(var, total)
            stride = total
            for d in dims:
                stride //= domain[d]
                self.index[d] = linear.floordiv(stride).mod(domain[d])

    def linear(self, index, shape) -> Affine:
        out, stride = Affine(), 1
        for d in range(len(shape) - 1, -1, -1):
            if shape[d] > 1:
                out = out + index[d].scale(stride)
            stride *= shape[d]
        return out

    def expr(self, node: Node, index):
        if node.op == "const":
            return Const(node.attr("value"))
        materialised = id(node) in self.buffer_names and node.group != "layout" and node is not self.root
        if materialised or node.op == "input":
            return Load(self.buffer_names[id(node)], self.linear(index, node.shape))
        if node.group == "layout":
            return self.expr(node.args[0], _view_index(node, index))
        if node.group == "reduction":
            return self.reduction(node)
        if node.group != "pointwise":
            raise CodegenError(f"{node.op} cannot be computed inside a generated kernel")
        return Call(node.op, tuple(self.expr(a, _broadcast_index(index, node.shape, a.shape)) for a in node.args))

    def reduction(self, node: Node):
        """The reduction's value for the current outer index (an accumulator)."""
        if id(node) not in self._accs:
            body = self.expr(node.args[0], self.index)
            acc = Acc(f"acc{len(self.reductions)}")
            self.reductions.append(Reduction(acc.name, "max" if node.op == "amax" else "sum", body))
            self._accs[id(node)] = acc
        acc = self._accs[id(node)]
        if node.op == "mean":
            return Call("mul", (acc, Const(1.0 / self.inner)))
        return acc


def _broadcast_index(index, out_shape, in_shape):
    offset = len(out_shape) - len(in_shape)
    return [Affine() if in_shape[i] == 1 else index[i + offset] for i in range(len(in_shape))]


def _view_index(node: Node, index):
    src = node.args[0].shape
    a = node.a
    r = len(src)
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
        return _broadcast_index(index, node.shape, src)
    if node.op == "slice":
        out = list(index)
        d = a["dim"] % r
        out[d] = index[d].scale(a["step"]) + Affine.of(a["start"])
        return out
    if node.op == "reshape":
        flat, stride = Affine(), 1
        for d in range(len(node.shape) - 1, -1, -1):
            if node.shape[d] > 1:
                flat = flat + index[d].scale(stride)
            stride *= node.shape[d]
        out, stride = [None] * r, 1
        for d in range(r - 1, -1, -1):
            out[d] = flat.floordiv(stride).mod(src[d]) if src[d] > 1 else Affine()
            stride *= src[d]
        return out
    raise CodegenError(f"no index map for {node.op}")


def check_lowerable(node: Node) -> None:
    if ops.group_of(node.op) not in ("pointwise", "reduction", "row", "layout"):
        raise CodegenError(f"{node.op} is not lowered to loops")
