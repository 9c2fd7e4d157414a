"""The walker shared by the renderers: loop-IR expressions and index maps ->
source text, with everything target-specific taken from a `Target` table.

A target is one object: the scalar formula of every pointwise op, literals,
index syntax, the dtypes its generated code handles, the device it runs on,
and how a rendered program is built and loaded (`load`).  `codegen/cpp.py`
and `codegen/triton.py` each hold one table plus the kernel skeleton that
truly differs (scalar loops with OpenMP against blocked vectors)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from egraph_compiler.loopir import ERROR_FLAG, Acc, Affine, Call, Const, Gather, Index, Load, variables
from egraph_compiler.ops import COMPARISONS, INTEGERS


@dataclass(frozen=True)
class Target:
    name: str  # the `target=` a user gives
    language: str  # for messages: "generated C++"
    device: str  # where its tensors live: cpu | cuda
    ops: dict[str, str]  # op name -> format string over {0}, {1}, {2} (cast: {dtype})
    const: Callable[[float], str]
    pow_special: dict[float, str]  # constant exponent -> format over {0}
    floordiv: str  # index syntax: "/" in C, "//" in Python
    dtypes: frozenset  # dtypes its generated code reads, computes and writes
    dtype_names: dict[str, str] = field(default_factory=dict)  # our dtype -> the language's
    int_const: Callable[[int], str] = str  # an integer literal (in integer arithmetic and comparisons)
    render: Callable = None  # loop kernels -> the program's source
    kernel_source: Callable = None  # one loop kernel -> its source alone (reports show it per kernel)
    exact_mean: bool = False  # sums in double, a mean divided before rounding: lowering's `mean` reductions
    row: str = ""  # a gather's row, checked and clamped: format over {row}, {rows}, {err} (loopir.Gather)
    # (source, loop kernels) -> ({kernel name: callable over torch tensors, inputs then outputs}, compiled_now)
    load: Callable = None
    tunes: bool = False  # its load takes `autotune=` (launch configurations timed at the first launch)
    sized: object = None  # codegen.sizes.Sized: its kernels can take sizes as arguments (load's `sizes=`)
    prepare: Callable = None  # starts, while the e-graph works, what loading will need (Triton: compile workers)
    # integer dtypes its kernels read only as an input cast to a float (a uint8 image's `.float()`):
    # never computed on, so C++'s promotion of narrow integers to int cannot change a result
    narrow_reads: frozenset = frozenset()

    def generates(self, dtype: str) -> bool:
        return dtype in self.dtypes


NARROW_INTEGERS = frozenset({"uint8", "int8", "int16"})  # what both targets read as Target.narrow_reads


def render_index(index: Affine, target: Target) -> str:
    parts = []
    for term, coeff in index.terms:
        text = _term(term, target)
        parts.append(text if coeff == 1 else f"{coeff}*{text}")
    if index.const or not parts:
        parts.append(str(index.const))
    return " + ".join(parts)


def _term(term, target: Target) -> str:
    if term[0] == "var":
        return term[1]
    kind, inner, c = term
    return f"(({render_index(inner, target)}) {target.floordiv if kind == 'div' else '%'} {c})"


def expr_dtype(e, types: dict[str, str]) -> str:
    """The dtype a scalar expression computes in: a buffer's, a call's result,
    int64 for loop indices, float32 for accumulators; "weak" for constants."""
    if isinstance(e, Load):
        return types.get(e.param, "float32")
    if isinstance(e, Const):
        return "weak"
    if isinstance(e, Index):
        return "int64"
    if isinstance(e, Call):
        return e.dtype if e.dtype not in ("", "weak") else "float32"
    return "float32"


def integer_context(e: Call, types: dict[str, str]) -> bool:
    """Whether a call computes on integers: its constants are then integer
    literals (a float literal would turn int64 arithmetic into float32's)."""
    if e.op in COMPARISONS:
        return any(expr_dtype(a, types) in INTEGERS for a in e.args)
    return e.dtype in INTEGERS


def render_expr(expr, target: Target, load: Callable[[Load], str], acc: Callable[[str], str] = str,
                types: dict[str, str] | None = None) -> str:
    """`load` renders a buffer read (targets differ in masks and casts), `acc`
    an accumulator's name, `types` the kernel's buffer dtypes."""
    types = types or {}

    def operand(a, integers: bool) -> str:
        if integers and isinstance(a, Const) and math.isfinite(a.value) and a.value == int(a.value) and abs(
                a.value) < 2**62:
            return target.int_const(int(a.value))
        return walk(a)  # a fractional constant beside integers: a comparison in float, as torch promotes

    def walk(e) -> str:
        if isinstance(e, Load):
            return load(e)
        if isinstance(e, Const):
            return target.const(e.value)
        if isinstance(e, Index):
            return f"({render_index(e.index, target)})"
        if isinstance(e, Acc):
            return acc(e.name)
        if isinstance(e, Gather):
            row = target.row.format(row=walk(e.row), rows=target.int_const(e.rows), err=ERROR_FLAG)
            return walk(_bind(e.value, e.var, f"({row})"))
        assert isinstance(e, Call), e
        if e.op == "div" and isinstance(e.args[1], Acc):  # a row-invariant divisor: one reciprocal per row
            reciprocal = target.ops["div"].format(target.const(1.0), acc(e.args[1].name))
            return target.ops["mul"].format(walk(e.args[0]), reciprocal)
        if e.op == "pow" and isinstance(e.args[1], Const) and e.args[1].value in target.pow_special:
            return target.pow_special[e.args[1].value].format(walk(e.args[0]))
        fmt = target.ops.get(e.op)
        if e.op == "where" and "where_row" in target.ops and _per_row(e.args[0]):
            fmt = target.ops["where_row"]  # a condition that is the same along the row
        integers = integer_context(e, types)
        if integers and e.op == "cast":
            fmt = target.ops.get("cast_int", fmt)
        if e.op == "pow" and isinstance(e.args[0], Const) and not isinstance(e.args[1], Const):
            fmt = target.ops.get("pow_scalar_base", fmt)  # 2.0 ** x: a target may need the base as a block
        if fmt is None:
            raise KeyError(f"no scalar formula for {e.op} in {target.language}")
        args = [operand(a, integers and not (e.op == "where" and i == 0)) for i, a in enumerate(e.args)]
        return fmt.format(*args, dtype=target.dtype_names.get(e.dtype, e.dtype))
    return walk(expr)


def _bind(e, var: str, text: str):
    """`e` with the index variable `var` written as `text` (a gather's row) in its loads and indices."""
    if isinstance(e, Load):
        return Load(e.param, _bind_index(e.index, var, text))
    if isinstance(e, Call):
        return Call(e.op, tuple(_bind(a, var, text) for a in e.args), e.dtype)
    if isinstance(e, Gather):
        return Gather(_bind(e.value, var, text), e.var, _bind(e.row, var, text), e.rows)
    if isinstance(e, Index):  # a cat's position along the gathered dim (the row itself)
        return Index(_bind_index(e.index, var, text))
    return e


def _bind_index(index: Affine, var: str, text: str) -> Affine:
    terms = []
    for term, coeff in index.terms:
        if term[0] == "var":
            terms.append(((term[0], text if term[1] == var else term[1], term[2]), coeff))
        else:
            terms.append(((term[0], _bind_index(term[1], var, text), term[2]), coeff))
    return Affine(tuple(terms), index.const)


def float_literal(value: float, suffix: str, inf: str, nan: str) -> str:
    if math.isnan(value):
        return nan
    if math.isinf(value):
        return inf if value > 0 else f"(-{inf})"
    text = repr(float(value))
    return f"({text}{suffix})" if value < 0 else f"{text}{suffix}"


def unique_kernels(kernels: list, kernel_source: Callable) -> tuple[list, dict[str, str]]:
    """Kernels whose source (as the target gives it: Triton's with its launch) is the same
    up to their own name and their parameters' names (a repeated layer's norm, activation,
    rotary kernels) are rendered and compiled once.  Returns (the first kernel of each source, in order; each other
    kernel's name -> the name of the one that computes for it, with its tensors in
    the same parameter positions)."""
    first: dict[str, str] = {}
    unique, aliases = [], {}
    for k in kernels:
        names = [k.name] + [p.name for p in k.params]
        where = {name: i for i, name in enumerate(names)}
        key = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: f"@{where[m.group(1)]}",
                     kernel_source(k))
        if key in first:
            aliases[k.name] = first[key]
        else:
            first[key] = k.name
            unique.append(k)
    return unique, aliases


def _per_row(e) -> bool:
    """An expression that is the same for every element of a row: of the outer index alone."""
    if isinstance(e, (Load, Index)):
        return variables(e.index) <= {"o"}
    if isinstance(e, Call):
        return all(_per_row(a) for a in e.args)
    return isinstance(e, (Const, Acc))
