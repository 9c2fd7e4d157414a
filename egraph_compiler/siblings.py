"""Horizontal fusion: independent kernels that read a common tensor over the
same loop nest run as one loop nest.

Which kernels may pair is stated in the rules (`fuse NAME: A & B` in
rules/fusion.rules); this pass applies those statements to the kernels that
extraction produced.  A later kernel joins an earlier one only when all of its
inputs are ready before the earlier one runs and it does not read it, so the
merged loop nest can run in the earlier one's place.
"""
from __future__ import annotations

from .dsl.parser import FuseRule
from .loopir import LoopKernel, merge_siblings
from .plan import Plan


def fuse_siblings(plan: Plan, loops: list[LoopKernel], rules) -> tuple[list[LoopKernel], dict[str, str]]:
    """Returns the loop nests to render and follower kernel name -> leader name."""
    statements = [r for r in rules if isinstance(r, FuseRule) and r.horizontal]
    if not statements:
        return loops, {}
    by_name = {lk.name: lk for lk in loops}
    position = {k.name: i for i, k in enumerate(plan.kernels)}
    produced_at = {id(n): i for i, k in enumerate(plan.kernels) for n in k.outputs}
    followers: dict[str, str] = {}
    for i, leader in enumerate(plan.kernels):
        if leader.kind != "generated" or leader.name in followers:
            continue
        for other in plan.kernels[i + 1:]:
            if other.kind != "generated" or other.name in followers or other.name not in by_name:
                continue
            if not allowed(statements, computed_op(leader.output), computed_op(other.output)):
                continue
            shared = {id(n) for n in leader.inputs} & {id(n) for n in other.inputs}
            ready = all(produced_at.get(id(n), -1) < position[leader.name] for n in other.inputs)
            if not shared or not ready:
                continue
            merged = merge_siblings(by_name[leader.name], by_name[other.name])
            if merged is None:
                continue
            by_name[leader.name] = merged
            followers[other.name] = leader.name
    return [by_name[lk.name] for lk in loops if lk.name not in followers], followers


def computed_op(node) -> str:
    """The op a kernel computes: a kernel whose output is a view (GPT-2's activation, reshaped to
    rows for the next linear) computes the op below it."""
    while node.group == "layout" and node.args[0].group in ("layout", "boundary"):
        node = node.args[0].args[0] if node.args[0].op == "inline" else node.args[0]
    return node.op


def allowed(statements, first: str, second: str) -> bool:
    return any((first in s.consumers and second in s.producers) or (second in s.consumers and first in s.producers)
               for s in statements)
