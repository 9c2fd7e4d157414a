"""Loop IR: a kernel as an iteration domain, loads with index maps, a scalar
body, reductions and a store.

Every kernel iterates an `outer` range (parallel) and, inside it, an `inner`
range (vectorised).  Reductions run as inner loops, one after another, each
leaving a scalar accumulator for the rest of the body; the store then runs
either as one more inner loop (a pointwise or row kernel) or once per outer
index (a reduction).  Indices are `Affine` forms over the two loop variables,
with floor-division and modulo terms for reshapes; they simplify using the
variables' ranges so that plain strided access renders as plain arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Affine:
    """sum(coeff * term) + const, term = a loop variable or ('div'|'mod', Affine, c)."""
    terms: tuple = ()  # ((term, coeff), ...)
    const: int = 0

    @staticmethod
    def var(name: str, bound: int) -> "Affine":
        return Affine(((("var", name, bound), 1),)) if bound > 1 else Affine()

    @staticmethod
    def of(c: int) -> "Affine":
        return Affine((), int(c))

    def __add__(self, other: "Affine") -> "Affine":
        merged: dict = {}
        for term, coeff in self.terms + other.terms:
            merged[term] = merged.get(term, 0) + coeff
        return Affine(tuple((t, c) for t, c in merged.items() if c), self.const + other.const)._recombined()

    def _recombined(self) -> "Affine":
        """a*(x % n) + a*n*(x // n) = a*x (indices are never negative): a reshape
        that splits a dim and a later one that merges it back cost no division."""
        coeffs = dict(self.terms)
        for term, a in self.terms:
            if term[0] == "mod" and coeffs.get(("div", term[1], term[2])) == a * term[2]:
                pair = (term, ("div", term[1], term[2]))
                rest = Affine(tuple((t, c) for t, c in self.terms if t not in pair), self.const)
                return rest + term[1].scale(a)
        return self

    def scale(self, k: int) -> "Affine":
        if k == 0:
            return Affine()
        return Affine(tuple((t, c * k) for t, c in self.terms), self.const * k)

    def upper(self) -> int:
        """Largest value + 1 (all coefficients are non-negative)."""
        return self.const + sum(c * (_term_bound(t) - 1) for t, c in self.terms) + 1

    def floordiv(self, c: int) -> "Affine":
        if c == 1:
            return self
        if self.upper() <= c and self.const >= 0:
            return Affine()
        exact = Affine(tuple((t, k // c) for t, k in self.terms if k % c == 0), 0)
        rest = Affine(tuple((t, k) for t, k in self.terms if k % c), self.const % c)
        whole = self.const // c
        if not rest.terms:
            return exact + Affine.of(whole + rest.const // c)
        if rest.upper() <= c:
            return exact + Affine.of(whole)
        split = rest._split(c)
        if split is not None:  # (d*big + small) // c = big // (c/d) with 0 <= small < d
            d, big, _ = split
            return exact + Affine.of(whole) + big.floordiv(c // d)
        return exact + Affine.of(whole) + Affine(((("div", rest, c), 1),))

    def _split(self, c: int):
        """(d, big, small) with self = d*big + small, d a divisor of c above 1 and
        0 <= small < d, the largest such d; None when there is none.  Needed since
        a*(x % n) + a*n*(x // n) recombines to a*x: (6*o + r) // 18 is o // 3 for r < 6."""
        for d in sorted({math.gcd(k, c) for _, k in self.terms} - {1, c}, reverse=True):
            big = Affine(tuple((t, k // d) for t, k in self.terms if k % d == 0), 0)
            small = Affine(tuple((t, k) for t, k in self.terms if k % d), self.const)
            if big.terms and small.const >= 0 and small.upper() <= d:
                return d, big, small
        return None

    def mod(self, c: int) -> "Affine":
        if c == 1:
            return Affine()
        reduced = Affine(tuple((t, k) for t, k in self.terms if k % c), self.const % c)
        if reduced.upper() <= c:
            return reduced
        split = reduced._split(c)
        if split is not None:  # (d*big + small) % c = d*(big % (c/d)) + small
            d, big, small = split
            return big.mod(c // d).scale(d) + small
        return Affine(((("mod", reduced, c), 1),))

    def __str__(self) -> str:
        parts = []
        for term, coeff in self.terms:
            text = _term_str(term)
            parts.append(text if coeff == 1 else f"{coeff}*{text}")
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


def _term_bound(term) -> int:
    if term[0] == "var":
        return term[2]
    kind, inner, c = term
    return -(-inner.upper() // c) if kind == "div" else c


def _term_str(term) -> str:
    if term[0] == "var":
        return term[1]
    kind, inner, c = term
    return f"(({inner}) {'/' if kind == 'div' else '%'} {c})"


STASH = "stash"  # a kernel's per-row scratch buffer


# ---- scalar expressions ----

@dataclass(frozen=True)
class Load:
    param: str
    index: Affine


@dataclass(frozen=True)
class Gather:
    """`value` (its loads indexed by the variable `var`) with `var` set to the row
    number that `row` computes (an integer expression: an embedding's index).  A
    row outside 0..rows-1 is never read: targets clamp it and set the kernel's
    error flag (`ERROR_FLAG`), which the loader turns into an IndexError."""
    value: object
    var: str
    row: object
    rows: int


ERROR_FLAG = "egc_err"  # the int32 flag a kernel with gathers sets when a row is out of range


def loads(e):
    """Every buffer read in a scalar expression (a gather's row and rows included)."""
    if isinstance(e, Load):
        yield e
    elif isinstance(e, Call):
        for a in e.args:
            yield from loads(a)
    elif isinstance(e, Gather):
        yield from loads(e.value)
        yield from loads(e.row)


def out_of_bounds(k: "LoopKernel", numels: dict[str, int]) -> str | None:
    """The first access of a kernel outside its buffer (`numels`: buffer -> elements), or None.
    An index is bounded by its variables' bounds, so each loop variable it uses must be bounded
    by its loop's extent (a variable bounded by a smaller one runs past its bound)."""
    loops = {"o": k.outer, "r": k.inner}
    if k.outer == 0:
        return None  # (nothing runs)
    # (a loop of no rows runs no reduction nor store in the inner loop)
    stores = [s for s in [(k.store_param, k.store_index, k.value, k.store_in_inner)] + list(k.extra_stores)
              if k.inner or not s[3]]
    made = [v for _, _, v, _ in stores] + ([red.body for red in k.reductions] if k.inner else [])
    accesses = [(e.param, e.index) for v in made for e in loads(v)] + [(p, i) for p, i, _, _ in stores]
    for param, index in accesses:
        if param not in numels and param != STASH:
            return f"it reads {param}, which is not one of its parameters"
        short = [(name, bound) for name, bound in _bounded_variables(index) if name in loops and bound < loops[name]]
        if short:
            name, bound = short[0]
            return f"{param}[{index}] takes {name} below {bound}, and the loop runs it to {loops[name]}"
        if param != STASH and index.upper() > numels[param]:
            return f"{param}[{index}] reaches element {index.upper() - 1} of its {numels[param]}"
    return None


def _bounded_variables(index: "Affine"):
    for term, _ in index.terms:
        if term[0] == "var":
            yield term[1], term[2]
        else:
            yield from _bounded_variables(term[1])


def stride(index: "Affine", var: str) -> int:
    """How far apart in memory consecutive values of a loop variable read (0: not at all,
    or only through a division or modulo)."""
    return sum(c for term, c in index.terms if term[0] == "var" and term[1] == var)


def local_stride(index: "Affine", var: str) -> int:
    """As `stride`, counting a modulo of the variable too (`x % 64`: consecutive values lie side
    by side within runs of 64, as a head's dims do in a [batch, heads, seq, dim] tensor read
    with heads and dims merged)."""
    return stride(index, var) + sum(c * stride(term[1], var) for term, c in index.terms
                                    if term[0] == "mod" and len(term[1].terms) == 1)


def variables(index: "Affine") -> set:
    """The loop variables an index uses (inside its divisions and modulos too)."""
    out = set()
    for term, _ in index.terms:
        out |= {term[1]} if term[0] == "var" else variables(term[1])
    return out


def calls(e, op: str):
    """Every call of `op` in a scalar expression, outermost first (not inside a gather)."""
    if isinstance(e, Call):
        if e.op == op:
            yield e
        for a in e.args:
            yield from calls(a, op)


def gathers(e):
    """Every gather in a scalar expression, outermost first."""
    if isinstance(e, Gather):
        yield e
        yield from gathers(e.value)
        yield from gathers(e.row)
    elif isinstance(e, Call):
        for a in e.args:
            yield from gathers(a)


def transposed_reads(k: "LoopKernel") -> bool:
    """A pointwise kernel that reads a matrix across its rows: a load whose consecutive
    inner indices lie far apart and consecutive outer ones side by side (a transpose)."""
    if k.reductions or not k.store_in_inner or any(not s[3] for s in k.extra_stores):
        return False
    values = [k.value] + [s[2] for s in k.extra_stores]
    return any(local_stride(e.index, "o") == 1 and stride(e.index, "r") >= 16 for v in values for e in loads(v)
               if e.param != STASH)


def expressions(k: "LoopKernel") -> list:
    """Every scalar expression a kernel evaluates: its reductions' bodies, then its stores' values."""
    return [red.body for red in k.reductions] + [k.value] + [s[2] for s in k.extra_stores]


def has_gather(k: "LoopKernel") -> bool:
    return any(_has_gather(e) for e in expressions(k))


def _has_gather(e) -> bool:
    return isinstance(e, Gather) or (isinstance(e, Call) and any(_has_gather(a) for a in e.args))


@dataclass(frozen=True)
class Index:
    """A loop index's value (a cat reads one operand or the other by position)."""
    index: Affine


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class Call:
    op: str  # an op-table name (pointwise) or an internal scalar op
    args: tuple
    dtype: str = ""  # the result's dtype (a `cast`'s target); "" or "weak": float32


@dataclass(frozen=True)
class Acc:
    name: str


@dataclass(frozen=True)
class Reduction:
    acc: str
    combiner: str  # sum | max | mean (a sum divided by the loop's length in double: C++ only)
    body: object
    dtype: str = "float32"  # the accumulator's: float32, or int64/int32 for an integer sum or max (exact)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str
    role: str  # in | out


@dataclass
class LoopKernel:
    name: str
    params: list[Param]
    outer: int
    inner: int
    reductions: list[Reduction] = field(default_factory=list)
    store_param: str = ""
    store_index: Affine = field(default_factory=Affine)
    value: object = None
    store_in_inner: bool = True  # False: one store per outer index (a reduction's result)
    # The last reduction also writes its body into a per-row stash (`STASH`), and `value`
    # reads it back there instead of computing it again (softmax: one exp per element).
    stash_last: bool = False
    # horizontally fused siblings: (param, index, value, in_inner) stored beside the main store
    extra_stores: list = field(default_factory=list)

    def __str__(self) -> str:
        params = ", ".join(f"{p.role} {p.name}: {p.dtype}" for p in self.params)
        lines = [f"kernel {self.name}({params}):", f"  for o in 0..{self.outer} (parallel):"]
        for i, red in enumerate(self.reductions):
            stash = (f"  (kept in {STASH}[r])"
                     if self.stash_last and i == len(self.reductions) - 1 else "")
            lines.append(f"    {red.acc} = {red.combiner} over r in 0..{self.inner}: {expr_str(red.body)}{stash}")
        stores = [(self.store_param, self.store_index, self.value, self.store_in_inner)] + self.extra_stores
        inner = [s for s in stores if s[3]]
        if inner:
            lines.append(f"    for r in 0..{self.inner} (vector):")
            lines += [f"      {p}[{i}] = {expr_str(v)}" for p, i, v, _ in inner]
        lines += [f"    {p}[{i}] = {expr_str(v)}" for p, i, v, in_inner in stores if not in_inner]
        return "\n".join(lines)


def expr_str(e) -> str:
    if isinstance(e, Load):
        return f"{e.param}[{e.index}]"
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Index):
        return f"index({e.index})"
    if isinstance(e, Acc):
        return e.name
    if isinstance(e, Gather):
        return f"{expr_str(e.value)} with {e.var} = row({expr_str(e.row)} of {e.rows})"
    return f"{e.op}(" + ", ".join(expr_str(a) for a in e.args) + ")"


def substitute(expr, old, new):
    """`expr` with every occurrence of the subexpression `old` replaced by `new`."""
    if expr == old:
        return new
    if isinstance(expr, Call):
        return Call(expr.op, tuple(substitute(a, old, new) for a in expr.args), expr.dtype)
    if isinstance(expr, Gather):
        return Gather(substitute(expr.value, old, new), expr.var, substitute(expr.row, old, new), expr.rows)
    return expr


def contains(expr, sub) -> bool:
    return expr == sub or (isinstance(expr, Call) and any(contains(a, sub) for a in expr.args)) or (
        isinstance(expr, Gather) and (contains(expr.value, sub) or contains(expr.row, sub)))


def rename_accs(expr, mapping: dict):
    if isinstance(expr, Acc):
        return Acc(mapping.get(expr.name, expr.name))
    if isinstance(expr, Call):
        return Call(expr.op, tuple(rename_accs(a, mapping) for a in expr.args), expr.dtype)
    if isinstance(expr, Gather):
        return Gather(rename_accs(expr.value, mapping), expr.var, rename_accs(expr.row, mapping), expr.rows)
    return expr


def merge_siblings(first: "LoopKernel", second: "LoopKernel") -> "LoopKernel | None":
    """One loop nest computing both kernels: valid whenever the two iterate the
    same (outer, inner) ranges, since each body computes its own indices from
    the loop variables.  None when they do not."""
    if (first.outer, first.inner) != (second.outer, second.inner) or first.stash_last or second.stash_last:
        return None
    offset = len(first.reductions)
    mapping = {r.acc: f"acc{offset + k}" for k, r in enumerate(second.reductions)}
    reductions = first.reductions + [Reduction(mapping[r.acc], r.combiner, rename_accs(r.body, mapping), r.dtype)
                                     for r in second.reductions]
    names = {p.name for p in first.params}
    ins = [p for p in first.params if p.role == "in"] + [p for p in second.params
                                                         if p.role == "in" and p.name not in names]
    outs = [p for p in first.params if p.role == "out"] + [p for p in second.params if p.role == "out"]
    # (every store of the second reads its own accumulators under their new names: its extra stores
    # kept the old ones, so a fused mean's extra store read the first kernel's sum: soak, seed 32002)
    extra = first.extra_stores + [(p, i, rename_accs(v, mapping), inner) for p, i, v, inner in
                                  [(second.store_param, second.store_index, second.value, second.store_in_inner)]
                                  + list(second.extra_stores)]
    return LoopKernel(first.name, ins + outs, first.outer, first.inner, reductions, first.store_param,
                      first.store_index, first.value, first.store_in_inner, False, extra)
