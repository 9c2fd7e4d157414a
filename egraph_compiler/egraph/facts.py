"""Facts: per-class shape and dtype, kept in egglog for rule conditions.

Shapes are computed by the op table's rules in Python (one source of truth,
shared with extraction), but once per distinct *signature* (op, operand
types, attributes), not per e-class: egglog's typing ruleset (encode.py)
asks for the signatures of e-nodes whose operands are typed, this module
answers the new ones, and egglog carries each answer to every e-node with
that signature.  A feed after an iteration so costs what the iteration
added (egglog's semi-naive matching over new e-nodes, plus the few new
signatures), never a pass over the whole e-graph: no serialising, no
re-typing.  An ill-shaped signature (a rule built a term its op rejects)
raises UnsoundRuleError at once; two e-nodes of a class that disagree are
caught by extract.infer_types after saturation.
"""
from __future__ import annotations

from .. import ops
from ..dsl.parser import FuseRule, Query, Rule
from ..errors import UnsoundRuleError
from ..graph import Graph, topo_order
from . import extract
from .egg import EgglogSession
from .encode import OP_OF_SIG, TYPING, facts_text, node_names, sexp


class FactFeeder:
    def __init__(self, session: EgglogSession, graph: Graph):
        self.session, self.graph = session, graph
        self.inputs = {n.attr("name"): n for n in graph.inputs}
        self.externs = {str(n.attr("target")): n.attr("target") for n in graph.topo() if n.op == "extern"}
        self.type_ids: dict[tuple, int] = {}  # (shape, dtype) -> type id
        self.types: list[tuple] = []  # type id -> (shape, dtype)
        self.answered: set[tuple] = set()  # signatures whose type egglog holds
        self.graph_typed = False

    def feed(self) -> int:
        """Type every e-class whose operands are typed; returns how many
        signatures were answered plus one if egglog typed anything."""
        if not self.graph_typed:
            self.session.run(self._type_graph())
            self.graph_typed = True
        given = 0
        while True:
            typed = self.session.run_to_fixpoint(TYPING)
            lines = [self._answer(s) for s in self.session.rows("ask") if s[0] not in self.answered]
            if not lines:
                return given + typed
            self.session.run("\n".join(lines))
            given += len(lines)

    def _type_graph(self) -> str:
        """Types for the captured graph's nodes, set on their globals at once:
        egglog would find them one operand level per round of asking."""
        names, types, lines = node_names(self.graph), {}, []
        for node in topo_order(self.graph.outputs):
            types[id(node)] = extract.node_type(node.op, node.a, [types[id(a)] for a in node.args], self.inputs)
            type_id = self._type_id(*types[id(node)], lines)
            lines.append(f"(set (ty {names[id(node)]}) {type_id})")
        return "\n".join(lines)

    def _type_id(self, shape: tuple, dtype: str, lines: list[str]) -> int:
        """The id of a type; a new one's facts are added to `lines`."""
        if (shape, dtype) not in self.type_ids:
            self.type_ids[shape, dtype] = len(self.types)
            self.types.append((shape, dtype))
            lines.append(facts_text(self.type_ids[shape, dtype], shape, dtype))
        return self.type_ids[shape, dtype]

    def _answer(self, row: tuple) -> str:
        (signature,) = row
        self.answered.add(signature)
        op = OP_OF_SIG[signature[0]]
        try:
            shape, dtype = self._type(op, signature[1:])
        except ops.ShapeError as exc:
            raise UnsoundRuleError(f"a rule produced an ill-shaped {op} term: {exc}") from None
        lines: list[str] = []
        type_id = self._type_id(shape, dtype, lines)
        return "\n".join(lines + [f"(set (res {sexp(signature)}) {type_id})"])

    def _type(self, op: str, fields: tuple) -> tuple[tuple, str]:
        if op == "extern":
            return extract.node_type(op, {"target": self.externs[fields[0]]}, [], self.inputs)
        opdef = ops.get(op)
        operands = [self.types[k] for k in fields[:opdef.arity]]
        attrs = {name: _attr(value, kind) for (name, kind), value in zip(opdef.attrs, fields[opdef.arity:])}
        return extract.node_type(op, attrs, operands, self.inputs)


def _attr(value, kind: str):
    if kind != "ints":
        return value
    out = []
    while value[0] == "ICons":
        out.append(value[1])
        value = value[2]
    return tuple(out)


def needs_facts(rules: list[Rule]) -> bool:
    return any(isinstance(r, FuseRule) and r.conditions or
               isinstance(r, Rule) and any(isinstance(c.left, Query) for c in r.conditions) for r in rules)
