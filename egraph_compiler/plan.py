"""Plan: the extracted program as kernels, with their estimated cost.

A kernel computes one materialised tensor: a generated loop nest, a library
call (matmul, linear, sdpa) or an ATen fallback (extern ops, and dtypes the
generated code does not handle).  Kernel boundaries come from extraction: an
operand behind an `inline` node is computed inside its consumer's kernel, any
other operand is a tensor in memory.  Layout ops are views: they never form a
kernel of their own but become index maps in the loads that read them (torch
views before a library call); a layout op that is a program output is copied.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from . import ops
from .cost import DeviceProfile, itemsize, kernel_cost, op_flops
from .graph import Graph, Node, topo_order, type_str

GENERATED_DTYPES = {"float32", "bool", "weak"}


@dataclass
class Kernel:
    name: str
    kind: str  # generated | library | aten
    output: Node
    ops: list[Node]  # nodes computed inside, in order (the output last)
    inputs: list[Node]  # materialised tensors read (through views)
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    reason: str = ""  # why an ATen fallback
    loop_nest: str = ""  # the kernel whose loop nest also computes this one (horizontal fusion)

    def __str__(self) -> str:
        names = " -> ".join(n.op for n in self.ops if n.group != "boundary")
        extra = f"  [fallback: {self.reason}]" if self.reason else ""
        extra += f"  [in {self.loop_nest}'s loop nest]" if self.loop_nest else ""
        return (f"{self.name} ({self.kind}): {names} : {type_str(self.output)}  "
                f"flops={self.flops:.3g} bytes={self.bytes:.3g} est={self.seconds * 1e6:.1f}us{extra}")


@dataclass
class Plan:
    graph: Graph
    kernels: list[Kernel]
    fallbacks: list[str] = field(default_factory=list)  # "op (where)", one per fallback kernel
    rules_fired: dict[str, int] = field(default_factory=dict)
    extraction: str = ""  # how extraction chose, and its costs

    @property
    def cost(self) -> float:
        return sum(k.seconds for k in self.kernels)

    def count(self, op_name: str) -> int:
        """How many nodes with this op the program computes (views included)."""
        return sum(1 for n in topo_order(self.graph.outputs) if n.op == op_name)

    def ops(self) -> Counter:
        return Counter(n.op for n in topo_order(self.graph.outputs) if n.group not in ("source", "boundary"))

    def __str__(self) -> str:
        lines = [f"plan: {len(self.kernels)} kernel(s), estimated {self.cost * 1e6:.1f}us"]
        lines += ["  " + str(k) for k in self.kernels]
        if self.fallbacks:
            lines.append("  fallbacks to ATen: " + "; ".join(self.fallbacks))
        fired = ", ".join(f"{k} x{v}" for k, v in sorted(self.rules_fired.items()) if v)
        lines.append("  rules fired: " + (fired or "none"))
        if self.extraction:
            lines.append("  " + self.extraction)
        return "\n".join(lines)


def make_plan(graph: Graph, profile: DeviceProfile, rules_fired=None) -> Plan:
    """One kernel per materialised node, in dependency order."""
    graph = legalize(graph)
    outputs = {id(o) for o in graph.outputs}
    kernels: list[Kernel] = []
    fallbacks: list[str] = []
    done: set[int] = set()
    stack = [(o, False) for o in reversed(graph.outputs)]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        if node.group == "source":
            done.add(id(node))
            continue
        if node.group == "layout" and id(node) not in outputs and node.args[0].op != "inline":
            done.add(id(node))
            stack.append((node.args[0], False))  # a view: only its source must exist
            continue
        body, inputs = kernel_body(node)
        if not ready:
            stack.append((node, True))
            stack.extend((i, False) for i in reversed(inputs) if id(i) not in done)
            continue
        done.add(id(node))
        kind, reason = _kind(node, body, inputs)
        kernel = Kernel(f"k{len(kernels)}", kind, node, body, inputs, reason=reason)
        _estimate(kernel, profile)
        kernels.append(kernel)
        if kind == "aten":
            fallbacks.append(_fallback_entry(node, reason, graph))
    return Plan(graph, kernels, fallbacks, dict(rules_fired or {}))


def _fallback_entry(node: Node, reason: str, graph: Graph) -> str:
    if node.op == "extern":
        call = node.attr("target")
        return f"{str(call).split('#')[0]} ({reason}; {call.where})"
    return f"{node.op} ({reason}; {graph.where.get(id(node), 'no source line')})"


def legalize(graph: Graph) -> Graph:
    """A loop nest reduces over one set of dims of one domain.  Fusion rules
    check each edge on its own, so a kernel can end up holding reductions over
    different dims (softmax over rows feeding a reduction over columns): the
    inlined reductions that disagree with the kernel's first one are
    materialised instead (their `inline` edge becomes a plain edge)."""
    while True:
        cut = _conflicting_inline(graph)
        if not cut:
            return graph
        graph = _rebuild(graph, cut)


def _conflicting_inline(graph: Graph) -> set[int]:
    cut: set[int] = set()
    for node in topo_order(graph.outputs):
        if node.group in ("source", "boundary", "library", "extern"):
            continue
        domain = node.args[0].shape if node.group == "reduction" else node.shape
        first = _reduction_key(node, domain) if node.group in ("reduction", "row") else None
        for edge, target in _inline_edges(node):
            for n in _reductions_in(target):
                key = _reduction_key(n, domain)
                if first is None and key is not None:
                    first = key
                if key is None or key != first:
                    cut.add(id(edge))
                    break
    return cut


def _reduction_key(n: Node, domain):
    if n.group == "row":
        return (tuple(n.shape), tuple(sorted(d % len(n.shape) for d in _row_dims(n)))) \
            if tuple(n.shape) == tuple(domain) else None
    if tuple(n.args[0].shape) != tuple(domain):
        return None
    return (tuple(domain), tuple(sorted(d % len(domain) for d in n.attr("dims"))))


def _row_dims(n: Node):
    if n.op in ("softmax", "log_softmax"):
        return (n.attr("dim"),)
    return tuple(range(-n.attr("ndim"), 0))


def _inline_edges(node: Node):
    """(inline node, its target) for each operand computed inside this kernel."""
    for a in node.args:
        while a.group == "layout":
            a = a.args[0]
        if a.op == "inline":
            yield a, a.args[0]


def computed_nodes(root: Node):
    """`root` and every node below it reached through inline edges (and views):
    what one kernel computes."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        stack.extend(t for _, t in _inline_edges(n))


def _reductions_in(target: Node):
    """Reductions (and row composites) computed at this inline target or below it in the kernel."""
    return (n for n in computed_nodes(target) if n.group in ("reduction", "row"))


def _rebuild(graph: Graph, cut: set[int]) -> Graph:
    """The graph with the `inline` nodes in `cut` replaced by their targets."""
    memo: dict[int, Node] = {}
    for node in topo_order(graph.outputs):
        if id(node) in cut:
            memo[id(node)] = memo[id(node.args[0])]
            continue
        args = tuple(memo[id(a)] for a in node.args)
        if node.group == "source" or args == node.args:
            memo[id(node)] = node
        elif node.op == "extern":
            memo[id(node)] = Node.make("extern", args, node.a, shape=node.shape, dtype=node.dtype)
        else:
            memo[id(node)] = Node.make(node.op, args, node.a)
    outputs = tuple(memo[id(o)] for o in graph.outputs)
    where = {**graph.where, **{id(memo[k]): v for k, v in graph.where.items() if k in memo}}
    return Graph(graph.inputs, outputs, graph.bound, where, graph.mutations)


def kernel_body(root: Node) -> tuple[list[Node], list[Node]]:
    """(nodes computed by the kernel rooted at `root`, in order; the
    materialised tensors it reads)."""
    body: list[Node] = []
    inputs: list[Node] = []
    computed: set[int] = set()
    read: set[int] = set()

    def operand(a: Node) -> None:
        while a.group == "layout":  # views are index maps over their source
            a = a.args[0]
        if a.op == "inline":
            compute(a.args[0])
        elif a.op != "const" and id(a) not in read:
            read.add(id(a))
            inputs.append(a)

    def compute(n: Node) -> None:
        if id(n) in computed:
            return
        computed.add(id(n))
        if n.op == "input":
            operand(n)
            return
        for a in n.args:
            operand(a)
        body.append(n)

    compute(root)
    return body, inputs


def view_source(node: Node) -> Node:
    """The tensor a chain of views reads from."""
    while node.group == "layout":
        node = node.args[0]
    return node


def _kind(node: Node, body, inputs) -> tuple[str, str]:
    if node.op == "extern":
        return "aten", "op outside the vocabulary"
    if node.group == "library":
        return "library", ""
    dtypes = {n.dtype for n in body} | {i.dtype for i in inputs}
    if not dtypes <= GENERATED_DTYPES:
        return "aten", f"dtype {', '.join(sorted(dtypes - GENERATED_DTYPES))} in generated C++"
    return "generated", ""


def _estimate(kernel: Kernel, profile: DeviceProfile) -> None:
    node = kernel.output
    kernel.bytes = node.numel * itemsize(node.dtype) + sum(
        math.prod(i.shape) * itemsize(i.dtype) for i in kernel.inputs)
    kernel.flops = sum(op_flops(n.op, n.shape, [a.shape for a in n.args]) for n in kernel.ops
                       if n.group not in ("layout", "extern", "boundary", "source"))
    kernel.seconds = kernel_cost(kernel.flops, kernel.bytes, profile, library=kernel.kind == "library")


def check_plan(plan: Plan) -> None:
    """Invariants (a verifier pass, run in tests): every kernel input is
    materialised by an earlier kernel or is a program input, and is a real
    buffer (not a view or a boundary marker)."""
    ready = {id(n) for n in plan.graph.inputs}
    for k in plan.kernels:
        for i in k.inputs:
            assert id(i) in ready, f"{k.name} reads {i} before it is computed"
            assert i.group not in ("layout", "boundary"), f"{k.name} reads a view or a boundary as a buffer"
        ready.add(id(k.output))
    for o in plan.graph.outputs:
        assert id(o) in ready or o.op in ("input", "const"), f"output {o} is never computed"
    assert all(op in ops.OPS for op in plan.ops()), "plan holds an op outside the table"
