"""Loop variables re-derived for narrower ranges: a kernel over a concatenation split at the
operands' boundaries (`pieces`), a row read in runs (`strips`), a transpose's tiles (`tile_vars`).

Lowering computes `cat(a, b)` as `where(index < len(a), a[i mod len(a)], b[...])`
(lower.py `concat`): every element evaluates both sides' index arithmetic, and a
target that evaluates both sides (a vectorised select) reads every operand.  When the
position is a loop variable, the loop can run in pieces instead, one per operand:
in each piece the condition is decided, the `where` keeps one side, and the side's
index, re-derived for the piece's narrower range, loses its modulo.  GPT-2's backward
`cat(dq, dk, dv)` of attention's gradients ([512, 768]) took 0.55 ms on 2 cores, 0.15 now.
The C++ target renders the pieces as one function of loop nests (codegen/cpp.py); Triton renders
a reduction's pieces as one kernel with a body per piece, picked by the grid's third axis, and
keeps a pointwise cat whole (measured faster on the H200: codegen/triton.py).

`pieces(k)` returns kernels over disjoint parts of `k`'s domain that together compute
what `k` does (or `[k]` when nothing splits).  The outer variable splits in any kernel
(each outer index computes its own results); the row variable only in kernels without
reductions (a reduction's pieces would each start a fresh sum).
"""
from __future__ import annotations

from dataclasses import replace

from .codegen.walker import expr_dtype
from .loopir import Affine, Call, Const, Gather, Index, Load, LoopKernel, Reduction, expressions, loads

MAX_PIECES = 16  # a cat of many operands stays one loop rather than a long function


def pieces(k: LoopKernel) -> list[LoopKernel]:
    out: list[LoopKernel] = []

    def split(kernel: LoopKernel) -> bool:
        point = _split_point(kernel)
        if point is None:
            out.append(kernel)
            return len(out) <= MAX_PIECES
        var, at = point
        n = kernel.outer if var == "o" else kernel.inner
        return split(_restrict(kernel, var, 0, at)) and split(_restrict(kernel, var, at, n - at))

    return out if split(k) and len(out) > 1 else [k]


def _split_point(k: LoopKernel):
    """(var, p): a cat's condition `index < c` on a loop variable alone flips at p inside its range."""
    for e in expressions(k):
        for index, c in _conditions(e):
            if len(index.terms) != 1 or index.terms[0][0][0] != "var" or index.terms[0][1] <= 0:
                continue
            (_, var, _), a = index.terms[0]
            if var not in ("o", "r") or (var == "r" and k.reductions):
                continue  # a gather's row variable is set inside the body, not looped over
            n = k.outer if var == "o" else k.inner
            p = -(-(c - index.const) // a)  # the first value at which a*v + const >= c
            if 0 < p < n:
                return var, p
    return None


def _conditions(e):
    if isinstance(e, Call):
        if e.op == "lt" and isinstance(e.args[0], Index) and isinstance(e.args[1], Const):
            yield e.args[0].index, int(e.args[1].value)
        for a in e.args:
            yield from _conditions(a)
    elif isinstance(e, Gather):
        yield from _conditions(e.value)
        yield from _conditions(e.row)


def _restrict(k: LoopKernel, var: str, lo: int, n: int) -> LoopKernel:
    """`k` with `var` running over lo..lo+n-1 (as var + lo, var in 0..n-1), indices re-derived
    for that range and cat conditions decided where the range settles them."""
    types = {p.name: p.dtype for p in k.params}
    ex = lambda e: _fold(_shift_expr(e, var, lo, n), types)
    return replace(
        k, outer=n if var == "o" else k.outer, inner=n if var == "r" else k.inner,
        reductions=[Reduction(r.acc, r.combiner, ex(r.body), r.dtype) for r in k.reductions],
        store_index=_shift(k.store_index, var, lo, n), value=ex(k.value),
        extra_stores=[(p, _shift(i, var, lo, n), ex(v), inner) for p, i, v, inner in k.extra_stores])


def _shift(index: Affine, var: str, lo: int, n: int) -> Affine:
    return put_index(index, var, Affine.var(var, n) + Affine.of(lo))


def put_index(index: Affine, var: str, value: Affine) -> Affine:
    """`index` with the loop variable `var` replaced by `value`, its divisions and modulos
    re-derived (and simplified by the new variables' ranges)."""
    out = Affine.of(index.const)
    for term, coeff in index.terms:
        if term[0] == "var":
            part = value if term[1] == var else Affine(((term, 1),))
        else:
            inner = put_index(term[1], var, value)
            part = inner.floordiv(term[2]) if term[0] == "div" else inner.mod(term[2])
        out = out + part.scale(coeff)
    return out


def _shift_expr(e, var: str, lo: int, n: int):
    return put_expr(e, var, Affine.var(var, n) + Affine.of(lo))


def put_expr(e, var: str, value: Affine):
    if isinstance(e, Load):
        return Load(e.param, put_index(e.index, var, value))
    if isinstance(e, Index):
        return Index(put_index(e.index, var, value))
    if isinstance(e, Call):
        return Call(e.op, tuple(put_expr(a, var, value) for a in e.args), e.dtype)
    if isinstance(e, Gather):
        return Gather(put_expr(e.value, var, value), e.var, put_expr(e.row, var, value), e.rows)
    return e


def strips(k: LoopKernel):
    """(m, kernel) for a pointwise kernel whose row is read in runs of m (`r % m`, `r / m`: a head's
    dims in a [batch, heads, seq, dim] tensor read as [batch, seq, heads * dim]): the row variable
    written `rl + m * rh`, rl in 0..m-1 and rh in 0..inner/m-1, so that a target can loop over the
    runs and, inside one, read along rl with no division (g++ gathered such loads one by one).
    None where no such m divides the row or some read stays divided."""
    if k.reductions or k.stash_last or not k.store_in_inner or any(not s[3] for s in k.extra_stores):
        return None
    moduli = sorted({m for e in expressions(k) for load in loads(e) for m in _row_moduli(load.index)})
    for m in (m for m in moduli if 8 <= m < k.inner and k.inner % m == 0):
        value = Affine.var("rl", m) + Affine.var("rh", k.inner // m).scale(m)
        ex = lambda e: put_expr(e, "r", value)
        split = replace(k, reductions=[], store_index=put_index(k.store_index, "r", value), value=ex(k.value),
                        extra_stores=[(p, put_index(i, "r", value), ex(v), inner) for p, i, v, inner in k.extra_stores])
        if not any(t[0] != "var" and "rl" in _names(t[1]) for e in expressions(split) for load in loads(e)
                   for t, _ in load.index.terms):
            return m, split
    return None


def _row_moduli(index: Affine):
    """The divisors and moduli applied to the row variable, nested ones too: a rotary embedding's
    backward reads `((r % 64) % 32) + 64 * (r / 64)`, whose runs of 32 read along with no division."""
    for term, _ in index.terms:
        if term[0] in ("mod", "div") and "r" in _names(term[1]):
            yield term[2]
            yield from _row_moduli(term[1])


def tile_vars(k: LoopKernel, tile: int) -> list:
    """The kernel's stores (param, index, value, in_inner) with its variables written per tile:
    o as `ol + tile*ob`, r as `rl + tile*rb` (ol, rl in 0..tile-1), indices re-derived."""
    o = Affine.var("ol", tile) + Affine.var("ob", -(-k.outer // tile)).scale(tile)
    r = Affine.var("rl", tile) + Affine.var("rb", -(-k.inner // tile)).scale(tile)
    put = lambda i: put_index(put_index(i, "o", o), "r", r)
    ex = lambda e: put_expr(put_expr(e, "o", o), "r", r)
    return [(p, put(i), ex(v), inner) for p, i, v, inner in
            [(k.store_param, k.store_index, k.value, k.store_in_inner)] + list(k.extra_stores)]


def _names(index: Affine) -> set:
    return {n for t, _ in index.terms for n in ([t[1]] if t[0] == "var" else _names(t[1]))}


def _bounds(index: Affine) -> tuple[int, int]:
    """The least and the greatest value an index takes over its variables' ranges."""
    low = high = index.const
    for term, c in index.terms:
        top = term[2] - 1 if term[0] in ("var", "mod") else -(-term[1].upper() // term[2]) - 1
        low, high = (low, high + c * top) if c > 0 else (low + c * top, high)
    return low, high


def _fold(e, types: dict[str, str]):
    """`where(index < c, a, b)` as `a` or `b` where the index's range decides it (cast to the
    cat's dtype where the side's differs: torch.cat promotes)."""
    if isinstance(e, Call):
        args = tuple(_fold(a, types) for a in e.args)
        if e.op == "where" and isinstance(args[0], Call) and args[0].op == "lt" and \
                isinstance(args[0].args[0], Index) and isinstance(args[0].args[1], Const):
            low, high = _bounds(args[0].args[0].index)
            side = args[1] if high < args[0].args[1].value else args[2] if low >= args[0].args[1].value else None
            if side is not None:
                return side if expr_dtype(side, types) in (expr_dtype(e, types), "weak") else Call("cast", (side,), e.dtype)
        return Call(e.op, args, e.dtype)
    if isinstance(e, Gather):
        return Gather(_fold(e.value, types), e.var, _fold(e.row, types), e.rows)
    return e

