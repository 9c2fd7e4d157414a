"""Extract: the serialised e-graph -> the cheapest Graph IR (DAG-aware greedy).

Steps, each on plain Python data:
1. `load`: egglog's JSON -> e-classes of tensor e-nodes with decoded attributes.
2. `analyse`: shape and dtype per e-class, by fixpoint over the op table's
   rules.  Two e-nodes of one class that disagree mean a rule merged unequal
   things: that is reported as an unsound rule, never extracted.
3. `extract_greedy`: DAG-aware greedy (a shared subterm is paid once): each
   class keeps the set of classes its best choice needs, and its cost is the
   sum over that set.
4. `build`: the chosen e-nodes -> hash-consed Graph IR nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ops
from ..cost import DeviceProfile, op_cost
from ..errors import UnsoundRuleError
from ..graph import WEAK, Graph, Node, result_dtype
from .encode import OP_OF_CTOR


@dataclass
class ENode:
    op: str
    children: tuple[str, ...]  # tensor e-class ids
    attrs: dict
    cost: float = 0.0
    valid: bool = True


@dataclass
class EClassGraph:
    classes: dict[str, list[ENode]]
    roots: list[str]
    shape: dict[str, tuple] = field(default_factory=dict)
    dtype: dict[str, str] = field(default_factory=dict)

    @property
    def enode_count(self) -> int:
        return sum(len(v) for v in self.classes.values())


def load(data: dict, graph: Graph) -> EClassGraph:
    nodes = data["nodes"]
    by_class: dict[str, list[dict]] = {}
    for node in nodes.values():
        by_class.setdefault(node["eclass"], []).append(node)
    externs = {str(n.attr("target")): n.attr("target") for n in graph.topo() if n.op == "extern"}

    def cls(child_id):
        return nodes[child_id]["eclass"]

    def value(class_id, kind):
        node = by_class[class_id][0]
        if kind == "ints":
            out = []
            while node["op"] == "ICons":
                head, tail = node["children"]
                out.append(int(nodes[head]["op"]))
                node = by_class[cls(tail)][0]
            return tuple(out)
        text = node["op"]
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text.replace("inf", "inf").replace("NaN", "nan"))
        if kind == "bool":
            return text == "true"
        return text[1:-1] if text.startswith('"') else text

    classes: dict[str, list[ENode]] = {}
    for node in nodes.values():
        op = OP_OF_CTOR.get(node["op"])
        if op is None or data["class_data"][node["eclass"]]["type"] != "T":
            continue
        kids = [cls(c) for c in node["children"]]
        if op == "extern":
            name, items = kids
            call = externs[value(name, "str")]
            tensors = []
            item = by_class[items][0]
            while item["op"] == "TCons":
                head, tail = item["children"]
                tensors.append(cls(head))
                item = by_class[cls(tail)][0]
            classes.setdefault(node["eclass"], []).append(ENode(op, tuple(tensors), {"target": call}))
            continue
        opdef = ops.get(op)
        attrs = {name: value(k, kind) for (name, kind), k in zip(opdef.attrs, kids[opdef.arity:])}
        classes.setdefault(node["eclass"], []).append(ENode(op, tuple(kids[:opdef.arity]), attrs))
    roots: dict[int, str] = {}
    for class_id, info in data["class_data"].items():
        for name in info.get("let", "").split(", "):
            if name.startswith("$out"):
                roots[int(name[4:])] = class_id
    return EClassGraph(classes, [roots[i] for i in range(len(roots))])


def analyse(eg: EClassGraph, graph: Graph, profile: DeviceProfile) -> None:
    """Fill per-class shape/dtype and per-node cost; flag unsound merges."""
    infer_types(eg, graph)
    assign_costs(eg, profile)


def infer_types(eg: EClassGraph, graph: Graph) -> None:
    """Per-class shape and dtype by fixpoint; two e-nodes of a class that
    disagree raise UnsoundRuleError."""
    inputs = {n.attr("name"): n for n in graph.inputs}
    changed = True
    while changed:
        changed = False
        for class_id, enodes in eg.classes.items():
            for en in enodes:
                if not en.valid or any(c not in eg.shape for c in en.children):
                    continue
                try:
                    shape, dtype = _node_type(en, eg, inputs)
                except ops.ShapeError as exc:
                    en.valid = False
                    raise UnsoundRuleError(f"a rule produced an ill-shaped {en.op} term: {exc}") from None
                known = eg.shape.get(class_id)
                if known is None:
                    eg.shape[class_id], eg.dtype[class_id] = shape, dtype
                    changed = True
                elif known != shape or _dtype_conflict(eg.dtype[class_id], dtype):
                    raise UnsoundRuleError(
                        f"a rule merged terms of different types: {en.op} gives {dtype}{list(shape)} but its "
                        f"e-class holds {eg.dtype[class_id]}{list(known)}; check the rules that rewrite {en.op}")


def assign_costs(eg: EClassGraph, profile: DeviceProfile) -> None:
    for class_id, enodes in eg.classes.items():
        for en in enodes:
            if class_id in eg.shape and all(c in eg.shape for c in en.children):
                en.cost = op_cost(en.op, eg.shape[class_id], _concrete(eg.dtype[class_id]),
                                  [eg.shape[c] for c in en.children],
                                  [_concrete(eg.dtype[c]) for c in en.children], profile)


def _dtype_conflict(a: str, b: str) -> bool:
    return a != b and WEAK not in (a, b)


def _concrete(dtype: str) -> str:
    return "float32" if dtype == WEAK else dtype


def _node_type(en: ENode, eg: EClassGraph, inputs) -> tuple[tuple, str]:
    if en.op == "input":
        node = inputs[en.attrs["name"]]
        return node.shape, node.dtype
    if en.op == "const":
        return (), WEAK
    if en.op == "extern":
        call = en.attrs["target"]
        return call.shape, call.dtype
    stand_ins = [_StandIn(eg.shape[c], eg.dtype[c]) for c in en.children]
    opdef = ops.get(en.op)
    shape = tuple(opdef.shape([s.shape for s in stand_ins], en.attrs))
    return shape, result_dtype(opdef, stand_ins, en.attrs)


@dataclass
class _StandIn:
    shape: tuple
    dtype: str


def extract_greedy(eg: EClassGraph) -> tuple[dict[str, ENode], float]:
    """DAG-aware greedy: returns the chosen e-node per needed class and the DAG cost."""
    best: dict[str, tuple[float, ENode, dict[str, float]]] = {}
    changed = True
    while changed:
        changed = False
        for class_id, enodes in eg.classes.items():
            for en in enodes:
                if not en.valid or any(c not in best for c in en.children):
                    continue
                needed: dict[str, float] = {}
                for c in en.children:
                    needed.update(best[c][2])
                if class_id in needed:
                    continue  # a cycle through this class
                needed[class_id] = en.cost
                total = sum(needed.values())
                if class_id not in best or total < best[class_id][0] - 1e-15:
                    best[class_id] = (total, en, needed)
                    changed = True
    missing = [r for r in eg.roots if r not in best]
    if missing:
        raise UnsoundRuleError(f"no finite term for output class(es) {missing}")
    used: dict[str, float] = {}
    for r in eg.roots:
        used.update(best[r][2])
    choice = {c: best[c][1] for c in used}
    return choice, sum(used.values())


def build(eg: EClassGraph, choice: dict[str, ENode], graph: Graph) -> Graph:
    inputs = {n.attr("name"): n for n in graph.inputs}
    built: dict[str, Node] = {}

    def make(class_id: str) -> Node:
        if class_id in built:
            return built[class_id]
        stack = [class_id]
        while stack:
            c = stack[-1]
            en = choice[c]
            pending = [k for k in en.children if k not in built]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if c in built:
                continue
            args = tuple(built[k] for k in en.children)
            if en.op == "input":
                built[c] = inputs[en.attrs["name"]]
            elif en.op in ("const", "extern"):
                built[c] = Node.make(en.op, args, en.attrs, shape=eg.shape[c], dtype=eg.dtype[c])
            else:
                built[c] = Node.make(en.op, args, en.attrs)
        return built[class_id]

    outputs = tuple(make(r) for r in eg.roots)
    where = {id(built[c]): graph.where[id(n)] for c in built for n in [built[c]] if id(n) in graph.where}
    return Graph(graph.inputs, outputs, graph.bound, {**graph.where, **where})
