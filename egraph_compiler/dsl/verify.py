"""Numerical verification of rules (`egc rules verify`): sits beside the parser
(parser.py gives Rule objects) and reads only the op table (ops.py), whose
`shape` rules decide whether a random draw is well-formed and whose `reference`
functions give eager torch values.  Both sides of a rule are evaluated on random
instances meeting its conditions (shapes, attributes, dtypes, value profiles
kept inside any declared domain such as `x > 0`) and compared in float64; a
`<=>` rule is checked both ways.  A `const` acts as a Python float would.  Below
float64, each side's own rounding error (against a float64 run) is tolerated too
(compare.py).
"""
from __future__ import annotations

import math
import operator
import random
from dataclasses import dataclass
from functools import reduce

import torch

from .compare import TOLERANCES, Instance, compare, explain
from .evaluate import evaluate, shape_of
from .parser import Arith, Condition, Lit, Query, Rule, Var, collect_vars

SIZES = (1, 2, 3, 5, 8)
FLOATS = (0.5, 2.0, 1e-5, -3.0, 1.0, 0.0)
STRS = ("float32", "float64", "float16", "bfloat16")
PROFILES = ("normal", "edges", "large", "tiny", "spread")
EDGES = (0.0, 1.0, -1.0, 1e4, -1e4, 1e-6, -1e-6, 0.5, -2.0)
VERSION = 2  # bump when a change could turn a verdict: trust.py's cache of passed rules is keyed by it
ATTEMPTS = 1000  # draws per trial before giving up on a well-formed instance
MAX_NUMEL = 100_000
_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
            "!=": operator.ne}


@dataclass
class VerifyResult:
    name: str
    location: str
    passed: bool
    max_error: float  # largest |lhs - rhs|, relative to the output's magnitude where that exceeds 1
    trials: int  # instances that ran
    message: str = ""
    counterexample: str = ""  # a failing instance: inputs (shapes, dtype, leading values), attributes, lhs vs rhs

    def line(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'}  {self.name:<26} max err {self.max_error:.1e}"
        tail = f"  {self.message}" if self.message and not self.passed else ""
        return f"{head}  {self.trials:>3} trials  {self.location}{tail}"


# ---- entry points ----

def verify_rule(rule: Rule, trials: int = 24, seed: int = 0) -> VerifyResult:
    return _verify(rule, trials, seed, domain=True)


def verify_outside_domain(rule: Rule, trials: int = 24, seed: int = 0) -> VerifyResult:
    """As verify_rule, but tensor values ignore the declared domain (`x > 0`)."""
    return _verify(rule, trials, seed, domain=False)


def verify_rules(rules: list, trials: int = 24, seed: int = 0) -> list[VerifyResult]:
    """One result per rewrite rule; `fuse` statements (no equation) are skipped."""
    return [verify_rule(r, trials, seed) for r in rules if isinstance(r, Rule)]


def _verify(rule: Rule, trials: int, seed: int, domain: bool) -> VerifyResult:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    sides = [(rule.lhs, rule.rhs, "")] + ([(rule.rhs, rule.lhs, "right to left: ")] if rule.both_ways else [])
    named = [getattr(torch, name, None) for name in _named(rule, "dtype")]
    dtypes = list(dict.fromkeys([torch.float32, torch.float64] + [d for d in named if d in TOLERANCES]))
    ran, worst, message, last, example = 0, 0.0, "", "", ""
    for t in range(trials):
        pattern, result, tag = sides[t % len(sides)]
        k = t // len(sides)
        dtype, profile = dtypes[k % len(dtypes)], PROFILES[(k // len(dtypes)) % len(PROFILES)]
        inst = _instance(rule, pattern, rng, gen, dtype, profile, domain)
        outcome = compare(inst, result) if isinstance(inst, Instance) else None
        last = inst if isinstance(inst, str) and inst else last
        if outcome is None:
            continue
        ran, (error, what, detail) = ran + 1, outcome
        if what and (not message or error > worst):
            message, example = f"{tag}{what}; worst at {inst.describe()}", tag + detail
        worst = max(worst, error)
    if ran == 0:
        detail = "no well-formed instance found" + (f" (last error: {last})" if last else "")
        return VerifyResult(rule.name, rule.location, False, math.inf, 0, detail)
    return VerifyResult(rule.name, rule.location, not message, worst, ran, message, example)


def _named(rule: Rule, kind: str) -> list:
    """The literals that size() or dtype() conditions compare against: drawn too, so they can hold."""
    return [v.value for c in rule.conditions if isinstance(c.left, Query) and c.left.kind == kind
            for v in c.right if isinstance(v, Lit)]


# ---- drawing an instance ----

def _instance(rule, pattern, rng, gen, dtype, profile, domain):
    """A well-formed instance of `pattern`, or a string (the last error) when none was found."""
    variables = collect_vars(pattern)
    tensor_vars = sorted(n for n, s in variables.items() if s == "tensor")
    attr_vars = {n: s for n, s in sorted(variables.items()) if s != "tensor"}
    matching = [c for c in rule.conditions if not c.is_assumption]
    named = {n + d for n in _named(rule, "size") for d in (-1, 0, 1) if 1 <= n + d <= 64}
    sizes, last = SIZES + tuple(sorted(named - set(SIZES))), ""
    for _ in range(ATTEMPTS):
        shapes = _draw_shapes(tensor_vars, rng, sizes)
        if sum(math.prod(s) for s in shapes.values()) > MAX_NUMEL:
            continue
        attrs = {n: _drawattr_value(n, s, shapes, rule, rng) for n, s in attr_vars.items()}
        var_dtypes = {n: _fixed_dtype(rule, n) or dtype for n in tensor_vars}
        if rng.random() < 0.5:
            shapes = _repair(matching, shapes, attrs, var_dtypes)
        if not all(_holds(c, shapes, attrs, var_dtypes) for c in matching):
            continue
        try:
            shape_of(pattern, shapes, attrs)
        except Exception:  # the op table's shape rule rejects it: draw again
            continue
        tensors = {n: _values(shapes[n], dtype, profile, _domain(rule, n, attrs) if domain else [], gen)
                   if var_dtypes[n] != torch.bool else _mask(shapes[n], gen) for n in tensor_vars}
        if any(v is None for v in tensors.values()):
            continue
        try:
            return Instance(shapes, attrs, tensors, dtype, profile, pattern, evaluate(pattern, tensors, attrs))
        except Exception as exc:  # shape rules can be looser than the reference
            last = explain(exc)
    return last


def _repair(conditions, shapes, attrs, dtypes) -> dict:
    """The draw made to meet the rule's equalities where one assignment can: `rank(x) == n`
    trims x's shape or pads it with 1s, `size(x, d) == value` sets that size (all conditions
    are still checked after): rules whose shapes are tied by arithmetic (grouped heads)
    are rarely drawn well-formed by chance."""
    shapes = dict(shapes)
    for cond in conditions:
        if cond.op != "==" or not isinstance(cond.left, Query) or cond.left.kind == "dtype":
            continue
        value, name = _cond_term(cond.right[0], shapes, attrs, dtypes), cond.left.var.name
        shape = list(shapes[name])
        if not isinstance(value, int) or value < 0 or value > 64:
            continue
        if cond.left.kind == "rank" and value <= 6:
            shapes[name] = tuple(([1] * value + shape)[len(shape):])
        elif cond.left.kind == "size" and -len(shape) <= cond.left.dim < len(shape) and value > 0:
            shape[cond.left.dim] = value
            shapes[name] = tuple(shape)
    return shapes


def _draw_shapes(names, rng, sizes) -> dict:
    base = [rng.choice(sizes) for _ in range(rng.randint(1, 4))]
    return {n: _variant(base, rng, sizes) for n in names}


def _variant(base, rng, sizes) -> tuple:
    """A shape related to `base` (equal, transposed, a suffix, 1s, ...), so operands often fit together."""
    s = list(base)
    if rng.random() < 0.3 and len(s) >= 2:
        s[-1], s[-2] = s[-2], s[-1]
    if rng.random() < 0.2 and len(s) >= 2:
        s = s[:-1]
    if rng.random() < 0.3:
        s = s[rng.randrange(len(s)):]
    if rng.random() < 0.2:
        s = [1 if rng.random() < 0.5 else n for n in s]
    if rng.random() < 0.2 and s:  # a multiple of a size: groups (grouped-query attention's heads)
        i = rng.randrange(len(s))
        s[i] *= rng.choice((2, 3))
    if rng.random() < 0.1:
        s = [rng.choice(sizes) for _ in range(rng.randint(1, 4))]
    return tuple(s)


def _drawattr_value(name, sort, shapes, rule, rng):
    bounds = [(c, v.value) for c in rule.conditions if isinstance(c.left, Var) and c.left.name == name
              for v in c.right if isinstance(v, Lit)]
    named = tuple(value for _, value in bounds)
    if sort == "bool":
        return rng.random() < 0.5
    if sort == "str":
        return rng.choice(STRS + named)
    if sort == "float":
        return rng.choice(FLOATS + named + _inside_bounds([(c.op, [v]) for c, v in bounds if c.op != "in"]))
    rank = max((len(s) for s in shapes.values()), default=1)
    if sort == "int":
        pool = list(range(-rank, rank)) + list(SIZES) + [n for s in shapes.values() for n in s]
        return rng.choice(pool + [v + d for v in named for d in (-1, 0, 1)])
    return _draw_ints(list(shapes.values()) or [(1,)], rank, rng)


def _inside_bounds(domain) -> tuple:
    """Float values strictly inside the bounds that conditions put on an attribute variable."""
    lo, hi = _bounds(domain)
    if math.isfinite(lo) and math.isfinite(hi):
        return ((lo + hi) / 2, lo + (hi - lo) / 4, hi - (hi - lo) / 4)
    if math.isfinite(lo) or math.isfinite(hi):
        edge, sign = (lo, 1) if math.isfinite(lo) else (hi, -1)
        return tuple(edge + sign * d for d in (1.0, 0.5, 3.0, 1e-6))
    return ()


def _draw_ints(shapes, rank, rng) -> tuple:
    shape = list(rng.choice(shapes))
    kind = rng.randrange(3)
    if kind == 0:  # dims to reduce over
        dims = sorted(rng.sample(range(rank), rng.randint(1, rank)))
        return tuple(d - rank if rng.random() < 0.7 else d for d in dims)
    if kind == 1:  # a permutation
        return tuple(rng.sample(range(len(shape)), len(shape)))
    return tuple(_shape_like(shape, rng))


def _shape_like(shape, rng) -> list:
    """A shape with as many elements as `shape` (for reshape), or one it broadcasts to (for expand)."""
    kind = rng.randrange(4)
    if kind == 0:
        return shape[::-1] if rng.random() < 0.5 else shape
    if kind == 1:  # expand: grow size-1 dims, maybe add a leading one
        grown = [rng.choice(SIZES) if n == 1 else n for n in shape]
        return ([rng.choice(SIZES)] if rng.random() < 0.5 else []) + grown
    n, bins = math.prod(shape), [1] * rng.randint(1, 4)  # a random factorisation of the element count
    for p in (2, 3, 5, 7):
        while n % p == 0:
            bins[rng.randrange(len(bins))] *= p
            n //= p
    bins[0] *= n
    return bins


def _fixed_dtype(rule, name):
    """A dtype a `dtype(name) == X` condition fixes to a non-float type (a boolean mask), else None."""
    for c in rule.conditions:
        if isinstance(c.left, Query) and c.left.kind == "dtype" and c.left.var.name == name:
            dtype = getattr(torch, c.right[0].value, None)
            if dtype is not None and not dtype.is_floating_point:
                return dtype
    return None


def _mask(shape, gen):
    """A boolean mask that keeps at least one entry in every row (the last dim),
    the domain of masked-attention rules: a fully masked row is NaN in the
    primitive form but 0 in the library call."""
    keep = torch.rand(shape, generator=gen) > 0.4
    if shape:
        first = torch.zeros(shape, dtype=torch.bool)
        first[..., 0] = True
        keep |= first
    return keep


def _holds(cond: Condition, shapes, attrs, dtypes) -> bool:
    left, right = _cond_term(cond.left, shapes, attrs, dtypes), [_cond_term(r, shapes, attrs, dtypes) for r in cond.right]
    if left is None or None in right:  # size() of a dimension the tensor lacks
        return False
    return left in right if cond.op == "in" else _COMPARE[cond.op](left, right[0])


def _cond_term(term, shapes, attrs, dtypes):
    if isinstance(term, Arith):
        a, b = _cond_term(term.left, shapes, attrs, dtypes), _cond_term(term.right, shapes, attrs, dtypes)
        if a is None or b is None or (term.op == "/" and b == 0):
            return None
        if term.op == "/":
            return a // b if term.sort == "int" else a / b
        return a + b if term.op == "+" else a - b if term.op == "-" else a * b
    if isinstance(term, Query):
        shape = shapes[term.var.name]
        if term.kind == "size":
            return shape[term.dim] if -len(shape) <= term.dim < len(shape) else None
        return len(shape) if term.kind == "rank" else str(dtypes[term.var.name]).removeprefix("torch.")
    return attrs[term.name] if isinstance(term, Var) else term.value


def _domain(rule, name, attrs) -> list:
    """The declared domain of tensor variable `name`: [(op, values)]."""
    return [(c.op, [float(_cond_term(r, {}, attrs, None)) for r in c.right]) for c in rule.conditions
            if c.is_assumption and c.left.name == name]


# ---- tensor values ----

def _values(shape, dtype, profile, domain, gen):
    """Random values of one profile, mapped into the domain; None when the domain cannot be met."""
    x = _into_domain(_profile(shape, profile, gen), domain, gen).to(dtype)
    inside = _inside(x, domain)  # rounding to dtype can step over a bound
    x = torch.where(inside, x, torch.tensor(_interior_value(domain), dtype=torch.float64).to(dtype))
    return x if bool(_inside(x, domain).all()) else None


def _profile(shape, profile, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if profile == "edges":  # zeros, +-1, large, tiny, mixed with normal values
        pick = torch.tensor(EDGES, dtype=torch.float64)[torch.randint(len(EDGES), shape, generator=gen)]
        return torch.where(torch.rand(shape, generator=gen) < 0.6, pick, x)
    if profile == "spread":  # magnitudes from 1e-3 to 1e3
        return x * 10 ** (torch.rand(shape, generator=gen, dtype=torch.float64) * 6 - 3)
    return x * {"large": 1e3, "tiny": 1e-6}.get(profile, 1.0)


def _bounds(domain) -> tuple[float, float]:
    lo = max([v for op, vs in domain if op in (">", ">=") for v in vs], default=-math.inf)
    hi = min([v for op, vs in domain if op in ("<", "<=") for v in vs], default=math.inf)
    return lo, hi


def _into_domain(x, domain, gen):
    for op, values in domain:
        if op in ("==", "in"):
            return torch.tensor(values, dtype=torch.float64)[torch.randint(len(values), x.shape, generator=gen)]
    lo, hi = _bounds(domain)
    if math.isfinite(lo) and math.isfinite(hi):  # small magnitudes near lo, large near hi
        return lo + (hi - lo) * (x.abs() / (1 + x.abs()))
    return lo + x.abs() if math.isfinite(lo) else hi - x.abs() if math.isfinite(hi) else x


def _inside(x, domain) -> torch.Tensor:
    ok = torch.ones(x.shape, dtype=torch.bool)
    for op, values in domain:
        ok &= reduce(operator.or_, [x == v for v in values]) if op == "in" else _COMPARE[op](x, values[0])
    return ok


def _interior_value(domain) -> float:
    """A value well inside the domain, to replace draws that rounding pushed out of it."""
    candidates = [v[0] for op, v in domain if op in ("==", "in")] + list(_inside_bounds(domain)) + [1.0, 2.0, -1.0]
    return next((c for c in candidates if bool(_inside(torch.tensor(c, dtype=torch.float64), domain))), 1.0)
