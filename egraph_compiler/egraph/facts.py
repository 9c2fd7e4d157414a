"""Facts: per-class shape and dtype, fed into egglog for rule conditions.

Shapes are computed by the op table's rules in Python (one source of truth,
shared with extraction).  Between iterations, every e-class that has no facts
yet gets a global name (`$cK`, a `let` over one of its e-nodes whose operands
are already named) and `rank-of`, `dim-size` and `dtype-of` facts, so that
conditions such as `size(x, -1) <= 4096` can match it in the next iteration.
A class whose e-nodes disagree on shape is an unsound rule, raised at once.
"""
from __future__ import annotations

from ..dsl.parser import FuseRule, Query, Rule
from ..graph import Graph
from . import extract
from .egg import EgglogSession
from .encode import facts_text, term_text


class FactFeeder:
    def __init__(self, session: EgglogSession, graph: Graph):
        self.session, self.graph = session, graph
        self.fed: set[str] = set()  # globals whose class has facts
        self._count = 0

    def feed(self) -> int:
        """Give facts to every class that lacks them; returns how many got some."""
        data = self.session.serialized()
        eg = extract.load(data, self.graph)
        extract.infer_types(eg, self.graph)
        names: dict[str, str] = {}
        for class_id, info in data["class_data"].items():
            lets = [n for n in info.get("let", "").split(", ") if n]
            if lets:
                names[class_id] = next((n for n in lets if n in self.fed), lets[0])
        lines, given = [], 0
        pending = [c for c in eg.classes if c in eg.shape and names.get(c) not in self.fed]
        while pending:
            progress, rest = False, []
            for class_id in pending:
                if class_id not in names:
                    enode = next((e for e in eg.classes[class_id] if all(k in names for k in e.children)), None)
                    if enode is None:
                        rest.append(class_id)
                        continue
                    names[class_id] = f"$c{self._count}"
                    self._count += 1
                    operands = [names[k] for k in enode.children]
                    lines.append(f"(let {names[class_id]} {term_text(enode.op, operands, enode.attrs)})")
                lines.append(facts_text(names[class_id], eg.shape[class_id], eg.dtype[class_id]))
                self.fed.add(names[class_id])
                given += 1
                progress = True
            if not progress:
                break
            pending = rest
        if lines:
            self.session.run("\n".join(lines))
        return given


def needs_facts(rules: list[Rule]) -> bool:
    return any(isinstance(r, FuseRule) and r.conditions or
               isinstance(r, Rule) and any(isinstance(c.left, Query) for c in r.conditions) for r in rules)
