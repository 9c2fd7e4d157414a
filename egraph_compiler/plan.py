"""Plan: the extracted program as kernels, with their estimated cost.

A kernel computes one materialised tensor: a generated loop nest (pointwise,
reduction or row composite), a library call (matmul, linear, sdpa) or an ATen
fallback (extern ops, and dtypes the generated code does not handle).  Layout
ops are views: they never form a kernel of their own, they become index maps
in the loads of the kernels that read them (or torch views before a library
call); a layout op that is itself a program output gets a copy kernel.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from . import ops
from .cost import DeviceProfile, itemsize, kernel_cost, op_flops
from .graph import Graph, Node, format_attr, topo_order, type_str

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
        names = " -> ".join(n.op for n in self.ops)
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
        return Counter(n.op for n in topo_order(self.graph.outputs) if n.group != "source")

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
    for node in topo_order(graph.outputs):
        if node.group == "source" or (node.group == "layout" and id(node) not in outputs):
            continue
        inputs = materialised_inputs(node)
        kind, reason = _kind(node, inputs)
        kernel = Kernel(f"k{len(kernels)}", kind, node, [node], inputs, reason=reason)
        _estimate(kernel, profile)
        kernels.append(kernel)
        if kind == "aten":
            what = str(node.attr("target")).split("#")[0] if node.op == "extern" else node.op
            fallbacks.append(f"{what} ({reason}; {graph.where.get(id(node), 'no source line')})")
    return Plan(graph, kernels, fallbacks, dict(rules_fired or {}))


def view_source(node: Node) -> Node:
    """The materialised tensor a chain of views reads from."""
    while node.group == "layout":
        node = node.args[0]
    return node


def materialised_inputs(node: Node) -> list[Node]:
    seen, out = set(), []
    for a in node.args:
        src = view_source(a)
        if src.op != "const" and id(src) not in seen:
            seen.add(id(src))
            out.append(src)
    return out


def _kind(node: Node, inputs) -> tuple[str, str]:
    if node.op == "extern":
        return "aten", "op outside the vocabulary"
    if node.group == "library":
        return "library", ""
    dtypes = {node.dtype} | {view_source(a).dtype for a in node.args}
    if not dtypes <= GENERATED_DTYPES:
        return "aten", f"dtype {', '.join(sorted(dtypes - GENERATED_DTYPES))} in generated C++"
    return "generated", ""


def _estimate(kernel: Kernel, profile: DeviceProfile) -> None:
    node = kernel.output
    kernel.bytes = node.numel * itemsize(node.dtype) + sum(
        math.prod(i.shape) * itemsize(i.dtype) for i in kernel.inputs)
    if node.group not in ("layout", "extern"):
        kernel.flops = op_flops(node.op, node.shape, [a.shape for a in node.args])
    kernel.seconds = kernel_cost(kernel.flops, kernel.bytes, profile, library=kernel.kind == "library")


def describe(node: Node) -> str:
    return f"{node.op}(" + ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs) + ")"


def check_plan(plan: Plan) -> None:
    """Invariants (a verifier pass, run in tests): every kernel input is
    materialised by an earlier kernel or is a program input."""
    ready = {id(n) for n in plan.graph.inputs}
    for k in plan.kernels:
        for i in k.inputs:
            assert id(i) in ready or i.op == "const", f"{k.name} reads {i} before it is computed"
        ready.add(id(k.output))
    for o in plan.graph.outputs:
        assert id(o) in ready or o.op in ("input", "const"), f"output {o} is never computed"
    assert all(op in ops.OPS for op in plan.ops()), "plan holds an op outside the table"
