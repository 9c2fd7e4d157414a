"""Row composites (softmax, log_softmax, layer_norm, rms_norm) in their primitive
form, instantiated from their `*_def` rules: lowering expands each one it
computes, so a row and its fused neighbours lower as one kernel, and the math
lives in the rule files alone."""
from __future__ import annotations

from . import ops
from .dsl.evaluate import attr_value, op_attrs
from .dsl.library import library_rule
from .dsl.terms import Lit, Var
from .errors import CodegenError
from .graph import Node, computed_nodes, const


# The definition rule each row composite lowers from (rules/*.rules); targets whose means are
# float32 sums (not Target.exact_mean) take layer_norm's corrected form from rules/lowering.rules.
ROW_DEFINITIONS = {"softmax": "softmax_def", "log_softmax": "log_softmax_def", "rms_norm": "rms_norm_def",
                   "layer_norm": "layer_norm_def"}
FLOAT_SUM_DEFINITIONS = {"layer_norm": "layer_norm_centred"}


def expand_row(node: Node, exact_mean: bool = False) -> Node:
    """The primitive form of a row composite, instantiated from its definition
    rule (the right-hand side with the composite's operands and attributes; the
    operand edges kept as they are, each intermediate an `inline` edge, so the
    whole row computes in this kernel).  A norm over its last `ndim` dims reads
    the rule's last dim (`[-1]`) as those dims.  `exact_mean`: the target divides
    a mean's double-precision sum before rounding it (C++), so a constant row's
    mean is exact and layer_norm needs no correction."""
    name = (ROW_DEFINITIONS if exact_mean else ROW_DEFINITIONS | FLOAT_SUM_DEFINITIONS).get(node.op)
    if name is None:
        raise CodegenError(f"no row lowering for {node.op}")
    rule = library_rule(name)
    opdef = ops.get(node.op)
    tensors = {var.name: operand for var, operand in zip(rule.lhs.args[:opdef.arity], node.args)}
    attrs, dims = {}, (-1,)
    for term, (attr, _) in zip(rule.lhs.args[opdef.arity:], opdef.attrs):
        if isinstance(term, Var):
            attrs[term.name] = node.attr(attr)
        elif attr == "ndim":
            dims = tuple(range(-node.attr("ndim"), 0))
        elif term.value != node.attr(attr):
            raise CodegenError(f"{name} does not define {node.op} with {attr}={node.attr(attr)!r}")
    return _instantiate(rule.rhs, tensors, attrs, dims, root=True)


def _instantiate(term, tensors: dict, attrs: dict, dims: tuple, root: bool = False) -> Node:
    if isinstance(term, Var):
        return tensors[term.name]
    if isinstance(term, Lit):
        return const(term.value)
    if term.op == "const":
        return const(attr_value(term.args[0], attrs))
    opdef = ops.get(term.op)
    operands = tuple(_instantiate(a, tensors, attrs, dims) for a in term.args[:opdef.arity])
    values = op_attrs(term, attrs)
    if values.get("dims") == (-1,):
        values["dims"] = dims
    node = Node.make(term.op, operands, values)
    return node if root else Node.make("inline", (node,))


def expand_rows(root: Node, origin: dict[int, Node], exact_mean: bool = False) -> Node:
    """The kernel tree with every computed row composite expanded; `origin`
    maps each node of the new tree to the node of `root`'s tree it stands for."""
    memo: dict[int, Node] = {}

    def edge(a: Node) -> Node:
        if a.op == "inline":
            return Node.make("inline", (visit(a.args[0]),))
        if a.group == "layout":  # a view over something computed here
            inner = edge(a.args[0])
            return a if inner is a.args[0] else Node.make(a.op, (inner,), a.a)
        return a

    def visit(n: Node) -> Node:
        if id(n) in memo:
            return memo[id(n)]
        args = tuple(edge(a) for a in n.args)
        out = n if args == n.args else Node.make(n.op, args, n.a)
        if out.group == "row":
            out = expand_row(out, exact_mean)
            for part in computed_nodes(out):
                origin.setdefault(id(part), n)
        origin.setdefault(id(out), n)
        memo[id(n)] = out
        return out
    return visit(root)
