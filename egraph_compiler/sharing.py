"""Multi-output kernels: a value that several generated kernels compute inline
is stored by the first of them, beside its own output, and read by the later
ones.

Extraction prices each kernel alone, so a transformer's residual stream
(`h1 = x + attn`, `h2 = h1 + mlp`, ...) is recomputed from all its terms by
every later norm kernel: the k-th layer's norm reads 2k tensors, and a model's
norm kernels read a quadratic number of them.  The first kernel that computes
`h` already holds it in registers; one more store there lets every later kernel
read one tensor instead of all of `h`'s terms (Inductor's fused add + norm
kernels store the sum the same way).  Applied where it moves fewer bytes.

Per-row values go the other way (`share_row_values`): a training forward saves
layer_norm's mean and rstd, which extraction leaves to kernels of their own (the
row's sums in one, rstd in another) before the kernel that normalises the row
reads them; that kernel holds the same row and computes them from it, so it
stores them once its row's reductions are done, and the kernels go.
"""
from __future__ import annotations

from dataclasses import replace

from .cost import ELEMENTWISE, DeviceProfile, itemsize
from .dsl.parser import FuseRule
from .errors import CodegenError
from . import expression_size
from .graph import Node, topo_order, view_chain, view_source
from .loopir import Acc, Call, expressions, loads, stride
from .lower import IllegalKernel, lower_kernel
from .plan import Kernel, Plan, estimate, kernel_body
from .siblings import allowed, computed_op

# what a stored value's kernel may compute on the way to it: per-element arithmetic on
# the first kernel's own loop domain (no reduction or row composite that it would need
# to evaluate at other indices)
ON_THE_WAY = ELEMENTWISE | {"boundary"}


def share_results(plan: Plan, profile: DeviceProfile) -> Plan:
    """Values in run order, stored where that moves fewer bytes; then, largest values first, where
    it costs less by the estimate (equal bytes, but the later kernels stop recomputing it: BERT's
    bias-gradient column sum recomputed the GELU backward's erf and exp per element, beside the
    kernel that writes that value for the GEMMs)."""
    for by_estimate in (False, True):
        generated = [k for k in plan.kernels if k.kind == "generated"]
        produced = {id(n) for k in plan.kernels for n in k.outputs}
        seen_in: dict[int, int] = {}
        for k in generated:
            for n in k.ops:
                if n is not k.output:
                    seen_in[id(n)] = seen_in.get(id(n), 0) + 1
        candidates = [n for n in topo_order(plan.graph.outputs)
                      if seen_in.get(id(n), 0) >= 2 and id(n) not in produced and n.group == "pointwise"]
        for value in reversed(candidates) if by_estimate else candidates:
            _share(value, generated, profile, by_estimate)
    return plan


def _share(value: Node, generated: list[Kernel], profile: DeviceProfile, by_estimate: bool) -> None:
    users = [k for k in generated if any(n is value for n in k.ops) and k.output is not value]
    # the first user that can store it (a norm's statistics, reductions before its pointwise
    # kernel, cannot: they keep computing it), and the users after it (plan order is run order)
    at = next((i for i, k in enumerate(users) if _storable(k, value)), len(users))
    first, later = (users[at], users[at + 1:]) if at < len(users) else (None, [])
    if not later:
        return
    bodies = [_body(k, k.stored | {id(value)}, k.fused) for k in later]
    if not by_estimate:
        saved = sum(_bytes(k.inputs) - _bytes(inputs) for k, (_, inputs) in zip(later, bodies))
        if saved <= _bytes([value]):  # the store costs one write of the value
            return
    trials = [replace(first, extra_outputs=first.extra_outputs + [value])]
    trials += [replace(k, stored=k.stored | {id(value)}, ops=body, inputs=inputs) for k, (body, inputs) in zip(later, bodies)]
    for trial in trials:
        estimate(trial, profile)
    if by_estimate and sum(t.seconds for t in trials) >= first.seconds + sum(k.seconds for k in later) - 1e-12:
        return
    for k, trial in zip([first] + later, trials):
        k.extra_outputs, k.stored, k.ops, k.inputs = trial.extra_outputs, trial.stored, trial.ops, trial.inputs
        k.flops, k.bytes, k.seconds = trial.flops, trial.bytes, trial.seconds


def _body(k: Kernel, stored: frozenset, fused: frozenset) -> tuple[list[Node], list[Node]]:
    """kernel_body of a kernel that also stores values beside its output: what it computes and
    reads for its output, then for each of those values (one taken in beside the output reads
    what the output may no longer read once another value is stored: a random program's kernel
    lost an input that way, and its extra store read a buffer it was not passed)."""
    body, inputs = kernel_body(k.output, stored, fused=fused)
    computed, read = {id(n) for n in body}, {id(n) for n in inputs}
    for n in k.extra_outputs:
        more, reads = kernel_body(n, stored, fused=fused)
        body += [m for m in more if id(m) not in computed and not computed.add(id(m))]
        inputs += [i for i in reads if id(i) not in read and not read.add(id(i))]
    return body, inputs


def _storable(kernel: Kernel, value: Node) -> bool:
    """The kernel's loop nest runs over as many elements as the value has (its
    output is not a reduction), and it reaches the value by elementwise steps
    only: the kernel stores the value's k-th element at its own k-th index."""
    root = kernel.output
    if root.group == "reduction" or root.numel != value.numel:
        return False
    body, _ = kernel_body(value, kernel.stored, fused=kernel.fused)
    return all(n.group in ON_THE_WAY for n in body)


def _bytes(nodes) -> int:
    return sum(n.numel * itemsize(n.dtype) for n in nodes)


def share_row_values(plan: Plan, profile: DeviceProfile, rules=()) -> Plan:
    """A generated kernel `p` whose output has one value per row of a later row kernel `k`
    that computes that value inline, or reads it and can compute it from the same row, goes:
    `k` stores it (Kernel.extra_outputs, per row) where its lowering shows no reduction
    beyond those the two kernels had, no kernel between them reads it, and the estimate
    is lower (one launch and one read of the row fewer).  A value that `k` neither reads nor
    computes joins it as a sibling would (the rules' horizontal fusion statements)."""
    siblings = [r for r in rules if isinstance(r, FuseRule) and r.horizontal]
    refused: set[tuple] = set()  # (p, k, what k stores): a pair refused stays so until k takes another
    lowered: dict[tuple, tuple | None] = {}  # a kernel's `_lowered`, by what it computes (it lowers again when that changes)

    def absorbs(p: Kernel, k: Kernel) -> bool:
        key = (p.name, k.name, len(k.extra_outputs))
        if key in refused:
            return False
        if _absorb(plan, p, k, profile, siblings, lowered):
            return True
        refused.add(key)
        return False
    merged = True
    while merged:
        merged = False
        for k in [k for k in plan.kernels if k.kind == "generated" and k.output.group != "reduction"]:
            merged = any(absorbs(p, k) for p in plan.kernels if p is not k)
            if merged:
                break
    # a value stored only for a kernel that went (the row's sum, for rstd's kernel) is not stored
    kept = {id(n) for o in plan.graph.outputs for n in view_chain(o)}
    kept |= {id(view_source(i)) for q in plan.kernels for i in q.inputs}
    for k in plan.kernels:
        if any(id(n) not in kept for n in k.extra_outputs):  # (share_results runs after this)
            k.extra_outputs = [n for n in k.extra_outputs if id(n) in kept]
            estimate(k, profile)
    return plan


def _absorb(plan: Plan, p: Kernel, k: Kernel, profile: DeviceProfile, siblings, lowered: dict) -> bool:
    value = p.output
    if (p.kind != "generated" or p.extra_outputs or p.fused or value.numel == 0 or value.group == "layout"
            or k.output.numel % value.numel or value.numel > k.output.numel):
        return False  # (a view as output: one a library call reads, the kernel's output is that view)
    computed = any(n is value for n in k.ops)
    if value.numel == k.output.numel and not computed:
        return False  # (of the kernel's own size: a value it computes on the way, a norm's x-hat saved)
    reads = any(i is value for i in k.inputs)
    # `k` neither reads nor computes it, but holds all it reads (rstd from the row, where `k`
    # normalises through the rms_norm composite and extraction wrote the statistics out)
    own = {id(n) for n in k.extra_outputs} | set(k.fused)
    beside = (not computed and not reads and allowed(siblings, computed_op(k.output), value.op)
              and all(id(i) in own or any(i is j for j in k.inputs) for i in p.inputs))
    if not (computed or reads or beside):
        return False
    between = plan.kernels[plan.kernels.index(p) + 1:plan.kernels.index(k)]  # (none where p runs later)
    if any(n is value for q in between for i in q.inputs for n in view_chain(i)):  # (it, or a view of it)
        return False
    fused = k.fused | ({id(value)} if reads else set()) | ({id(i) for i in p.inputs if id(i) in own} if beside else set())
    body, inputs = _body(k, k.stored, fused)
    trial = Kernel(k.name, "generated", k.output, body, inputs, extra_outputs=k.extra_outputs + [value],
                   stored=k.stored, fused=fused)
    inside = {id(n) for n in body}  # (what `k` computes beside its output's body stays, `p`'s joins)
    beside_ops = [n for n in k.ops + (p.ops if beside else []) if id(n) not in inside]
    trial.ops = list({id(n): n for n in beside_ops}.values()) + body
    estimate(trial, profile)  # (first: the estimate refuses most pairs, and lowering costs more)
    if trial.seconds >= k.seconds + p.seconds:
        return False
    before, after = _lowered_once(k, lowered), _lowered(trial)
    if after is None or before is None or after[0] > before[0] + (_lowered_once(p, lowered) or (0,))[0] * (not computed):
        return False
    if after[1] > max(before[1], 1):  # it would read along columns what `k` reads along rows
        return False
    if value.numel < k.output.numel and not after[2]:
        return False
    if after[3] > max(before[3], expression_size.MAX_EXPRESSION):  # the source it would write (soak 32003: 17 MB of C++)
        return False
    k.ops, k.inputs, k.extra_outputs, k.fused = trial.ops, trial.inputs, trial.extra_outputs, fused
    estimate(k, profile)
    plan.kernels.remove(p)
    return True


def _lowered_once(kernel: Kernel, memo: dict) -> tuple[int, int, bool, int] | None:
    """`_lowered`, kept per kernel for as long as what it computes, reads and stores stays."""
    key = (kernel.name, tuple(map(id, kernel.ops)), tuple(map(id, kernel.inputs)),
           tuple(map(id, kernel.outputs)), kernel.stored, kernel.fused)
    if key not in memo:
        memo[key] = _lowered(kernel)
    return memo[key]


def _lowered(kernel: Kernel) -> tuple[int, int, bool, int] | None:
    """(reductions in the kernel's loop nest, the largest distance in memory between
    consecutive elements of a row it reads, whether its last value stored per row is one:
    from the row's reductions or other per-row values, not a tensor that only has as many
    elements as the kernel has rows, LLaMA's rotary angles [1, S, D] in the kernel that
    rotates [B, H, S, D]; the ops its source writes out, expression_size.written_size);
    None: it does not lower."""
    nodes = kernel.inputs + kernel.outputs
    names = {id(n): f"b{i}" for i, n in enumerate(nodes)}
    try:
        lk = lower_kernel(kernel, names)
    except (CodegenError, IllegalKernel):
        return None
    rows = [s[2] for s in lk.extra_stores if not s[3]][-1:]
    per_row = {names[id(n)] for n in nodes if n.numel == lk.outer}
    row_value = bool(rows) and (_has_acc(rows[0]) or all(e.param in per_row for e in loads(rows[0])))
    return (len(lk.reductions), max((abs(stride(e.index, "r")) for v in expressions(lk) for e in loads(v)), default=0),
            row_value, expression_size.written_size(expressions(lk)))


def _has_acc(e) -> bool:
    return isinstance(e, Acc) or (isinstance(e, Call) and any(_has_acc(a) for a in e.args))
