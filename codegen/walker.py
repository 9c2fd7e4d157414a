"""The expression walker shared by the renderers: loop-IR scalar expressions
-> source text, with everything target-specific taken from a table."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from egraph_compiler.loopir import Acc, Call, Const, Load


@dataclass(frozen=True)
class Target:
    ops: dict[str, str]  # op name -> format string over {0}, {1}, {2}
    load: Callable[[Load], str]
    const: Callable[[float], str]
    pow_special: dict[float, str]  # constant exponent -> format over {0}


def render_expr(expr, target: Target) -> str:
    if isinstance(expr, Load):
        return target.load(expr)
    if isinstance(expr, Const):
        return target.const(expr.value)
    if isinstance(expr, Acc):
        return expr.name
    assert isinstance(expr, Call), expr
    if expr.op == "div" and isinstance(expr.args[1], Acc):  # a row-invariant divisor: one reciprocal per row
        reciprocal = target.ops["div"].format(target.const(1.0), expr.args[1].name)
        return target.ops["mul"].format(render_expr(expr.args[0], target), reciprocal)
    if expr.op == "pow" and isinstance(expr.args[1], Const) and expr.args[1].value in target.pow_special:
        return target.pow_special[expr.args[1].value].format(render_expr(expr.args[0], target))
    fmt = target.ops.get(expr.op)
    if fmt is None:
        raise KeyError(f"no scalar formula for {expr.op}")
    return fmt.format(*(render_expr(a, target) for a in expr.args))


def float_literal(value: float, suffix: str, inf: str, nan: str) -> str:
    if math.isnan(value):
        return nan
    if math.isinf(value):
        return inf if value > 0 else f"(-{inf})"
    text = repr(float(value))
    return f"({text}{suffix})" if value < 0 else f"{text}{suffix}"
