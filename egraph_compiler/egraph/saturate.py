"""Saturate: run rule groups over the e-graph under explicit limits.

A schedule is a list of phases; each phase is a set of rule groups run
together, one iteration at a time, until nothing changes or a limit is hit.
The limits (iterations, e-nodes, seconds) are shared by the whole run.  The
run always ends with a stop reason and per-rule match counts; whatever the
e-graph holds at that point is what extraction chooses from.

egglog cannot stop an iteration midway: 13.2's `run` has no time or match
limit, and egglog-experimental's back-off scheduler (`run-with`) keeps its
bans for one `run-schedule` command only and would change which rules fire.
So each iteration is judged before it starts: `Pace` predicts its seconds
and e-nodes from the last ones (an exploding rule set grows by a rising
factor), and the run stops when the iteration, plus loading the grown
e-graph for extraction afterwards, would not fit in the time left.  An
iteration that may cross the node limit runs after a checkpoint and is
undone if it lands more than 10% past the limit.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..dsl.parser import Rule
from ..dsl.terms import Lit, Pat
from .egg import EgglogSession
from .encode import HIDDEN, rule_commands, ruleset_name

SATURATED, ITERATION_LIMIT, NODE_LIMIT, TIME_LIMIT = "saturated", "iteration limit", "node limit", "time limit"
PHASE_LIMIT = "phase iteration limit"  # a phase's own limit: the schedule moves on to the next phase
NODE_SLACK = 1.1  # an iteration may end this far past node_limit; further, it is undone
# Seconds per e-node to serialise, load and type the e-graph after saturation
# (measured 30-50us on a 2-core CPU host): reserved out of time_limit.
LOAD_SECONDS_PER_ENODE = 40e-6
SAFETY = 2.0  # predicted seconds are doubled: iteration times jitter, and explosions speed up
MIN_SECONDS = 0.005  # iteration times below this are timer noise, not a growth trend
KEPT_CHECKPOINTS = 2  # snapshots of the e-graph held at once (each is a copy)


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
    note: str = ""  # how a limit was judged, when it stopped the run before an iteration
    growth: list[tuple[int, float]] = field(default_factory=list)  # (e-nodes, seconds) after each iteration
    # called after each iteration with (iterations so far, e-nodes, seconds since the run began)
    progress: object = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        fired = ", ".join(f"{name} x{n}" for name, n in sorted(self.matches.items()) if n) or "none"
        lines = [f"saturation: {self.stop_reason} after {self.iterations} iteration(s), "
                 f"{self.enodes} e-nodes, {self.seconds:.3f}s" + (f" ({self.note})" if self.note else "")]
        for groups, reason, count, before, after, seconds in self.phases:
            lines.append(f"  phase [{groups}]: {reason} after {count} iteration(s), "
                         f"e-nodes {before} -> {after}, {seconds:.3f}s")
        lines.append(f"  rules fired: {fired}")
        return "\n".join(lines)


def install_rules(session: EgglogSession, rules: list[Rule], present: set[str] | None = None) -> None:
    """Every rule's commands; with `present` (the program's ops), a fusion statement's only for
    the consumers and producers the e-graph can come to hold (`reachable_ops`): nine tenths of
    the library's commands are fusions, and egglog compiles each one it is given (~0.3 s)."""
    for group in dict.fromkeys(r.group for r in rules):
        session.run(f"(ruleset {ruleset_name(group)})")
    reach = None if present is None else reachable_ops(rules, present)
    session.run("\n".join(cmd for r in rules for cmd in rule_commands(r, reach)))


def reachable_ops(rules: list, present: set[str]) -> set[str]:
    """The ops an e-graph that starts with `present` can come to hold: a rewrite adds its
    right-hand side's ops once every op of its left-hand side can be there (its conditions
    ignored, so this is a superset).  Fusions add no op (a consumer with an `Inline` operand)."""
    sides = []
    for rule in rules:
        if isinstance(rule, Rule):
            sides.append((term_ops(rule.lhs), term_ops(rule.rhs)))
            if rule.both_ways:
                sides.append((term_ops(rule.rhs), term_ops(rule.lhs)))
    reach, grown = set(present), True
    while grown:
        grown = False
        for need, give in sides:
            if need <= reach and not give <= reach:
                reach |= give
                grown = True
    return reach


def term_ops(term) -> set[str]:
    """The ops a rule's term builds or matches (a tensor literal is a `const`)."""
    if isinstance(term, Pat):
        return {term.op}.union(*(term_ops(a) for a in term.args))
    if isinstance(term, tuple):
        return set().union(*(term_ops(a) for a in term))
    if isinstance(term, Lit) and term.sort == "tensor":
        return {"const"}
    return set()


def saturate(session: EgglogSession, schedule: list[tuple[list[str], int | None]], limits: Limits,
             feeder=None, progress=None) -> Report:
    """Run the schedule.  `feeder` (a FactFeeder), when rules have shape
    conditions, types new e-classes after each iteration; `progress(iterations,
    e-nodes, seconds)` is told after each iteration."""
    start = time.perf_counter()
    report = Report(progress=None if progress is None else (
        lambda iterations, size: progress(iterations, size, time.perf_counter() - start)))
    if feeder is not None:
        feeder.feed()
    pace = Pace(start, session.size())
    for number, (groups, phase_limit) in enumerate(schedule):
        if not groups:
            continue
        phase = f"phase{number}"
        session.run(f"(unstable-combined-ruleset {phase} {' '.join(ruleset_name(g) for g in groups)})")
        before, phase_start = pace.size, time.perf_counter()
        reason, count = _run_phase(session, phase, limits, report, pace, feeder, phase_limit)
        report.phases.append((", ".join(groups), reason, count, before, pace.size,
                              time.perf_counter() - phase_start))
        if reason not in (SATURATED, PHASE_LIMIT):
            report.stop_reason = reason
            break
    report.enodes = session.size()
    report.seconds = time.perf_counter() - start
    return report


def _run_phase(session, phase, limits, report, pace, feeder, phase_limit) -> tuple[str, int]:
    count = 0
    while True:
        if phase_limit is not None and count >= phase_limit:
            return PHASE_LIMIT, count
        if report.iterations >= limits.iter_limit:
            return ITERATION_LIMIT, count
        stop = pace.stop_before(limits, report)
        if stop:
            return stop, count
        result, size = _iterate(session, phase, limits, report, pace)
        if result is None:
            return NODE_LIMIT, count
        count += 1
        if size >= limits.node_limit:  # stopping: the new classes need no facts
            pace.record(size)
            return _past_node_limit(pace, limits), count
        new_facts = feeder.feed() if feeder is not None and result.updated else 0
        pace.record(size)
        if not result.updated and not new_facts:
            return SATURATED, count


def _iterate(session, phase, limits, report, pace):
    """One iteration; returns its result (None if it was undone for ending
    too far past the node limit) and the e-nodes after it."""
    guarded = pace.may_cross(limits.node_limit)
    if guarded:
        session.checkpoint()
    pace.begin()
    result = session.run_iteration(phase)
    size = session.size()
    if guarded and size > limits.node_limit * NODE_SLACK:
        session.rollback()
        report.note = f"the next iteration would have grown the e-graph to {size} e-nodes and was undone"
        return None, pace.size
    pace.kept(guarded)
    report.iterations += 1
    report.growth.append((size, time.perf_counter() - pace.start))
    if report.progress is not None:
        report.progress(report.iterations, size)
    for name, n in result.matches.items():
        if not name.startswith(HIDDEN):
            report.matches[name.split("#")[0].removesuffix(".reverse")] += n
    return result, size


def _past_node_limit(pace: Pace, limits: Limits) -> str:
    if pace.size <= limits.node_limit * NODE_SLACK:
        return NODE_LIMIT
    return f"{NODE_LIMIT} (one iteration jumped past it: {pace.sizes[-2]} -> {pace.size} e-nodes)"


class Pace:
    """The run's clock and growth.  Predicts the next iteration (rule matching
    plus typing) from the last ones: its seconds grow by the last factor of
    seconds (at most the square of that of e-nodes) or of e-nodes, whichever
    is larger, times SAFETY; e-nodes by the
    last factor times its rise over the factor before (an exploding rule
    set, such as associativity with distributivity, grows faster each time)."""

    def __init__(self, start: float, size: int):
        self.start, self.mark = start, start
        self.sizes, self.costs = [max(size, 1)], []
        self.checkpoints = 0

    @property
    def size(self) -> int:
        return self.sizes[-1]

    def begin(self) -> None:
        self.mark = time.perf_counter()

    def record(self, size: int) -> None:
        self.costs.append(max(time.perf_counter() - self.mark, MIN_SECONDS))
        self.sizes.append(max(size, 1))

    def kept(self, guarded: bool) -> None:
        self.checkpoints += guarded

    def next_size(self) -> float:
        return self.size * _factor(self.sizes, default=2.0)

    def next_seconds(self) -> float:
        if not self.costs:
            return 0.0  # nothing to go by: the first iteration always runs
        grown = _factor(self.sizes[-2:], 1.0)
        # a rise in seconds alone is noise (a garbage collection in the typing of new classes, a busy
        # machine): it counts only as far as the e-graph's growth explains it, matching being at
        # worst about quadratic in it.  (A 0.3 s collection after a 5 ms iteration, with 3% more
        # e-nodes, once predicted 37 s and stopped a 0.3 s saturation before its fusions.)
        return self.costs[-1] * max(min(_factor(self.costs[-2:], 1.0), grown * grown), grown) * SAFETY

    def may_cross(self, node_limit: int) -> bool:
        """Whether the next iteration may end past the node limit (a checkpoint
        first lets it be undone); at most KEPT_CHECKPOINTS are held."""
        return self.checkpoints < KEPT_CHECKPOINTS and 2 * self.next_size() > node_limit * NODE_SLACK

    def stop_before(self, limits: Limits, report: Report) -> str | None:
        """The stop reason if the next iteration should not start."""
        if self.size >= limits.node_limit:
            return NODE_LIMIT
        left = limits.time_limit - (time.perf_counter() - self.start)
        if left <= 0:
            return TIME_LIMIT
        seconds, load = self.next_seconds(), self.next_size() * LOAD_SECONDS_PER_ENODE
        if seconds + load > left:
            report.note = (f"the next iteration was predicted to take {seconds:.2f}s and loading its e-graph "
                           f"{load:.2f}s, with {left:.2f}s left")
            return TIME_LIMIT
        return None


def _factor(series: list[float], default: float) -> float:
    """The growth factor of a series' next step: the last ratio, times its
    rise over the ratio before (at least 1)."""
    if len(series) < 2:
        return default
    last = series[-1] / series[-2]
    if len(series) < 3:
        return max(last, 1.0)
    rise = last / (series[-2] / series[-3])
    return max(last * max(rise, 1.0), 1.0)
