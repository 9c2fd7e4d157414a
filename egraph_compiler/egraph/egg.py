"""The one module that imports egglog: a thin session over its text language.

Everything above this module speaks egglog *text* (declarations, terms, rules
compiled from the DSL); this module runs it, one iteration at a time so the
caller can enforce e-node and time limits, and hands back the serialised
e-graph as plain Python data for extraction.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass

from egglog.bindings import EGraph, EggSmolError

from ..errors import EgraphCompilerError


class EgglogError(EgraphCompilerError):
    """egglog rejected generated text: a compiler bug, reported with the text."""


@dataclass
class IterationResult:
    updated: bool
    matches: dict[str, int]


class EgglogSession:
    def __init__(self):
        self._egraph = EGraph()
        self.program: list[str] = []  # everything sent, for `explain`

    def run(self, text: str) -> list:
        self.program.append(text)
        try:
            return self._egraph.run_program(*self._egraph.parse_program(text))
        except EggSmolError as exc:
            raise EgglogError(f"egglog rejected generated program: {exc}\n--- program ---\n{text[:4000]}") from exc

    @contextmanager
    def scope(self):
        """Everything added inside is dropped on exit (egglog push/pop), so a
        session with rules installed serves many programs."""
        mark = len(self.program)
        self.run("(push)")
        try:
            yield self
        finally:
            self.run("(pop)")
            del self.program[mark:]

    def run_iteration(self, ruleset: str) -> IterationResult:
        (out,) = self.run(f"(run {ruleset} 1)")
        report = out.report
        return IterationResult(bool(report.updated), dict(report.num_matches_per_rule))

    def size(self) -> int:
        """Number of e-nodes: rows of the constructors (capitalised), not of
        the fact tables and relations (lowercase)."""
        (out,) = self.run("(print-size)")
        return sum(count for name, count in out.sizes if name[:1].isupper())

    def serialized(self) -> dict:
        return json.loads(self._egraph.serialize([]).to_json())

    def dot(self) -> str:
        return self._egraph.serialize([]).to_dot()
