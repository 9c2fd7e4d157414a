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

    def __str__(self) -> str:
        names = " -> ".join(n.op for n in self.ops if n.group != "boundary")
        extra = f"  [fallback: {self.reason}]" if self.reason else ""
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
