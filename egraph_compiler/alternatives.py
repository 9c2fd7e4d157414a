"""The plans extraction did not choose: the chosen plan and the next cheapest
distinct plans by estimated cost, each compiled, so that a benchmark can run
them all and measure the cost model's regret (is the chosen plan the fastest?).

Alternatives come from the saturated e-graph itself: extraction is run again
with one e-node of the chosen program banned (`relu(inline(x))` banned leaves
`relu(x)`: the fusion undone; `layer_norm(x)` banned leaves its decomposition),
then from each alternative found, banning one of its own e-nodes too, breadth
first, until enough distinct programs are found or `budget` extractions ran.
Distinct means a different kernel structure (`signature`): plans that differ only
by commuted operands count once, at their cheapest; and different code once lowered
(`code`): ln_relu's fused `layer_norm` and its decomposition render the same C++
kernel, whose two plans timed 0.376 and 0.254 ms on 16 cores, a regret of the clock's
alone (BENCHMARKS.md, thirty-first session).
Every alternative is an equivalent program, so each must also match eager torch:
the tests run them all (the chosen plan is not the only one that must be right).
"""
from __future__ import annotations

import re

from .api import CompiledFunction, _check_examples
from .egraph.greedy import chosen_enodes, extract_kernels
from .errors import UnsoundRuleError
from .pipeline import Levels, Options, _target, build_egraph, lower_and_load, profile_of
from .plan import make_plan


def signature(plan) -> tuple:
    """What makes two plans different programs: their kernels' kinds and the ops each
    computes (so commuted operands or a reordered chain of one kernel are the same)."""
    return tuple(sorted((k.kind, tuple(sorted(n.op for n in k.ops if n.group != "boundary")))
                        for k in plan.kernels))


def alternatives(fn, example_inputs, count: int = 5, budget: int = 200, **options) -> list[CompiledFunction]:
    """[the chosen plan, then up to `count` others, cheapest estimate first], compiled.
    `options` are `compile`'s (target, rules, disable, unsafe, profile, ...)."""
    inputs = _check_examples(example_inputs)
    opts = Options(**options)
    target = _target(opts.target, inputs)
    levels = Levels()
    graph, eclasses, report, rules = build_egraph(fn, inputs, opts, levels, target)
    profile = profile_of(opts, target)

    def plan_without(banned: frozenset):
        try:
            extracted, _ = extract_kernels(eclasses, graph, profile, banned)
        except UnsoundRuleError:  # the ban left an output without a term
            return None
        return make_plan(extracted, profile, target, opts.alias_inputs, rules)

    chosen = plan_without(frozenset())
    distinct = {signature(chosen): chosen}  # kernel structure -> its cheapest plan
    seen, queue, tries = {str(chosen.graph)}, [frozenset()], 0
    while queue and tries < budget and len(distinct) < count * 4 + 1:
        bans = queue.pop(0)
        for en in chosen_enodes(eclasses, profile, bans, frozenset(graph.output_strides)):
            if en.op in ("input", "const") or tries >= budget:
                continue
            tries += 1
            banned = bans | {id(en)}
            plan = plan_without(banned)
            if plan is None or str(plan.graph) in seen:
                continue
            seen.add(str(plan.graph))
            queue.append(banned)  # explored further even when its structure is not new (a commuted add)
            key = signature(plan)
            if key not in distinct or plan.cost < distinct[key].cost:
                distinct[key] = plan
    others = sorted((p for k, p in distinct.items() if k != signature(chosen)), key=lambda p: p.cost)
    out, codes = [], set()
    for plan in [chosen] + others:
        if len(out) > count:
            break
        plan_levels = Levels(aten=levels.aten, graph=levels.graph, egraph=levels.egraph)
        executable = lower_and_load(plan, rules, target, opts, plan_levels)
        compiled = CompiledFunction(executable, plan, report, plan_levels, fn=fn)
        if code(compiled) not in codes:
            codes.add(code(compiled))
            out.append(compiled)
    return out


def code(compiled: CompiledFunction) -> tuple:
    """What a compiled plan runs: its generated source with kernel and buffer numbers left out,
    and its library and ATen steps in order."""
    source = re.sub(r"\b(k|buf|t)\d+(_\d+)?\b", r"\1", compiled.source or "")
    steps = tuple((k.kind, k.output.op) for k in compiled.plan.kernels if k.kind != "generated")
    return source, steps
