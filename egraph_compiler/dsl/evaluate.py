"""Evaluating one side of a rule with torch, through the op table's
reference functions (used by the verifier)."""
from __future__ import annotations

import math
import operator
from functools import reduce

import torch

from .. import ops
from .terms import Arith, Lit, Pat, Var


class Scalar(float):
    """The value of a `const`: promoted like a Python float when it meets tensors."""


class NotApplicable(Exception):
    """The rule would not fire on this instance (integer division by zero)."""


ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def attr_value(term, attrs):
    if isinstance(term, Lit):
        return tuple(attr_value(v, attrs) for v in term.value) if term.sort == "ints" else term.value
    if isinstance(term, Var):
        return attrs[term.name]
    if isinstance(term, tuple):
        return tuple(attr_value(v, attrs) for v in term)
    if isinstance(term, Arith):
        return arith(term.op, attr_value(term.left, attrs), attr_value(term.right, attrs), term.sort)
    return term  # a plain value inside an ints literal


def arith(op, left, right, sort):
    if op == "/" and right == 0:  # egglog: i64 division by zero does not fire; f64 follows IEEE
        if sort == "int":
            raise NotApplicable("integer division by zero")
        return math.nan if left == 0 or math.isnan(left) else math.copysign(math.inf, left) * math.copysign(1, right)
    if sort == "int" and op == "/":  # truncating, as i64 division
        q = abs(left) // abs(right)
        return q if (left >= 0) == (right > 0) else -q
    return ARITH[op](float(left), float(right)) if sort == "float" else ARITH[op](left, right)


def op_attrs(pat: Pat, attrs) -> dict:
    opdef = ops.get(pat.op)
    return {name: attr_value(v, attrs) for (name, _), v in zip(opdef.attrs, pat.args[opdef.arity:])}


def shape_of(term, shapes, attrs) -> tuple:
    if isinstance(term, Var):
        return tuple(shapes[term.name])
    if isinstance(term, Lit) or term.op == "const":
        return ()
    opdef = ops.get(term.op)
    operands = [shape_of(a, shapes, attrs) for a in term.args[:opdef.arity]]
    return tuple(opdef.shape(operands, op_attrs(term, attrs)))


def evaluate(term, tensors, attrs) -> torch.Tensor:
    value = eval_term(term, tensors, attrs)
    return torch.tensor(float(value), dtype=torch.float64) if isinstance(value, Scalar) else value


def eval_term(term, tensors, attrs):
    if isinstance(term, Var):
        return tensors[term.name]
    if isinstance(term, Lit):
        return Scalar(term.value)
    if term.op == "const":
        return Scalar(attr_value(term.args[0], attrs))
    opdef = ops.get(term.op)
    operands = [eval_term(a, tensors, attrs) for a in term.args[:opdef.arity]]
    return opdef.reference(promote(operands), op_attrs(term, attrs))


def promote(operands) -> list:
    """Scalars become 0-d tensors of the dtype a Python float would give next to the tensor operands."""
    dtypes = [o.dtype for o in operands if not isinstance(o, Scalar)]
    if len(dtypes) == len(operands):
        return operands
    dtype = torch.result_type(torch.zeros(1, dtype=reduce(torch.promote_types, dtypes)), 1.0) if dtypes else \
        torch.float64
    return [torch.tensor(float(o), dtype=dtype) if isinstance(o, Scalar) else o for o in operands]
