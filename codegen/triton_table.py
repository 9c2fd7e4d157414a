"""The Triton target's table: its scalar formulas, dtypes, constants and the prelude of
`@triton.jit` helpers every generated module starts with (the kernels' shapes: triton.py)."""
from __future__ import annotations

from .walker import NARROW_INTEGERS

TL = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16", "bool": "tl.int1",
      "int64": "tl.int64", "int32": "tl.int32", "uint8": "tl.uint8", "int8": "tl.int8", "int16": "tl.int16"}

SCALAR_OPS = {
    "exp": "tl.exp({0})", "log": "tl.log({0})", "tanh": "(2.0 * tl.sigmoid(2.0 * ({0})) - 1.0)",
    "log1p": "_egc_log1p({0})", "expm1": "_egc_expm1({0})",
    "erf": "tl.math.erf({0})", "cos": "tl.cos({0})", "sin": "tl.sin({0})", "floor": "tl.floor({0})", "relu": "tl.maximum({0}, 0.0, propagate_nan=tl.PropagateNan.ALL)", "sigmoid": "tl.sigmoid({0})",
    "neg": "(-({0}))", "abs": "tl.abs({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})",
    "silu": "(({0}) * tl.sigmoid({0}))",
    "gelu": "(0.5 * ({0}) * (1.0 + tl.math.erf(({0}) * 0.7071067811865476)))",
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u)
    "gelu_tanh": "(({0}) * tl.sigmoid(1.5957691216057308 * (({0}) + 0.044715 * ({0}) * ({0}) * ({0}))))",
    # round to the dtype, keep computing in float32 (tl.cast: {0} may be a constant); integers reach a
    # narrow float through float32, as torch converts them (and the interpreter's int -> bf16 is NaN)
    "cast": "tl.cast(tl.cast({0}, tl.float32), {dtype}).to(tl.float32)",
    "cast_int": "tl.cast({0}, {dtype})",  # integers stay integers
    "add": "(({0}) + ({1}))", "sub": "(({0}) - ({1}))", "mul": "(({0}) * ({1}))", "div": "(({0}) / ({1}))",
    "maximum": "_egc_maximum({0}, {1})", "pow": "_egc_pow({0}, {1})",
    "pow_scalar_base": "_egc_pow(({0}) + tl.zeros_like({1}), {1})",  # (tl.zeros_like of a float fails on GPU)
    "gt": "(({0}) > ({1}))", "ge": "(({0}) >= ({1}))", "lt": "(({0}) < ({1}))", "le": "(({0}) <= ({1}))",
    "eq": "(({0}) == ({1}))", "ne": "(({0}) != ({1}))",
    "where": "tl.where(({0}) != 0, {1}, {2})",  # (a condition may be a float: a cast to bool computes in float32)
}

PRELUDE = '''import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))  # (no NaN global: triton checks globals for change with ==)


@triton.jit
def _egc_maximum(a, b):  # torch.maximum: a NaN on either side wins
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def _egc_pow(a, b):
    b = b + tl.zeros_like(a)  # a constant exponent becomes a block like a
    a = a + tl.zeros_like(b)  # and a scalar base (one element loaded) a block like b
    m = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = b == tl.floor(b)
    odd = whole & (tl.abs(b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    m = tl.where((a < 0) & odd, -m, m)
    m = tl.where((a < 0) & ~whole, INF - INF, m)
    return tl.where(a == 0, tl.where(b > 0, 0.0, tl.where(b == 0, 1.0, INF)), m)


@triton.jit
def _egc_log1p(x):  # log(1 + x) without 1 + x's rounding (Kahan): log(u) * x / (u - 1), exact where u - 1 is 0
    u = 1.0 + x
    d = u - 1.0
    return tl.where((d == 0.0) | (x == INF), x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _egc_expm1(x):  # exp(x) - 1 without the cancellation (Kahan): (u - 1) * x / log(u) for u = exp(x)
    u = tl.exp(x)
    d = u - 1.0
    near = (d == 0.0) | (d == -1.0) | (u == INF)  # x itself, -1, inf
    r = d * (x / tl.log(tl.where(near, 2.0, u)))
    return tl.where(d == 0.0, x, tl.where(near, d, r))


@triton.jit
def _egc_nanmax(a, b):  # a row max's combine: a NaN anywhere in the row wins, as torch's max
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _egc_add2(a, b, c, d):  # two sums in one reduction (a tuple's combine)
    return a + c, b + d


@triton.jit
def _egc_add3(a, b, c, d, e, f):
    return a + d, b + e, c + f


@triton.jit
def _egc_row(i, rows, err):  # a gather's row: one out of range is never read, and is reported
    bad = (i < 0) | (i >= rows)
    tl.device_assert(bad == 0, "index out of range in embedding")  # on a GPU (the kernel runs with debug)
    tl.store(err + i * 0, 1, mask=bad)  # and the flag, read after the launch on CPU tensors (the interpreter)
    return tl.where(bad, 0, i)
'''


def _const(value: float) -> str:
    """A constant of an expression.  inf and NaN are 0-d blocks, not the constexpr INF itself: a
    constexpr on an operator's left (`(INF - INF) >= x`, a folded empty mean compared) is a
    constexpr wrapping the result, which the interpreter refused to store ("cannot convert ... to
    tensor", soak seed 33002)."""
    if value != value:
        return "tl.full([], INF - INF, tl.float32)"
    if value in (float("inf"), float("-inf")):
        return "tl.full([], INF, tl.float32)" if value > 0 else "tl.full([], -INF, tl.float32)"
    return f"({float(value)!r})"


FIELDS = dict(
    language="generated Triton", ops=SCALAR_OPS, const=_const,
    pow_special={2.0: "(({0}) * ({0}))", 0.5: "tl.sqrt({0})", 1.0: "({0})", 3.0: "(({0}) * ({0}) * ({0}))",
                 -1.0: "(1.0 / ({0}))"},
    floordiv="//", dtypes=(frozenset(TL) - NARROW_INTEGERS) | {"weak"}, narrow_reads=NARROW_INTEGERS,
    dtype_names=TL, int_const=str, row="_egc_row({row}, {rows}, {err})",
)
