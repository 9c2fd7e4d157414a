"""Optimal extraction as an integer program (HiGHS, through highspy).

The same two uses of an e-class as the greedy extractor (materialised, or
inlined into a consumer's kernel), with an additive objective: every chosen
(e-node, use) pays its own FLOPs and the loads of its materialised operands;
a materialised use also pays its store and a launch.  Variables:

  x[n,u]  e-node n chosen for use u of its class      (binary)
  a[c,u]  class c needed in use u                      (binary; roots: a=1)
  t[c,u]  topological position, for acyclicity          (continuous)

  sum_n x[n,u] = a[c,u]               one e-node per needed (class, use)
  x[n,u] <= a[k,v]                    each operand edge needs its child's use v
  t[c,u] - t[k,v] >= 1 - M (1 - x[n,u])   operands come strictly before users

Solved under a time limit; the caller keeps the greedy result when HiGHS
proves nothing or finds nothing.  This is the only module that imports highspy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import highspy

from .. import ops
from ..cost import VIEW_COST, DeviceProfile, additive_kernel_cost, extra_passes, inlined_cost, op_flops
from .extract import EClassGraph, ENode
from .greedy import INLINE_GROUPS, KernelExtractor, Option

MAT, INL = "mat", "inl"


@dataclass
class IlpResult:
    status: str  # optimal | time limit (feasible) | infeasible | no solution
    objective: float
    proved_optimal: bool
    choice: dict | None  # (class, use) -> ENode


def node_cost(ex: KernelExtractor, class_id: str, en: ENode, use: str) -> float | None:
    """The additive cost of choosing `en` for `use`, or None when not allowed."""
    group = ops.group_of(en.op)
    inline_children = [c for c in en.children if c in ex.inline_of]
    if any(c in ex.inline_of and ops.operand_in_memory(group, i) for i, c in enumerate(en.children)):
        return None
    if use == INL and (group not in INLINE_GROUPS or en.op == "extern"):
        return None
    profile: DeviceProfile = ex.profile
    flops = 0.0
    if group not in ("source", "layout", "boundary", "extern"):
        flops = op_flops(en.op, ex.eg.shape[class_id], [ex.eg.shape[c] for c in en.children], profile)
    loads = sum(ex.bytes(c) for c in en.children
                if c not in ex.inline_of and not any(n.op == "const" for n in ex.eg.classes[c]))
    if en.op == "input":
        return ex.bytes(class_id) / profile.bandwidth if use == INL else 0.0
    if group == "source":
        return 0.0
    if use == MAT and group == "layout" and not inline_children:
        return VIEW_COST
    if use == MAT:
        extra = extra_passes(en.op, [ex.eg.shape[c] for c in en.children], en.attrs) * ex.bytes(class_id)
        return additive_kernel_cost(flops, loads, ex.bytes(class_id), profile, library=group == "library",
                                    link=group == "collective", serial_bytes=extra, op=en.op)
    return inlined_cost(flops, loads, profile)


def solve(eg: EClassGraph, profile: DeviceProfile, time_limit: float = 5.0) -> IlpResult:
    ex = KernelExtractor(eg, profile)
    classes = [c for c in eg.classes if c not in ex.inline_of and c in eg.shape]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    h.setOptionValue("time_limit", float(time_limit))
    inf = highspy.kHighsInf
    count = 0

    def new_var(lo, hi, cost, integer):
        nonlocal count
        h.addVar(lo, hi)
        h.changeColCost(count, cost)
        if integer:
            h.changeColIntegrality(count, highspy.HighsVarType.kInteger)
        count += 1
        return count - 1

    big = 2 * len(classes) + 2
    act, order, choice_vars = {}, {}, {}
    for c in classes:
        for use in (MAT, INL):
            act[c, use] = new_var(0, 1, 0.0, True)
            order[c, use] = new_var(0, big, 0.0, False)
    for c in classes:
        for en in eg.classes[c]:
            for use in (MAT, INL):
                cost = node_cost(ex, c, en, use)
                if cost is not None and all((ex.inline_of.get(k, k) in eg.shape) for k in en.children):
                    choice_vars[id(en), use] = (new_var(0, 1, cost, True), c, en, use)
    for c in classes:  # exactly one e-node per needed (class, use)
        for use in (MAT, INL):
            cols = [v for (v, cc, _, u) in choice_vars.values() if cc == c and u == use]
            h.addRow(0, 0, len(cols) + 1, cols + [act[c, use]], [1.0] * len(cols) + [-1.0])
    for v, c, en, use in choice_vars.values():
        for child in en.children:
            target = (ex.inline_of[child], INL) if child in ex.inline_of else (child, MAT)
            h.addRow(-inf, 0, 2, [v, act[target]], [1.0, -1.0])
            # order[c,use] - order[target] - big * x >= 1 - big
            h.addRow(1 - big, inf, 3, [order[c, use], order[target], v], [1.0, -1.0, -float(big)])
    for r in eg.roots:
        h.changeColBounds(act[r, MAT], 1, 1)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible point
        return IlpResult(status, math.inf, False, None)
    values = h.getSolution().col_value
    chosen = {(c, use): en for (v, c, en, use) in choice_vars.values() if values[v] > 0.5}
    proved = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return IlpResult("optimal" if proved else status, info.objective_function_value, proved, chosen)


def as_extractor(eg: EClassGraph, profile: DeviceProfile, chosen: dict) -> KernelExtractor:
    """An extractor whose choices are the ILP's, for `greedy.build`."""
    ex = KernelExtractor(eg, profile)
    for (c, use), en in chosen.items():
        (ex.mat if use == MAT else ex.inl)[c] = Option(0.0, en, {})
    return ex


def additive_cost(ex: KernelExtractor, roots) -> float:
    """The ILP objective of the extractor's choices (each needed (class, use) once)."""
    seen, total, stack = set(), 0.0, [(r, MAT) for r in roots]
    while stack:
        c, use = stack.pop()
        if (c, use) in seen:
            continue
        seen.add((c, use))
        en = (ex.mat if use == MAT else ex.inl)[c].node
        total += node_cost(ex, c, en, use)
        for child in en.children:
            stack.append((ex.inline_of[child], INL) if child in ex.inline_of else (child, MAT))
    return total
