"""Lower: a plan kernel -> loop IR, mechanically.

The kernel's tree is evaluated at a symbolic index.  Operand edges follow the
plan's boundaries: an `inline` operand is computed here, a constant is a
literal, a view transforms the index (transpose swaps, slice offsets, reshape
re-linearises, broadcasting drops or zeroes dims), and anything else is a load
of a materialised buffer.  Each reduction becomes an inner loop whose scalar
accumulator the rest of the body reads.  Row composites (softmax,
layer_norm, ...) are first expanded into their primitive definitions, taken
from their `*_def` rules, so a row and its fused neighbours lower as one kernel.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import ops
from .errors import CodegenError
from .graph import Node, computed_nodes, const, inline_edges
from .rows import expand_rows
from .view_index import broadcast_index, linear_index, view_index
from .loopir import (STASH, Acc, Affine, Call, Const, Gather, Index, Load, LoopKernel, Param, Reduction, contains,
                     out_of_bounds, substitute)

if TYPE_CHECKING:
    from .plan import Kernel


class IllegalKernel(Exception):
    """A kernel whose reductions cannot share one loop nest; `nodes` are the
    (original) inline targets to materialise instead."""

    def __init__(self, nodes):
        super().__init__(f"{len(nodes)} reduction(s) disagree with the kernel's loop nest")
        self.nodes = nodes


def illegal_edges(root: Node) -> set[int]:
    """The `inline` edges of the kernel rooted at `root` that must become
    materialised edges for its reductions to fit one loop nest (empty: legal)."""
    try:
        _layout(root)
    except IllegalKernel as exc:
        blamed = {id(n) for n in exc.nodes}
        cut = {id(edge) for n in computed_nodes(root) for edge, target in inline_edges(n) if id(target) in blamed}
        if id(root) in blamed or not cut:
            raise CodegenError(f"kernel rooted at {root.op} cannot be lowered: its own reductions disagree "
                               f"(a compiler bug)") from exc
        return cut
    return set()


def lower_kernel(kernel: Kernel, buffer_names: dict[int, str], exact_mean: bool = False) -> LoopKernel:
    """`exact_mean` (a target whose sums are double, Target.exact_mean): a mean is a
    `mean` reduction, its sum divided in double before rounding (see expand_row).  An
    elementwise kernel with an `order` (orders.py) loops over its dims in that order and
    stores densely in it."""
    root = kernel.output
    tree, domain, inner_dims = _layout(root, exact_mean, kernel.fused)
    reduce_root = tree.group == "reduction"
    if kernel.order:
        if reduce_root or kernel.extra_outputs or kernel.order[-1] != len(domain) - 1:
            raise CodegenError(f"{kernel.name}: a storage order for a kernel that is not elementwise")
        stored = tuple(domain[d] for d in kernel.order)
        inner_stored = tuple(sorted(kernel.order.index(d) for d in inner_dims))  # (a row's dims, where stored)
        lowering = _Lowering(stored, inner_stored, buffer_names, exact_mean, kernel.stored, kernel.fused)
        at = [lowering.index[kernel.order.index(d)] for d in range(len(domain))]
        value, out_index = lowering.compute(tree, at), linear_index(lowering.index, stored)
    elif reduce_root:
        lowering = _Lowering(domain, inner_dims, buffer_names, exact_mean, kernel.stored, kernel.fused)
        kept = [lowering.index[d] for d in range(len(domain)) if d not in _dims(tree) or tree.attr("keepdim")]
        value = lowering.compute(tree, kept)
        out_index = linear_index(kept, root.shape)
    else:
        lowering = _Lowering(domain, inner_dims, buffer_names, exact_mean, kernel.stored, kernel.fused)
        value = lowering.compute(tree, lowering.index)
        out_index = linear_index(lowering.index, root.shape)
    params = [Param(buffer_names[id(n)], n.dtype, "in") for n in kernel.inputs]
    params.append(Param(buffer_names[id(root)], root.dtype, "out"))
    # values stored beside the output (sharing.py), element k at the domain's k-th index, or
    # per row, at the k-th outer index (a norm's statistics), once the row's reductions are done
    rows = [1 if d in inner_dims else n for d, n in enumerate(domain)]
    at_row = [Affine() if d in inner_dims else i for d, i in enumerate(lowering.index)]
    if any(n.numel not in (root.numel, math.prod(rows)) for n in kernel.extra_outputs):
        raise CodegenError(f"{kernel.name} stores a value of neither its own size nor one per row")
    extra = [(buffer_names[id(n)], linear_index(lowering.index, domain),
              lowering.compute(_reshaped(n, domain), lowering.index), True) if n.numel == root.numel else
             (buffer_names[id(n)], linear_index(at_row, rows), lowering.compute(_reshaped(n, rows), at_row), False)
             for n in kernel.extra_outputs]
    params += [Param(buffer_names[id(n)], n.dtype, "out") for n in kernel.extra_outputs]
    out = LoopKernel(kernel.name, params, lowering.outer, lowering.inner, lowering.reductions,
                     buffer_names[id(root)], out_index, value, not reduce_root, extra_stores=extra)
    problem = out_of_bounds(out, {buffer_names[id(n)]: n.numel for n in (*kernel.inputs, root, *kernel.extra_outputs)})
    if problem:  # (a lowering bug: refused here rather than read or written past a buffer)
        raise CodegenError(f"{kernel.name} would access memory outside a buffer: {problem}")
    _stash_last_reduction(out, root.dtype)
    return out


def probe(kernel: Kernel):
    """The kernel's value at a symbolic index (variable `d<k>` for dim k, loads named "?"), or
    None where it has reductions (a row composite's too, once expanded) or cannot be lowered."""
    try:
        tree, domain, _ = _layout(kernel.output, False, kernel.fused)
    except (IllegalKernel, CodegenError):
        return None
    if tree.group == "reduction" or any(n.group == "reduction" for n in kernel.ops):
        return None
    lowering = _Lowering(domain, None, {}, False, kernel.stored, kernel.fused)
    value = lowering.compute(tree, lowering.index)
    return None if lowering.found else value


def _layout(root: Node, exact_mean: bool = False, fused: frozenset = frozenset()):
    """(expanded tree, loop domain, inner dims) of the kernel rooted at `root`.

    Legality is a matter of index maps, not shapes: the tree is evaluated once
    at a symbolic index (one variable per domain dim, fresh variables for each
    reduction's reduced dims), and every reduction must then reduce as many
    elements as the inner loop runs, at a row position that uses outer
    variables only.  Raises IllegalKernel naming the reductions that cannot."""
    origin: dict[int, Node] = {}
    tree = expand_rows(root, origin, exact_mean)
    if tree.group == "layout":  # a program output that is a view: copy it
        tree = Node.make("add", (tree, const(0.0)))
    domain = tuple(tree.args[0].shape if tree.group == "reduction" else tree.shape)
    probe = _Lowering(domain, None, {}, fused=fused)
    if tree.group == "reduction":
        probe.compute(tree, [probe.index[d] for d in range(len(domain))
                             if d not in _dims(tree) or tree.attr("keepdim")])
    else:
        probe.compute(tree, probe.index)
    depth = _inline_depth(root)
    found = sorted(probe.found, key=lambda f: depth.get(id(origin.get(id(f[0]), f[0])), 1 << 30))
    # a reduction at the root reduces over the inner loop by definition
    inner = {tuple(d for d in _dims(tree) if domain[d] != 1)} if tree.group == "reduction" else None
    blamed = []
    for node, used, count in found:
        free = [d for d in range(len(domain)) if domain[d] != 1 and f"d{d}" not in used]
        options = {s for s in _subsets(free) if math.prod(domain[d] for d in s) == count}
        if any(not v.startswith("d") for v in used) or not (options if inner is None else inner & options):
            blamed.append(origin.get(id(node), node))
        else:
            inner = options if inner is None else inner & options
    if blamed:
        raise IllegalKernel(blamed)
    if inner is None:
        return tree, domain, ((len(domain) - 1,) if domain else ())
    return tree, domain, max(inner, key=lambda s: (sorted(s, reverse=True), len(s)))


def _subsets(dims):
    return {tuple(d for k, d in enumerate(dims) if mask >> k & 1) for mask in range(1 << len(dims))}


def _inline_depth(root: Node) -> dict[int, int]:
    """Inline edges between `root` and each node its kernel computes: the
    reductions nearest the root decide the loop nest, the others give way."""
    depth, frontier = {id(root): 0}, [root]
    while frontier:
        following = []
        for n in frontier:
            for _, target in inline_edges(n):
                if id(target) not in depth:
                    depth[id(target)] = depth[id(n)] + 1
                    following.append(target)
        frontier = following
    return depth


def _dims(node: Node) -> tuple:
    rank = len(node.args[0].shape)
    return tuple(sorted(d % rank for d in node.attr("dims")))


STASH_LIMIT = 16384  # floats: a row's stash lives on the stack (64 KB), like Inductor's local buffer


def _stash_last_reduction(k: LoopKernel, dtype: str) -> None:
    """When the store recomputes the last reduction's body at the same element,
    keep the body in a per-row stash during the reduction and read it back."""
    if not (k.store_in_inner and k.reductions and dtype == "float32" and 0 < k.inner <= STASH_LIMIT
            and k.reductions[-1].dtype == "float32"):
        return
    body = k.reductions[-1].body
    if isinstance(body, (Load, Const)) or not contains(k.value, body):
        return
    k.value = substitute(k.value, body, Load(STASH, Affine.var("r", k.inner)))
    k.stash_last = True


def _decompose(var: str, sizes) -> list[Affine]:
    """Row-major digits of a linear loop variable over `sizes`."""
    total = math.prod(sizes)
    if total == 0:
        return [Affine() for _ in sizes]
    linear, stride, out = Affine.var(var, total), total, []
    for size in sizes:
        stride //= size
        out.append(linear.floordiv(stride).mod(size))
    return out


def _reshaped(node: Node, shape) -> Node:
    """`node` as a value of this shape, in row-major order, computed inline."""
    if tuple(node.shape) == tuple(shape):
        return node
    return Node.make("reshape", (Node.make("inline", (node,)),), {"shape": tuple(shape)})


EMPTY_REDUCTION = {"sum": 0.0, "mean": math.nan, "amax": -math.inf}


class _Lowering:
    """Evaluates a kernel tree at a symbolic index.  With `inner_dims` None it
    is the probe of `_layout`: one variable per domain dim, and it records each
    reduction's row-position variables and element count in `found`."""

    def __init__(self, domain, inner_dims, buffer_names, exact_mean: bool = False, stored: frozenset = frozenset(),
                 fused: frozenset = frozenset()):
        self.buffer_names, self.exact_mean, self.stored, self.fused = buffer_names, exact_mean, stored, fused
        self.probing = inner_dims is None
        self.reductions: list[Reduction] = []
        self.found: list[tuple[Node, set, int]] = []
        self._accs: dict[tuple, Acc] = {}
        self._gathers = 0
        self.index = [None] * len(domain)
        if inner_dims is None:
            self.outer = self.inner = 0
            self.index = [Affine.var(f"d{d}", n) for d, n in enumerate(domain)]
            return
        outer_dims = tuple(d for d in range(len(domain)) if d not in inner_dims)
        self.outer = math.prod(domain[d] for d in outer_dims)
        self.inner = math.prod(domain[d] for d in inner_dims)
        for var, dims in (("o", outer_dims), ("r", inner_dims)):
            for d, index in zip(dims, _decompose(var, [domain[d] for d in dims])):
                self.index[d] = index

    def operand(self, a: Node, index):
        """How a consumer sees one operand edge."""
        if a.op == "const":
            return Const(a.attr("value"))
        if a.op == "inline" and id(a.args[0]) not in self.stored:
            return self.compute(a.args[0], index)
        if a.op == "inline":  # a value another kernel stores (sharing.py)
            a = a.args[0]
        elif a.group == "layout":
            return self.operand(a.args[0], view_index(a, index))
        if id(a) in self.fused:  # a value this kernel computes although another stored it (Kernel.fused)
            return self.compute(a, index)
        if id(a) not in self.buffer_names and not self.probing:
            raise CodegenError(f"{a.op} is read but never materialised")
        return Load(self.buffer_names.get(id(a), "?"), linear_index(index, a.shape))

    def compute(self, n: Node, index):
        if n.op in ("input", "const") or n.group == "layout":
            return self.operand(n, index)
        if n.group == "reduction":
            return self.reduction(n, index)
        if n.group == "concat":
            return self.concat(n, index)
        if n.group == "gather":
            return self.gather(n, index)
        if n.group != "pointwise":
            raise CodegenError(f"{n.op} cannot be computed inside a generated kernel")
        if n.op == "cast" and n.dtype == "bool":  # nonzero is true, in every target
            return Call("ne", (self.operand(n.args[0], index), Const(0.0)), "bool")
        return Call(n.op, tuple(self.operand(a, broadcast_index(index, n.shape, a.shape)) for a in n.args),
                    n.dtype)

    def concat(self, n: Node, index):
        """cat(a, b): a where the position along dim is below a's size, else b.  Each operand is
        read at its position modulo its size, so both reads stay in bounds whichever is chosen
        (a target may evaluate both sides: Triton's `where`, or a vectorised C++ select)."""
        a, b = n.args
        d = n.attr("dim") % len(n.shape)
        na, nb = a.shape[d], b.shape[d]
        if na == 0 or nb == 0:
            return self.operand(b if na == 0 else a, index)
        i = index[d]
        first, second = list(index), list(index)
        first[d] = i.mod(na)
        second[d] = (i + Affine.of(nb * -(-na // nb) - na)).mod(nb)  # (i - na) mod nb, offset kept >= 0
        return Call("where", (Call("lt", (Index(i), Const(float(na))), "bool"),
                              self.operand(a, first), self.operand(b, second)), n.dtype)

    def gather(self, n: Node, index):
        """embedding(weight, ids) at (i..., d) is weight[ids[i...], d]; gather(source, ids)
        along dim at i is source[i with ids[i] along dim].  The row is a variable of its
        own that the target sets from the index (clamped, checked: loopir.Gather)."""
        source, ids = n.args
        if source.op == "inline" and id(source.args[0]) not in self.stored:
            raise CodegenError(f"{n.op}: its source is read by row number, so it must be in memory")
        var = f"g{self._gathers}"
        self._gathers += 1
        if n.op == "embedding":
            rows, at, ids_index = source.shape[0], [None, index[-1]], index[:-1]
        else:
            d = n.attr("dim") % len(n.shape)
            rows, at, ids_index = source.shape[d], list(index), index
            at[d] = None
        at = [Affine.var(var, rows) if i is None else i for i in at]
        return Gather(self.operand(source, at), var, self.operand(ids, ids_index), rows)

    def reduction(self, node: Node, index):
        """The reduction's value at `index` (of its result): an accumulator over
        the inner loop, whose row position `index` must not vary along it."""
        src, dims = node.args[0].shape, _dims(node)
        kept = [d for d in range(len(src)) if d not in dims]
        row = [index[d] for d in kept] if node.attr("keepdim") else list(index)
        count = math.prod(src[d] for d in dims)
        if count == 0:
            return Const(EMPTY_REDUCTION[node.op])
        full = [None] * len(src)
        for d, i in zip(kept, row):
            full[d] = i
        if count == 1:  # one element: the reduction is its operand, in the reduction's dtype (a sum
            for d in dims:  # of bools is an int64: negated as a bool, Triton's int1 -true is true)
                full[d] = Affine()
            value = self.operand(node.args[0], full)
            return value if node.args[0].dtype == node.dtype else Call("cast", (value,), node.dtype)
        key = (id(node), tuple(str(i) for i in row))
        if key not in self._accs:
            reduced = ([Affine.var(f"red{len(self._accs)}_{len(self.found)}_{d}", src[d]) for d in dims]
                       if self.probing
                       else _decompose("r", [src[d] for d in dims]))
            for d, i in zip(dims, reduced):
                full[d] = i
            if self.probing:
                self.found.append((node, set().union(*(_variables(i) for i in row)), count))
            elif any("r" in _variables(i) for i in row):
                raise CodegenError(f"{node.op}: row position varies along the inner loop (an illegal fusion)")
            elif count != self.inner:  # (a value stored beside the output: `_layout` probed the output only)
                raise CodegenError(f"{node.op} reduces {count} elements, and its kernel's rows have {self.inner}")
            body = self.operand(node.args[0], full)  # nested reductions come first
            exact = self.exact_mean and node.op == "mean"  # divided in double by the renderer
            red = Reduction(f"acc{len(self.reductions)}", "max" if node.op == "amax" else "mean" if exact else "sum",
                            body, node.dtype if node.dtype in ops.INTEGERS else "float32")
            # the same reduction reached by another node (a norm's composite and the statistics a
            # training forward saves, written out): one accumulator
            same = [r for r in self.reductions if (r.combiner, _squares(r.body), r.dtype) ==
                    (red.combiner, _squares(red.body), red.dtype)]
            if not same:
                self.reductions.append(red)
            self._accs[key] = Acc((same or [red])[0].acc)
        acc = self._accs[key]
        if node.op != "mean" or self.exact_mean:
            return acc
        # a true division, as torch's: `sum * (1/n)` rounds, and a constant row is then not centred exactly
        return Call("div", (acc, Const(float(count))), node.dtype)


def _squares(e):
    """An expression with pow(a, 2) written a * a (torch computes it so), for comparing two."""
    if isinstance(e, Call):
        args = tuple(_squares(a) for a in e.args)
        if e.op == "pow" and args[1] == Const(2.0):
            return Call("mul", (args[0], args[0]), e.dtype)
        return Call(e.op, args, e.dtype)
    return e


def _variables(index: Affine) -> set:
    out = set()
    for term, _ in index.terms:
        out |= {term[1]} if term[0] == "var" else _variables(term[1])
    return out
