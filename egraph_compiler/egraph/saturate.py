"""Saturate: run rule groups over the e-graph under explicit limits.

A schedule is a list of phases; each phase is a set of rule groups run
together, one iteration at a time, until nothing changes or a limit is hit.
The limits (iterations, e-nodes, seconds) are shared by the whole run.  The
run always ends with a stop reason and per-rule match counts; whatever the
e-graph holds at that point is what extraction chooses from.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..dsl.parser import Rule
from .egg import EgglogSession
from .encode import HIDDEN, rule_commands, ruleset_name

SATURATED, ITERATION_LIMIT, NODE_LIMIT, TIME_LIMIT = "saturated", "iteration limit", "node limit", "time limit"
PHASE_LIMIT = "phase iteration limit"  # a phase's own limit: the schedule moves on to the next phase


@dataclass
class Limits:
    iter_limit: int = 30
    node_limit: int = 50_000
    time_limit: float = 10.0


@dataclass
class Report:
    stop_reason: str = SATURATED
    iterations: int = 0
    enodes: int = 0
    seconds: float = 0.0
    matches: Counter = field(default_factory=Counter)  # rule name -> matches
    # (groups, stop reason, iterations, e-nodes before, e-nodes after, seconds), one per phase
    phases: list[tuple[str, str, int, int, int, float]] = field(default_factory=list)

    def __str__(self) -> str:
        fired = ", ".join(f"{name} x{n}" for name, n in sorted(self.matches.items()) if n) or "none"
        lines = [f"saturation: {self.stop_reason} after {self.iterations} iteration(s), "
                 f"{self.enodes} e-nodes, {self.seconds:.3f}s"]
        for groups, reason, count, before, after, seconds in self.phases:
            lines.append(f"  phase [{groups}]: {reason} after {count} iteration(s), "
                         f"e-nodes {before} -> {after}, {seconds:.3f}s")
        lines.append(f"  rules fired: {fired}")
        return "\n".join(lines)


def install_rules(session: EgglogSession, rules: list[Rule]) -> None:
    for group in dict.fromkeys(r.group for r in rules):
        session.run(f"(ruleset {ruleset_name(group)})")
    session.run("\n".join(cmd for r in rules for cmd in rule_commands(r)))


def saturate(session: EgglogSession, schedule: list[tuple[list[str], int | None]], limits: Limits,
             feeder=None) -> Report:
    """Run the schedule.  `feeder` (a FactFeeder), when rules have shape
    conditions, gives new e-classes their facts after each iteration."""
    report = Report()
    start = time.perf_counter()
    if feeder is not None:
        feeder.feed()
    for number, (groups, phase_limit) in enumerate(schedule):
        if not groups:
            continue
        phase = f"phase{number}"
        session.run(f"(unstable-combined-ruleset {phase} {' '.join(ruleset_name(g) for g in groups)})")
        before, phase_start = session.size(), time.perf_counter()
        reason, count = _run_phase(session, phase, limits, report, start, feeder, phase_limit)
        report.phases.append((", ".join(groups), reason, count, before, session.size(),
                              time.perf_counter() - phase_start))
        if reason not in (SATURATED, PHASE_LIMIT):
            report.stop_reason = reason
            break
    report.enodes = session.size()
    report.seconds = time.perf_counter() - start
    return report


def _run_phase(session, phase, limits, report, start, feeder, phase_limit) -> tuple[str, int]:
    count = 0
    while True:
        if phase_limit is not None and count >= phase_limit:
            return PHASE_LIMIT, count
        if report.iterations >= limits.iter_limit:
            return ITERATION_LIMIT, count
        if time.perf_counter() - start >= limits.time_limit:
            return TIME_LIMIT, count
        result = session.run_iteration(phase)
        report.iterations += 1
        count += 1
        for name, n in result.matches.items():
            if not name.startswith(HIDDEN):
                report.matches[name.split("#")[0].removesuffix(".reverse")] += n
        new_facts = feeder.feed() if feeder is not None and result.updated else 0
        if not result.updated and not new_facts:
            return SATURATED, count
        if session.size() >= limits.node_limit:
            return NODE_LIMIT, count
