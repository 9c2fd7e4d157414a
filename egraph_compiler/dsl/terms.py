"""The terms of the rules language: what both sides and conditions are made of."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    sort: str  # "tensor" or an attribute kind


@dataclass(frozen=True)
class Lit:
    value: object
    sort: str  # "tensor" (a scalar constant) or an attribute kind


@dataclass(frozen=True)
class Pat:
    op: str
    args: tuple  # tensor operands, then attributes in op-table order


@dataclass(frozen=True)
class Arith:
    """Arithmetic on attribute or constant values, computed when the rule fires."""
    op: str  # + - * /
    left: object
    right: object
    sort: str  # int or float


@dataclass(frozen=True)
class Query:
    """A fact about a tensor variable's e-class: size(x, d), rank(x) or dtype(x)."""
    kind: str
    var: Var
    dim: int = 0

    @property
    def sort(self) -> str:
        return "str" if self.kind == "dtype" else "int"


@dataclass(frozen=True)
class Condition:
    """`left op right`; a tensor variable against a number is a domain assumption."""
    left: object  # Var or Query
    op: str
    right: tuple  # one term, or several for `in`

    @property
    def is_assumption(self) -> bool:
        return isinstance(self.left, Var) and self.left.sort == "tensor"


DTYPE_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i64": "int64",
               "i32": "int32", "b8": "bool", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
               "float64": "float64", "int64": "int64", "int32": "int32", "bool": "bool"}
