"""Static checks between the two sides of a rule, where the answer is known
without a program: rank (symbolic, e.g. rank(x) - 1) and kind of result
(boolean vs numeric).  A rule whose sides differ can never be sound."""
from __future__ import annotations

from .. import ops
from .terms import Lit, Pat, Var

# a rank: ("var", name, offset) | ("const", n) | None (unknown)


def rank_of(term):
    if isinstance(term, Var):
        return ("var", term.name, 0) if term.sort == "tensor" else None
    if isinstance(term, Lit) or (isinstance(term, Pat) and term.op == "const"):
        return ("scalar",)
    if not isinstance(term, Pat):
        return None
    group = ops.group_of(term.op)
    opdef = ops.get(term.op)
    tensors = term.args[:opdef.arity]
    attrs = dict(zip(opdef.attr_names(), term.args[opdef.arity:]))
    if group == "pointwise":
        known = {r for r in map(rank_of, tensors) if r != ("scalar",)}
        return known.pop() if len(known) == 1 and None not in known else (("scalar",) if not known else None)
    if group == "reduction":
        r, keep, dims = rank_of(tensors[0]), attrs.get("keepdim"), attrs.get("dims")
        if r is None or r == ("scalar",) or not isinstance(keep, Lit):
            return None
        if keep.value:
            return r
        if not isinstance(dims, Lit):
            return None
        return _shift(r, -len(dims.value))
    if term.op in ("reshape", "expand"):
        shape = attrs["shape"]
        return ("const", len(shape.value)) if isinstance(shape, Lit) else None
    if term.op in ("transpose", "permute", "slice", "repeat_interleave", "linear", "inline", "sdpa", "sdpa_mask", "softmax_attention") or group == "row":
        return rank_of(tensors[0])
    return None


def _shift(rank, by):
    if rank[0] == "var":
        return ("var", rank[1], rank[2] + by)
    return ("const", rank[1] + by)


def describe(rank) -> str:
    if rank[0] == "const":
        return str(rank[1])
    if rank[0] == "scalar":
        return "0 (a scalar)"
    name, offset = rank[1], rank[2]
    return f"rank({name})" + (f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else "")


def kind_of(term):
    """'bool' or 'number' where known."""
    if isinstance(term, Pat) and term.op in ops.OPS and term.op != "const":
        opdef = ops.get(term.op)
        if opdef.dtype == "bool":
            return "bool"
        if opdef.group in ("reduction", "row", "library") or term.op in ("exp", "log", "tanh", "add", "mul", "sub"):
            return "number"
    if isinstance(term, Lit):
        return "number"
    return None


def side_mismatch(lhs, rhs) -> str | None:
    """A message when the sides provably differ, else None."""
    left, right = rank_of(lhs), rank_of(rhs)
    if left and right and ("scalar",) not in (left, right) and left[0] == right[0] and left != right:
        return f"the two sides have different ranks: {describe(left)} on the left, {describe(right)} on the right"
    kinds = kind_of(lhs), kind_of(rhs)
    if None not in kinds and kinds[0] != kinds[1]:
        return f"the left side gives a {kinds[0]} tensor but the right side a {kinds[1]} tensor"
    return None
