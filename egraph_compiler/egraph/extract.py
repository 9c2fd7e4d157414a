"""The serialised e-graph as plain Python data, typed, ready for extraction.

1. `load`: egglog's JSON -> e-classes of tensor e-nodes with decoded attributes.
2. `infer_types`: shape and dtype per e-class, by fixpoint over the op table's
   rules.  Two e-nodes of one class that disagree mean a rule merged unequal
   things: that is reported as an unsound rule, never extracted.
The extractors (greedy.py, ilp.py) choose e-nodes from this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ops
from ..errors import UnsoundRuleError
from ..graph import WEAK, Graph, Node, result_dtype
from .egg import EgglogError
from .encode import OP_OF_CTOR


@dataclass
class ENode:
    op: str
    children: tuple[str, ...]  # tensor e-class ids
    attrs: dict


@dataclass
class EClassGraph:
    classes: dict[str, list[ENode]]
    roots: list[str]
    shape: dict[str, tuple] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # class -> the user's source line of a node in it
    dtype: dict[str, str] = field(default_factory=dict)
    original: dict[str, Node] = field(default_factory=dict)  # class -> the captured node in it

    @property
    def enode_count(self) -> int:
        return sum(len(v) for v in self.classes.values())


def load(data: dict, graph: Graph, names: dict[int, str] | None = None) -> EClassGraph:
    """`names` (node id -> egglog global, from encode_graph) carries the user's
    source lines over to the e-classes, for messages about extracted nodes."""
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
    node_of_global = {names[id(n)]: n for n in graph.topo() if names and id(n) in names}
    where: dict[str, str] = {}
    original: dict[str, Node] = {}
    class_of: dict[int, str] = {}  # captured node id -> its e-class
    for class_id, info in data["class_data"].items():
        for name in info.get("let", "").split(", "):
            if name.startswith("$out"):
                roots[int(name[4:].rstrip("_"))] = class_id
            elif name in node_of_global:
                node = node_of_global[name]
                class_of[id(node)] = class_id
                original.setdefault(class_id, node)
                if id(node) in graph.where:
                    where.setdefault(class_id, graph.where[id(node)])
    if names:
        _check_faithful(graph, classes, class_of)
    return EClassGraph(classes, [roots[i] for i in range(len(roots))], where=where, original=original)


def _check_faithful(graph: Graph, classes: dict[str, list[ENode]], class_of: dict[int, str]) -> None:
    """Every captured node is in the e-graph as sent: its class holds an e-node
    of its op over its operands' classes.  egglog 13.2 once bound a `let` to a
    different term (see encode.node_names); a wrong e-graph would extract a
    wrong program, so it is refused here, never compiled."""
    for node in graph.topo():
        if node.op == "input" or id(node) not in class_of:
            continue
        want = tuple(class_of.get(id(a)) for a in node.args)
        if not any(en.op == node.op and en.children == want for en in classes.get(class_of[id(node)], ())):
            found = [f"{en.op}{en.children}" for en in classes.get(class_of[id(node)], ())][:3]
            raise EgglogError(f"egglog holds the captured {node.op} over classes {want} as {found}: "
                              "the e-graph is not the program that was sent (an egglog bug); please report it")


def infer_types(eg: EClassGraph, graph: Graph) -> None:
    """Per-class shape and dtype, each e-node typed once, as soon as its
    operands are (a worklist); two e-nodes of a class that disagree raise
    UnsoundRuleError."""
    inputs = {n.attr("name"): n for n in graph.inputs}
    waiting: dict[str, list[tuple[str, ENode]]] = {}
    missing: dict[int, int] = {}
    ready: list[tuple[str, ENode]] = []
    for class_id, enodes in eg.classes.items():
        for en in enodes:
            operands = set(en.children)
            missing[id(en)] = len(operands)
            for child in operands:
                waiting.setdefault(child, []).append((class_id, en))
            if not operands:
                ready.append((class_id, en))
    memo: dict[tuple, tuple[tuple, str]] = {}  # one shape rule call per signature, not per e-node
    while ready:
        class_id, en = ready.pop()
        try:
            shape, dtype = _typed(en, eg, inputs, memo)
        except ops.ShapeError as exc:
            raise UnsoundRuleError(f"a rule produced an ill-shaped {en.op} term: {exc}") from None
        known = eg.shape.get(class_id)
        if known is not None:
            if known != shape or _dtype_conflict(eg.dtype[class_id], dtype):
                raise UnsoundRuleError(
                    f"a rule merged terms of different types: {en.op} gives {dtype}{list(shape)} but its "
                    f"e-class holds {eg.dtype[class_id]}{list(known)}; check the rules that rewrite {en.op}")
            continue
        eg.shape[class_id], eg.dtype[class_id] = shape, dtype
        for parent in waiting.get(class_id, ()):
            missing[id(parent[1])] -= 1
            if missing[id(parent[1])] == 0:
                ready.append(parent)


def _dtype_conflict(a: str, b: str) -> bool:
    return a != b and WEAK not in (a, b)


def _typed(en: ENode, eg: EClassGraph, inputs, memo) -> tuple[tuple, str]:
    if not en.children or en.op == "extern":  # typed by attributes alone
        return node_type(en.op, en.attrs, [], inputs)
    operands = [(eg.shape[c], eg.dtype[c]) for c in en.children]
    key = (en.op, *operands, *en.attrs.values())
    if key not in memo:
        memo[key] = node_type(en.op, en.attrs, operands, inputs)
    return memo[key]


def node_type(op: str, attrs: dict, operands: list[tuple[tuple, str]], inputs) -> tuple[tuple, str]:
    """Shape and dtype of an e-node from its operands' (shape, dtype); `inputs`
    maps input names to the graph's input nodes."""
    if op == "input":
        node = inputs[attrs["name"]]
        return node.shape, node.dtype
    if op == "const":
        return (), WEAK
    if op == "extern":
        call = attrs["target"]
        return call.shape, call.dtype
    stand_ins = [_StandIn(shape, dtype) for shape, dtype in operands]
    opdef = ops.get(op)
    return tuple(opdef.shape([s.shape for s in stand_ins], attrs)), result_dtype(opdef, stand_ins, attrs)


@dataclass
class _StandIn:
    shape: tuple
    dtype: str
