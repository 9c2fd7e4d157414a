"""The one module that imports egglog: a thin session over its text language.

Everything above this module speaks egglog *text* (declarations, terms, rules
compiled from the DSL); this module runs it, one iteration at a time so the
caller can enforce e-node and time limits, hands back small tables (the
typing requests of facts.py) and the serialised e-graph as plain Python data.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from egglog.bindings import EGraph, EggSmolError, TermApp

from ..errors import EgraphCompilerError


class EgglogError(EgraphCompilerError):
    """egglog rejected generated text: a compiler bug, reported with the text."""


@dataclass
class IterationResult:
    updated: bool
    matches: dict[str, int]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
CHUNK = 100  # commands per parse: egglog-python's parse and run grow faster than the program's length


def _chunks(text: str):
    """The text in runs of about CHUNK whole commands (generated text has one
    per line; a command spanning lines stays whole by counting parentheses)."""
    lines, count, depth = [], 0, 0
    for line in text.split("\n"):
        lines.append(line)
        bare = _STRING.sub("", line)
        depth += bare.count("(") - bare.count(")")
        count += depth == 0
        if depth == 0 and count >= CHUNK:
            yield "\n".join(lines)
            lines, count = [], 0
    if lines:
        yield "\n".join(lines)


class EgglogSession:
    def __init__(self):
        self._egraph = EGraph()
        self.program: list[str] = []  # everything sent, for `explain`
        self._depth = 0  # egglog push/pop snapshots currently held

    def run(self, text: str) -> list:
        self.program.append(text)
        out = []
        for chunk in _chunks(text):
            try:
                out += self._egraph.run_program(*self._egraph.parse_program(chunk))
            except EggSmolError as exc:
                raise EgglogError(f"egglog rejected generated program: {exc}\n--- program ---\n{chunk[:4000]}") from exc
        return out

    def checkpoint(self) -> None:
        self.run("(push)")
        self._depth += 1

    def rollback(self) -> None:
        """Back to the state of the last checkpoint."""
        self.run("(pop)")
        self._depth -= 1

    def run_iteration(self, ruleset: str) -> IterationResult:
        (out,) = self.run(f"(run {ruleset} 1)")
        report = out.report
        return IterationResult(bool(report.updated), dict(report.num_matches_per_rule))

    def run_to_fixpoint(self, ruleset: str) -> bool:
        """Run a ruleset until nothing changes; returns whether anything did."""
        (out,) = self.run(f"(run-schedule (saturate (run {ruleset})))")
        return bool(out.report.updated)

    def rows(self, table: str) -> list[tuple]:
        """The keys of every row of a function or relation, as terms: a call
        is a tuple (name, *args), a literal its Python value.  For small
        tables (cost grows with the table, not the e-graph)."""
        (out,) = self.run(f"(print-function {table})")
        dag, memo = out.termdag, {}

        def term(i):
            if i not in memo:
                node = dag.get(i)
                memo[i] = (node.name, *map(term, node.args)) if isinstance(node, TermApp) else node.value.value
            return memo[i]
        return [term(key)[1:] for key, _ in out.terms]

    def size(self) -> int:
        """Number of e-nodes: rows of the constructors (capitalised), not of
        the fact tables and relations (lowercase)."""
        (out,) = self.run("(print-size)")
        return sum(count for name, count in out.sizes if name[:1].isupper())

    def serialized(self) -> dict:
        return json.loads(self._egraph.serialize([]).to_json())

    def dot(self) -> str:
        return self._egraph.serialize([]).to_dot()
