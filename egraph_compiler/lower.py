"""Lower: a plan kernel -> loop IR, mechanically.

The kernel's tree is evaluated at a symbolic index.  Operand edges follow the
plan's boundaries: an `inline` operand is computed here, a constant is a
literal, a view transforms the index (transpose swaps, slice offsets, reshape
re-linearises, broadcasting drops or zeroes dims), and anything else is a load
of a materialised buffer.  Each reduction becomes an inner loop whose scalar
accumulator the rest of the body reads.  Row composites (softmax,
layer_norm, ...) are first expanded into their primitive definitions below,
so a row and its fused neighbours lower as one kernel.
"""
from __future__ import annotations

import math

from .errors import CodegenError
from .graph import Node, const
from .loopir import STASH, Acc, Affine, Call, Const, Load, LoopKernel, Param, Reduction, contains, substitute
from .plan import Kernel, computed_nodes


def _inl(op, *args, **attrs) -> Node:
    """An intermediate of an expansion: computed inside the kernel."""
    return Node.make("inline", (Node.make(op, args, attrs),))


def expand_row(node: Node) -> Node:
    """The primitive definition of a row composite (operand edges kept as they are)."""
    x = node.args[0]
    if node.op in ("softmax", "log_softmax"):
        d = (node.attr("dim"),)
        shifted = _inl("sub", x, _inl("amax", x, dims=d, keepdim=True))
        total = _inl("sum", _inl("exp", shifted), dims=d, keepdim=True)
        if node.op == "softmax":
            return Node.make("div", (_inl("exp", shifted), total))
        return Node.make("sub", (shifted, _inl("log", total)))
    dims = tuple(range(-node.attr("ndim"), 0))
    eps = const(node.attr("eps"))
    if node.op == "layer_norm":
        centred = _inl("sub", x, _inl("mean", x, dims=dims, keepdim=True))
        var = _inl("mean", _inl("mul", centred, centred), dims=dims, keepdim=True)
        normed = _inl("mul", centred, _inl("rsqrt", _inl("add", var, eps)))
        return Node.make("add", (_inl("mul", normed, node.args[1]), node.args[2]))
    if node.op == "rms_norm":
        mean_square = _inl("mean", _inl("mul", x, x), dims=dims, keepdim=True)
        return Node.make("mul", (_inl("mul", x, _inl("rsqrt", _inl("add", mean_square, eps))), node.args[1]))
    raise CodegenError(f"no row lowering for {node.op}")


def expand_rows(root: Node) -> Node:
    """The kernel tree with every computed row composite expanded."""
    memo: dict[int, Node] = {}

    def edge(a: Node) -> Node:
        if a.op == "inline":
            return Node.make("inline", (visit(a.args[0]),))
        if a.group == "layout":  # a view over something computed here
            inner = edge(a.args[0])
            return a if inner is a.args[0] else Node.make(a.op, (inner,), a.a)
        return a

    def visit(n: Node) -> Node:
        if id(n) in memo:
            return memo[id(n)]
        args = tuple(edge(a) for a in n.args)
        out = n if args == n.args else Node.make(n.op, args, n.a)
        if out.group == "row":
            out = visit(expand_row(out))
        memo[id(n)] = out
        return out
    return visit(root)


def lower_kernel(kernel: Kernel, buffer_names: dict[int, str]) -> LoopKernel:
    root = kernel.output
    tree = expand_rows(root)
    if tree.group == "layout":  # a program output that is a view: copy it
        tree = Node.make("add", (tree, const(0.0)))
    reduce_root = tree.group == "reduction"
    domain = tree.args[0].shape if reduce_root else tree.shape
    red_dims = _reduced_dims(tree, domain)
    inner_dims = red_dims or ((len(domain) - 1,) if domain else ())
    lowering = _Lowering(domain, inner_dims, buffer_names)
    if reduce_root:
        value = lowering.reduction(tree)
        kept = [lowering.index[d] for d in range(len(domain)) if d not in red_dims or tree.attr("keepdim")]
        out_index = lowering.linear(kept, root.shape)
    else:
        value = lowering.compute(tree, lowering.index)
        out_index = lowering.linear(lowering.index, root.shape)
    params = [Param(buffer_names[id(n)], n.dtype, "in") for n in kernel.inputs]
    params.append(Param(buffer_names[id(root)], root.dtype, "out"))
    out = LoopKernel(kernel.name, params, lowering.outer, lowering.inner, lowering.reductions,
                     buffer_names[id(root)], out_index, value, not reduce_root)
    _stash_last_reduction(out, root.dtype)
    return out


STASH_LIMIT = 16384  # floats: a row's stash lives on the stack (64 KB), like Inductor's local buffer


def _stash_last_reduction(k: LoopKernel, dtype: str) -> None:
    """When the store recomputes the last reduction's body at the same element,
    keep the body in a per-row stash during the reduction and read it back."""
    if not (k.store_in_inner and k.reductions and dtype == "float32" and k.inner <= STASH_LIMIT):
        return
    body = k.reductions[-1].body
    if isinstance(body, (Load, Const)) or not contains(k.value, body):
        return
    k.value = substitute(k.value, body, Load(STASH, Affine.var("r", k.inner)))
    k.stash_last = True


def _reduced_dims(tree: Node, domain) -> tuple:
    found: set[tuple] = set()
    for n in computed_nodes(tree):
        if n.group == "reduction":
            if n.args[0].shape != tuple(domain):
                raise CodegenError(f"reduction over {list(n.args[0].shape)} inside a kernel over {list(domain)}")
            found.add(tuple(sorted(d % len(domain) for d in n.attr("dims"))))
    if len(found) > 1:
        raise CodegenError(f"reductions over different dims in one kernel: {sorted(found)}")
    return found.pop() if found else ()


class _Lowering:
    def __init__(self, domain, inner_dims, buffer_names):
        outer_dims = tuple(d for d in range(len(domain)) if d not in inner_dims)
        self.outer = math.prod(domain[d] for d in outer_dims)
        self.inner = math.prod(domain[d] for d in inner_dims)
        self.buffer_names = buffer_names
        self.reductions: list[Reduction] = []
        self._accs: dict[int, Acc] = {}
        self.index = [None] * len(domain)
        for var, dims, total in (("o", outer_dims, self.outer), ("r", inner_dims, self.inner)):
            linear, stride = Affine.var(var, total), total
            for d in dims:
                stride //= domain[d]
                self.index[d] = linear.floordiv(stride).mod(domain[d])

    @staticmethod
    def linear(index, shape) -> Affine:
        out, stride = Affine(), 1
        for d in range(len(shape) - 1, -1, -1):
            if shape[d] > 1:
                out = out + index[d].scale(stride)
            stride *= shape[d]
        return out

    def operand(self, a: Node, index):
        """How a consumer sees one operand edge."""
        if a.op == "const":
            return Const(a.attr("value"))
        if a.op == "inline":
            return self.compute(a.args[0], index)
        if a.group == "layout":
            return self.operand(a.args[0], _view_index(a, index))
        if id(a) not in self.buffer_names:
            raise CodegenError(f"{a.op} is read but never materialised")
        return Load(self.buffer_names[id(a)], self.linear(index, a.shape))

    def compute(self, n: Node, index):
        if n.op in ("input", "const") or n.group == "layout":
            return self.operand(n, index)
        if n.group == "reduction":
            return self.reduction(n)
        if n.group != "pointwise":
            raise CodegenError(f"{n.op} cannot be computed inside a generated kernel")
        return Call(n.op, tuple(self.operand(a, _broadcast_index(index, n.shape, a.shape)) for a in n.args))

    def reduction(self, node: Node):
        """The reduction's value at the current outer index (an accumulator)."""
        if id(node) not in self._accs:
            body = self.operand(node.args[0], self.index)
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
        return _broadcast_index(index, node.shape, src)
    if node.op == "slice":
        out = list(index)
        d = a["dim"] % r
        out[d] = index[d].scale(a["step"]) + Affine.of(a["start"])
        return out
    if node.op == "reshape":
        flat = _Lowering.linear(index, node.shape)
        out, stride = [None] * r, 1
        for d in range(r - 1, -1, -1):
            out[d] = flat.floordiv(stride).mod(src[d]) if src[d] > 1 else Affine()
            stride *= src[d]
        return out
    raise CodegenError(f"no index map for {node.op}")
