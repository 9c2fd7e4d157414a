"""Graph IR: hash-consed, immutable op nodes with shapes and dtypes.

The level between capture and the e-graph, and the form extraction returns.
`Node.make` interns every node, so structurally equal nodes are the same
object (free common-subexpression elimination, and a one-to-one map to e-graph
terms).  Shapes and dtypes come from the op table when a node is made, so an
ill-shaped term cannot exist.
"""
from __future__ import annotations

import weakref
from functools import cached_property
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import ops

WEAK = "weak"  # dtype of a Python scalar: it adopts its partner's dtype
INTEGRAL = {"bool", "uint8", "int8", "int16", "int32", "int64"}


class _TensorSlot:
    """Marks where a tensor operand goes in an extern call's arguments (a real
    `None` argument, such as sdpa's `attn_mask=None`, stays None)."""

    def __repr__(self):
        return "<tensor>"


TENSOR_SLOT = _TensorSlot()


@dataclass(frozen=True, eq=False)
class ExternCall:
    """An ATen op outside the vocabulary, with its non-tensor arguments frozen."""
    target: Any  # torch OpOverload
    template: tuple  # args with tensor positions replaced by TENSOR_SLOT
    kwargs: tuple
    shape: tuple
    dtype: str
    item: int | None  # index into a tuple result
    where: str  # the user's source line, for messages
    key: str = field(default="")
    reason: str = "outside the vocabulary"  # why ATen runs it
    # the other outputs of one call of a multi-output op, computed by it and not yet read: each call of
    # the program runs the op once (a random op such as native_dropout must give its output and its mask
    # from one draw), the first output read computes them all, and each sibling takes its own
    pending: dict = field(default_factory=dict, compare=False, repr=False)
    # per tensor argument, whether eager gave the op a contiguous tensor: it gets one here too (ours
    # may be laid out otherwise, and ops autograd calls internally assume the layout it gives them:
    # _weight_norm_interface_backward reads a channels-last gradient wrongly)
    dense: tuple = ()
    # the call's place in the program (capture's order): random ops run in it, as eager draws them
    order: int = 0

    def __post_init__(self):
        if not self.key:  # (unique per call: two calls of one op with the same arguments stay two)
            object.__setattr__(self, "key", f"{self.target}#{id(self):x}")

    def __str__(self):
        return self.key or str(self.target)

    @property
    def random(self) -> bool:
        """Draws from torch's random stream (dropout, rand): its place in the program matters."""
        return torch.Tag.nondeterministic_seeded in getattr(self.target, "tags", ())

    def run(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.item is not None and self.item in self.pending:
            return self.pending.pop(self.item)
        if self.dense:
            tensors = [t.contiguous() if d and isinstance(t, torch.Tensor) else t for t, d in zip(tensors, self.dense)]
        it = iter(tensors)
        args = [_fill(a, it) for a in self.template]
        kwargs = {k: _fill(v, it) for k, v in self.kwargs}
        out = self.target(*args, **kwargs)
        if self.item is None:
            return out
        self.pending.update((i, v) for i, v in enumerate(out) if i != self.item)  # (shared by the siblings)
        return out[self.item]


@dataclass(frozen=True)
class Bound:
    """A parameter or buffer input, read from its module at call time (as
    torch.compile does), so that reassigning `m.weight` is seen; `value` is a
    constant tensor of the program instead (no module)."""
    module: Any
    target: str
    value: Any = None

    def get(self) -> torch.Tensor:
        if self.module is None:
            return self.value
        obj = self.module
        for part in self.target.split("."):
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class Literal:
    """A non-tensor value the program returns, passed through as it is."""
    value: Any


def _fill(a, it):
    if a is TENSOR_SLOT:
        return next(it)
    if isinstance(a, tuple) and a and a[0] == "__list__":
        return [_fill(x, it) for x in a[1:]]
    return a


# Hash-consing table.  Weak values: a node lives as long as a graph or plan holds it,
# not for the life of the process.  A key names its operands by id(), which is safe
# because a live node holds its operands (their ids cannot be reused while it is here).
_INTERN: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()


@dataclass(frozen=True, eq=False)
class Node:
    op: str
    args: tuple["Node", ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def make(op: str, args=(), attrs: dict | None = None, shape=None, dtype=None) -> "Node":
        attrs = dict(attrs or {})
        key = (op, tuple(id(a) for a in args), tuple(sorted((k, _hashable(v)) for k, v in attrs.items())),
               None if shape is None else tuple(shape), dtype)
        node = _INTERN.get(key)
        if node is not None:
            return node
        opdef = ops.get(op)
        if opdef.arity >= 0 and len(args) != opdef.arity:
            raise ops.ShapeError(f"{op} takes {opdef.arity} operands, got {len(args)}")
        if shape is None:
            shape = tuple(opdef.shape([a.shape for a in args], attrs))
        if dtype is None:
            dtype = result_dtype(opdef, args, attrs)
        ordered = tuple((name, _hashable(attrs[name])) for name in opdef.attr_names() if name in attrs)
        node = Node(op, tuple(args), ordered, tuple(shape), dtype)
        node.__dict__["_key"] = key
        _INTERN[key] = node
        return node

    def attr(self, name: str) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        raise KeyError(name)

    @property
    def a(self) -> dict:
        return dict(self.attrs)

    @cached_property  # (read hundreds of thousands of times a compile: kept in the instance's dict)
    def group(self) -> str:
        return ops.group_of(self.op)

    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self):
        return f"Node({self.op}, {self.shape})"


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def result_dtype(opdef: ops.OpDef, args, attrs) -> str:
    if opdef.dtype == "bool":
        return "bool"
    if opdef.dtype == "attr":
        return attrs.get("dtype", WEAK)
    if opdef.dtype == "first":
        return args[0].dtype
    if opdef.dtype == "sum":  # torch sums integers and bools in int64
        return "int64" if args[0].dtype in INTEGRAL else args[0].dtype
    operands = args[1:] if opdef.name == "where" else args
    strong = [a.dtype for a in operands if a.dtype != WEAK]
    if not strong:
        return WEAK
    out = getattr(torch, strong[0])
    for d in strong[1:]:
        out = torch.promote_types(out, getattr(torch, d))
    if opdef.name == "div" and not out.is_floating_point:
        out = torch.float32
    return str(out).removeprefix("torch.")


def const(value: float) -> Node:
    return Node.make("const", (), {"value": float(value)}, shape=(), dtype=WEAK)


def input_node(name: str, shape, dtype: str) -> Node:
    return Node.make("input", (), {"name": name}, shape=tuple(shape), dtype=dtype)


@dataclass
class Graph:
    inputs: list[Node]  # input nodes, in call order
    outputs: tuple[Node, ...]
    bound: dict[str, "Bound"] = field(default_factory=dict)  # parameters and buffers: input name -> where

    where: dict[int, str] = field(default_factory=dict)  # id(node) -> user source line
    # in-place updates of inputs or buffers: (input name, index into outputs of the new value);
    # those outputs follow the user's, and the runtime copies them back
    mutations: list[tuple[str, int]] = field(default_factory=list)
    # the user's result structure: (pytree spec, leaves), a leaf an int (index into outputs) or
    # Literal(value) for a non-tensor the program returns; None: the outputs as a tuple
    results: tuple | None = None
    eclass: dict[int, str] = field(default_factory=dict)  # id(node) -> its e-class (an extracted graph's)
    # user inputs captured in their storage's order (a transposed tensor: a training backward's
    # saved activations): input name -> (dims, the caller's shape); the input node holds
    # `caller.permute(dims)`, dense, and the program reads it back through a permute
    orders: dict[str, tuple] = field(default_factory=dict)
    # outputs that eager returns as a transpose of a dense tensor: position -> its strides (the
    # runtime hands such a view of its own buffer out as it is; any other layout is a copy)
    output_strides: dict[int, tuple] = field(default_factory=dict)

    @property
    def user_outputs(self) -> int:
        return len(self.outputs) - len(self.mutations)

    def topo(self) -> list[Node]:
        return topo_order(self.outputs)

    def __str__(self) -> str:
        return format_nodes(self.inputs, self.outputs)


def topo_order(roots) -> list[Node]:
    seen: set[int] = set()
    order: list[Node] = []
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


def type_str(node: Node) -> str:
    short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
             "int64": "i64", "int32": "i32", "bool": "b8", WEAK: "scalar"}
    return f"{short.get(node.dtype, node.dtype)}[{','.join(map(str, node.shape))}]"


def format_attr(v) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(map(str, v)) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def format_nodes(inputs, outputs) -> str:
    """Stable text form: one SSA line per node, inputs by name, constants inline."""
    ids: dict[int, str] = {}
    for n in inputs:
        ids[id(n)] = n.attr("name")
    lines = ["graph(" + ", ".join(f"{n.attr('name')}: {type_str(n)}" for n in inputs) + "):"]
    count = 0
    for node in topo_order(outputs):
        if node.op == "input":
            ids.setdefault(id(node), node.attr("name"))
            continue
        if node.op == "const":
            ids[id(node)] = format_attr(node.attr("value"))
            continue
        ids[id(node)] = f"%{count}"
        count += 1
        operands = [ids[id(a)] for a in node.args]
        operands += [f"{k}={format_attr(v)}" for k, v in node.attrs]
        lines.append(f"  {ids[id(node)]} = {node.op}({', '.join(operands)}) : {type_str(node)}")
    lines.append("  return " + ", ".join(ids[id(o)] for o in outputs))
    return "\n".join(lines)


# ---- kernel structure: which nodes one kernel computes (inline edges) ----

def view_chain(node: Node) -> list[Node]:
    """A node and the views it reads through, down to its source (included)."""
    chain = [node]
    while node.group == "layout":
        node = node.args[0]
        chain.append(node)
    return chain


def view_source(node: Node) -> Node:
    """The tensor a chain of views reads from."""
    while node.group == "layout":
        node = node.args[0]
    return node


def inline_edges(node: Node):
    """(inline node, its target) for each operand computed inside this kernel."""
    for a in node.args:
        a = view_source(a)
        if a.op == "inline":
            yield a, a.args[0]


def computed_nodes(root: Node):
    """`root` and every node below it reached through inline edges (and views):
    what one kernel computes."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        stack.extend(t for _, t in inline_edges(n))


def rebuild(graph: "Graph", substitute) -> "Graph":
    """The graph with every node rebuilt over its rebuilt operands, where
    `substitute(node, operands)` may give a node's replacement (None: the node
    itself over the new operands); source lines and e-classes follow."""
    memo: dict[int, Node] = {}
    for node in topo_order(graph.outputs):
        args = tuple(memo[id(a)] for a in node.args)
        new = substitute(node, args)
        if new is None:
            if node.group == "source" or args == node.args:
                new = node
            elif node.op == "extern":
                new = Node.make("extern", args, node.a, shape=node.shape, dtype=node.dtype)
            else:
                new = Node.make(node.op, args, node.a)
        memo[id(node)] = new
    outputs = tuple(memo[id(o)] for o in graph.outputs)
    where = {**graph.where, **{id(memo[k]): v for k, v in graph.where.items() if k in memo}}
    eclass = {**graph.eclass, **{id(memo[k]): v for k, v in graph.eclass.items() if k in memo}}
    return replace(graph, outputs=outputs, where=where, eclass=eclass)
