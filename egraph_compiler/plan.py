"""Plan: the extracted program as kernels, with their estimated cost.

A kernel computes one materialised tensor: a generated loop nest, a library
call (matmul, linear, sdpa) or an ATen fallback (extern ops, and dtypes the
generated code does not handle).  Kernel boundaries come from extraction: an
operand behind an `inline` node is computed inside its consumer's kernel, any
other operand is a tensor in memory.  Layout ops are views: they never form a
kernel of their own but become index maps in the loads that read them (torch
views before a library call); a program output that is a view of a stored
tensor is that view (the runtime copies it where it is not contiguous, or views
an input the caller owns).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from . import ops
from .cost import ELEMENTWISE, DeviceProfile, extra_passes, itemsize, kernel_cost, op_flops, repeats
from .errors import CodegenError
from .graph import Graph, Node, inline_edges, rebuild, topo_order, type_str, view_chain, view_source
from .expression_size import oversized_edges
from .kinds import kernel_kind
from .lower import illegal_edges



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
    # multi-output kernels (sharing.py): values this kernel computes inline and also stores,
    # and the values other kernels store that it reads instead of computing them (node ids)
    extra_outputs: list[Node] = field(default_factory=list)
    stored: frozenset = frozenset()
    # values other kernels would store (per-row statistics) that this one computes from their
    # operands instead of reading them, and stores itself (sharing.share_row_values; node ids)
    fused: frozenset = frozenset()
    order: tuple = ()  # the output's dims as stored, outermost first, where not row-major (orders.py)

    @property
    def outputs(self) -> list[Node]:
        return [self.output] + self.extra_outputs

    def __str__(self) -> str:
        names = " -> ".join(n.op for n in self.ops if n.group != "boundary")
        extra = f"  [fallback: {self.reason}]" if self.reason else ""
        extra += f"  [in {self.loop_nest}'s loop nest]" if self.loop_nest else ""
        extra += "".join(f"  [also stores {n.op}: {type_str(n)}]" for n in self.extra_outputs)
        extra += f"  [stored as dims {self.order}]" if self.order else ""
        return (f"{self.name} ({self.kind}): {names} : {type_str(self.output)}  "
                f"flops={self.flops:.3g} bytes={self.bytes:.3g} est={self.seconds * 1e6:.1f}us{extra}")


@dataclass
class Plan:
    graph: Graph
    kernels: list[Kernel]
    fallbacks: list[str] = field(default_factory=list)  # "op (where)", one per fallback kernel
    rules_fired: dict[str, int] = field(default_factory=dict)
    extraction: str = ""  # how extraction chose, and its costs
    alias_inputs: bool = False  # outputs that view an input are returned as views (no copy kernel)
    profile: DeviceProfile | None = None  # the device profile the estimates used

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


def make_plan(graph: Graph, profile: DeviceProfile, target, alias_inputs: bool = False, rules=()) -> Plan:
    """One kernel per materialised node, in dependency order.  Fusion rules
    judge each edge alone, so a kernel can hold reductions that no single
    loop nest computes (rows feeding a reduction over columns): the index-map
    check of lowering names those inline edges, which become materialised.  `rules`: the
    enabled rules (their horizontal fusion statements allow per-row values side by side)."""
    graph = _viewed_producers(graph, profile)
    while True:
        plan = _kernels(graph, profile, target, alias_inputs)
        # first the size of what the renderers would write (the legality probe walks that too)
        cut = set().union(*(oversized_edges(k.output) for k in plan.kernels if k.kind == "generated"))
        cut = cut or set().union(*(illegal_edges(k.output) for k in plan.kernels if k.kind == "generated"))
        cut = cut or _recomputed_under_a_max(plan)
        if not cut:
            from .sharing import share_results, share_row_values  # they build on this module's kernels
            return share_results(share_row_values(plan, profile, rules), profile)
        graph = rebuild(graph, lambda node, args: args[0] if id(node) in cut else None)  # cut edges materialise


def _recomputed_under_a_max(plan: Plan) -> set[int]:
    """The inline edges below an `amax` to values the plan stores or compares (a gradient picks
    the elements equal to the max, `x == amax(x)`): the max then reads the one stored copy that
    the comparison reads too.  Recomputed inside the max's kernel, a transcendental may round
    otherwise (libmvec's vector tanhf against glibc's scalar one in a short loop: no element
    equal, 0 / 0 gradients; training fuzz)."""
    stored = {id(k.output) for k in plan.kernels}
    compared = {id(_computed(a)) for n in topo_order(plan.graph.outputs) if n.op in ops.COMPARISONS
                for a in n.args}
    cut: set[int] = set()
    for kernel in plan.kernels:
        stack = [n for n in kernel.ops if n.op == "amax"] if kernel.kind == "generated" else []
        seen: set[int] = set()
        while stack:
            for edge, target in inline_edges(stack.pop()):
                if id(target) in stored or id(target) in compared:
                    cut.add(id(edge))
                elif id(target) not in seen:
                    seen.add(id(target))
                    stack.append(target)
    return cut


def _computed(a: Node) -> Node:
    """The value an operand reads: through its views and its fused edge."""
    a = view_source(a)
    return a.args[0] if a.op == "inline" else a


def _viewed_producers(graph: Graph, profile: DeviceProfile) -> Graph:
    """A generated kernel's operand that extraction chose as a view of a fused producer's
    materialised value (`mul(q, reshape(inline(cos)))`) is computed inside the consumer, at
    each of its elements, unless the consumer broadcasts it so often that a kernel of its own
    and a load cost less (cost.repeats: cos and sin of [1, S, D] positions read by every head
    of q).  A library call's such operand is a generated kernel of its own already (kernel_body)."""
    def rebase(view: Node) -> Node:
        source = view.args[0]
        base = source.args[0] if source.op == "inline" else rebase(source)
        return Node.make(view.op, (base, *view.args[1:]), view.a)

    def worth(view: Node, consumer: Node) -> bool:
        producer = view_source(view).args[0]
        times = repeats(consumer.group, consumer.numel, producer.numel)
        if times <= 1:
            return False
        own = Kernel("", "generated", producer, *kernel_body(producer))
        estimate(own, profile)
        repeated = sum(op_flops(n.op, n.shape, [a.shape for a in n.args], profile) for n in own.ops
                       if n.group in ELEMENTWISE) * (times - 1)
        return repeated / profile.flops > own.seconds + producer.numel * itemsize(producer.dtype) / profile.bandwidth

    def substitute(node: Node, args) -> Node | None:
        if node.group in ops.CALLS or node.group in ("layout", "source") or node.op == "inline":
            return None
        viewed = [a.group == "layout" and view_source(a).op == "inline" and worth(a, node) for a in args]
        if not any(viewed):
            return None
        return Node.make(node.op, tuple(rebase(a) if v else a for a, v in zip(args, viewed)), node.a)
    return rebuild(graph, substitute)


def _random_order(graph: Graph) -> dict[int, Node]:
    """Each random ATen call (dropout, rand) -> the one before it in the program: kernels follow
    data dependencies, and these also follow each other, so that with a fixed seed each draws
    what eager's did."""
    calls = sorted((n for n in graph.topo() if n.op == "extern" and n.attr("target").random),
                   key=lambda n: (n.attr("target").order, n.attr("target").item or 0))
    return {id(b): a for a, b in zip(calls, calls[1:])}


def _kernels(graph: Graph, profile: DeviceProfile, target, alias_inputs: bool = False) -> Plan:
    kernels: list[Kernel] = []
    fallbacks: list[str] = []
    done: set[int] = set()
    called = _called_views(graph)
    earlier = _random_order(graph)
    stack = [(o, False) for o in reversed(graph.outputs)]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        if node.group == "source":
            done.add(id(node))
            continue
        if node.group == "layout" and id(node) not in called and _stored_below(node, called).op != "inline":
            done.add(id(node))
            stack.append((node.args[0], False))  # a view: only its source must exist
            continue
        body, inputs = kernel_body(node, views=called)
        if not ready:
            stack.append((node, True))
            stack.extend((i, False) for i in reversed(inputs) if id(i) not in done)
            if id(node) in earlier and id(earlier[id(node)]) not in done:
                stack.append((earlier[id(node)], False))  # (the random call before it runs first)
            continue
        done.add(id(node))
        kind, reason = kernel_kind(node, body, inputs, target)
        kernel = Kernel(f"k{len(kernels)}", kind, node, body, inputs, reason=reason)
        estimate(kernel, profile)
        kernels.append(kernel)
        if kind == "aten":
            fallbacks.append(_fallback_entry(node, reason, graph))
    return Plan(graph, kernels, fallbacks, alias_inputs=alias_inputs, profile=profile)


def _called_views(graph: Graph) -> frozenset:
    """Views of fused producers that a library call reads: each is a generated kernel of its own
    (kernel_body), so a view of it elsewhere (a training forward's saved transpose of the
    activation the next matmul reads) reads that kernel's buffer instead of computing it again."""
    return frozenset(id(a) for n in topo_order(graph.outputs) if n.group in ops.CALLS for a in n.args
                     if a.group == "layout" and view_source(a).op == "inline")


def _stored_below(node: Node, called: frozenset) -> Node:
    """What a chain of views reads: its source, or the nearest view below it that a kernel stores."""
    node = node.args[0]
    while node.group == "layout" and id(node) not in called:
        node = node.args[0]
    return node


def _fallback_entry(node: Node, reason: str, graph: Graph) -> str:
    if node.op == "extern":
        call = node.attr("target")
        return f"{str(call).split('#')[0]} ({reason}; {call.where})"
    return f"{node.op} ({reason}; {graph.where.get(id(node), 'no source line')})"


def kernel_body(root: Node, stored: frozenset = frozenset(), views: frozenset = frozenset(),
                fused: frozenset = frozenset()) -> tuple[list[Node], list[Node]]:
    """(nodes computed by the kernel rooted at `root`, in order; the
    materialised tensors it reads).  `stored`: ids of fused values another
    kernel stores (sharing.py), read here instead of computed; `views`: views of
    fused producers that kernels store (`_called_views`), which a library call
    reads through the views above them (LLaMA's backward: the transpose of the
    silu * up product it stores for one matmul, for another's weight gradient);
    `fused`: ids of materialised values computed here all the same (Kernel.fused)."""
    body: list[Node] = []
    inputs: list[Node] = []
    computed: set[int] = set()
    read: set[int] = set()

    calls = root.group in ops.CALLS  # they read whole tensors, not index maps

    def operand(a: Node) -> None:
        view = a
        while a.group == "layout":  # views are index maps over their source
            if calls and a is not view and id(a) in views:
                break
            a = a.args[0]
        if a.group == "layout":  # a stored view below the call's own
            if id(a) not in read:
                read.add(id(a))
                inputs.append(a)
        elif a.op == "inline" and id(a.args[0]) in stored and not calls:
            a = a.args[0]
            if id(a) not in read:
                read.add(id(a))
                inputs.append(a)
        elif a.op == "inline" and calls and view is not a:
            if id(view) not in read:  # a view of a fused producer: its own generated kernel
                read.add(id(view))
                inputs.append(view)
        elif a.op == "inline":
            compute(a.args[0])
        elif id(a) in fused and not calls:
            compute(a)
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


def estimate(kernel: Kernel, profile: DeviceProfile) -> None:
    node = kernel.output
    kernel.bytes = sum(n.numel * itemsize(n.dtype) for n in kernel.outputs) + sum(
        math.prod(i.shape) * itemsize(i.dtype) for i in kernel.inputs)
    times = evaluations(kernel)
    kernel.flops = sum(op_flops(n.op, n.shape, [a.shape for a in n.args], profile) * times.get(id(n), 1.0)
                       for n in kernel.ops if n.group not in ("layout", "extern", "boundary", "source"))
    extra = extra_passes(node.op, [a.shape for a in node.args], node.a) * node.numel * itemsize(node.dtype)
    kernel.seconds = kernel_cost(kernel.flops, kernel.bytes, profile, library=kernel.kind == "library",
                                 link=node.group == "collective", serial_bytes=extra, op=node.op)


def evaluations(kernel: Kernel) -> dict[int, float]:
    """Per elementwise node computed inside the kernel, how often the kernel evaluates it per
    element of its own (cost.repeats, compounded along the consumers inside the kernel)."""
    inside = {id(n) for n in kernel.ops}
    times: dict[int, float] = {}
    for node in reversed(kernel.ops):  # (consumers after their operands)
        mine = times.get(id(node), 1.0) if node.group in ELEMENTWISE else 1.0
        for a in node.args:
            while id(a) not in inside and (a.group == "layout" or a.op == "inline"):
                a = a.args[0]  # (through views and the inline edge, to the value computed here)
            if id(a) in inside and a.group in ELEMENTWISE:
                times[id(a)] = max(times.get(id(a), 1.0), mine * repeats(node.group, node.numel, a.numel))
    return times


class PlanError(CodegenError):
    """A plan that breaks an invariant: a bug in the compiler, caught before it runs."""


def release_schedule(plan: Plan) -> list[list[Node]]:
    """Per kernel, the intermediate buffers that no later kernel (nor a program
    output) reads, so the runtime can drop them.  A kernel reads its `inputs`:
    every materialised tensor below it, including those its fused producers read."""
    keep = {id(n) for o in plan.graph.outputs for n in view_chain(o)} | \
        {id(n) for n in plan.graph.inputs}  # an output stored as a view (of a fused producer) is kept too
    last: dict[int, tuple[int, Node]] = {}
    for step, kernel in enumerate(plan.kernels):
        for node in kernel.inputs:
            last[id(node)] = (step, node)
    produced = {id(n) for k in plan.kernels for n in k.outputs}
    release: list[list[Node]] = [[] for _ in plan.kernels]
    for node_id, (step, node) in last.items():
        if node_id in produced and node_id not in keep:
            release[step].append(node)
    return release


def verify_plan(plan: Plan, release: list[list[Node]] | None = None) -> None:
    """The plan is valid by construction, checked on every compile: each value
    a kernel reads (its fused producers' reads included) is stored before and
    not yet released, each buffer is computed once, each output exists."""
    release = release_schedule(plan) if release is None else release
    live = {id(n) for n in plan.graph.inputs}
    released: set[int] = set()
    for step, k in enumerate(plan.kernels):
        for i in k.inputs:
            # a view is a buffer only where a kernel stored it (a view of a fused producer, for a library call)
            if i.group == "boundary" or (i.group == "layout" and id(i) not in live):
                raise PlanError(f"{k.name} reads a view or a boundary ({i.op}) as a buffer")
            if id(i) not in live:
                when = "after it is released" if id(i) in released else "before it is computed"
                raise PlanError(f"{k.name} ({k.output.op}) reads {i.op}{list(i.shape)} {when}")
        for out in k.outputs:
            if id(out) in live:
                raise PlanError(f"{k.name} computes {out.op} a second time")
            live.add(id(out))
        for dead in release[step]:
            live.discard(id(dead))
            released.add(id(dead))
    for o in plan.graph.outputs:
        if not {id(n) for n in view_chain(o)} & live and view_source(o).op not in ("input", "const"):
            raise PlanError(f"output {o.op}{list(o.shape)} is never computed")
    if not all(op in ops.OPS for op in plan.ops()):
        raise PlanError("plan holds an op outside the table")
