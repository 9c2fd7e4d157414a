"""Random torch programs as plain data, for differential testing of the compiler.

A program is a list of steps over a list of live values: the inputs first, then
one value per step; each step is a Python expression over earlier values
(`t3 = torch.softmax(t1 * x0, dim=-2)`).  The generator asks a `Drawer` for
every choice, so the same code draws from hypothesis (`programs()`, which
shrinks failures) or from a seeded `random.Random` (`ChoiceDrawer`, used by
`tests/soak.py`, which can replay and shrink a recorded choice list).  Choice 0
(or the low end of a range) is always the simplest option, so shrinking moves
towards small shapes, float32, the most recent operand and simple ops.

    build(program)    -> (fn, example_inputs)   exec of describe()'s source
    describe(program) -> runnable Python source of the program and its inputs
    check(program)    -> Outcome: ok / wrong / crash / error / ill / invalid

`check` compiles with `egc.compile(fn, inputs)`, calls the result twice and
compares it with eager torch (structure, dtypes, shapes; integers and bools
exactly) and its float values with a float64 reference (the same program on
float inputs cast to float64, float64 as torch's default dtype):

    |compiled - ref| <= 1e-4 + 1e-4 |ref| + 4 max(|eager - ref|, |eager' - ref|)

where eager' is eager on the inputs moved by up to two ulps (twice), so that
the tolerance grows with how much float32 rounding alone moves the result.  A
program whose eager float32 result is itself far from float64 (more than
1e-2 |ref| + 1e-3), or overflows, is "ill" (ill-conditioned: skipped), and so
is a mismatch in a program with a float comparison within 1e-4 (relative) of
its threshold in the reference.  Outcomes: ok; wrong (values, structure, a
modified input, a second call that differs); error (an EgraphCompilerError,
by type: these programs should all compile); crash (any other exception);
ill; invalid (a generator bug).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import linecache
import math
import random
import re
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("default", "zero", "int", "multi", "long", "deep")
MAX_NUMEL = 4096  # per value; "long" mode (rows longer than a row kernel's stack stash) allows LONG_NUMEL
LONG_NUMEL = 1 << 17
_limit = MAX_NUMEL  # the limit of the program being generated
MAX_RANK = 4

# comparison margin: a float comparison whose operands (in the float64 reference)
# are closer than this (relative) may flip under a different, equally valid rounding
NEAR = 1e-4
GENERATOR_FAILURES: list = []  # (expr, operand shapes, error): steps the generator had to replace


# ---------------------------------------------------------------- drawing


class Drawer:
    """Every choice the generator makes.  The low end of a range (index 0 of
    a choice list) is the simplest value: shrinking goes there."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq):
        return seq[self.integer(0, len(seq) - 1)]

    def flag(self) -> bool:
        return self.integer(0, 1) == 1

    def recent(self, seq):
        """An element, biased towards the end (most recent value); shrinks to the last."""
        return seq[len(seq) - 1 - self.integer(0, len(seq) - 1)]

    def span(self):
        """Marks the start of a step (lets a shrinker delete whole steps)."""


class HypothesisDrawer(Drawer):
    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo, hi):
        return lo if lo >= hi else self.draw(st.integers(lo, hi))

    def recent(self, seq):
        """Mostly one of the last three values (hypothesis' integers favour the
        ends of a range, which would leave most steps dead)."""
        n = len(seq)
        far = n > 3 and self.flag()
        return seq[n - 1 - self.integer(0, n - 1 if far else min(n, 3) - 1)]


class ChoiceDrawer(Drawer):
    """Replays `prefix` (values clipped to the range asked for), then draws
    from `rng` (or 0, the simplest choice, when there is no rng).  `record`
    is the list of choices actually used; `spans` the start of each step."""

    def __init__(self, prefix=(), rng: random.Random | None = None):
        self.prefix = list(prefix)
        self.rng = rng
        self.record: list[int] = []
        self.spans: list[int] = []
        self._recent = False

    def integer(self, lo, hi):
        if lo >= hi:
            return lo
        i = len(self.record)
        if i < len(self.prefix):
            c = min(max(self.prefix[i], 0), hi - lo)
        elif self.rng is not None:
            c = min(int(self.rng.expovariate(0.35)), hi - lo) if self._recent else self.rng.randint(0, hi - lo)
        else:
            c = 0
        self.record.append(c)
        return lo + c

    def recent(self, seq):
        self._recent = True
        try:
            return super().recent(seq)
        finally:
            self._recent = False

    def span(self):
        self.spans.append(len(self.record))


# ---------------------------------------------------------------- programs


@dataclass(frozen=True)
class Step:
    name: str
    expr: str
    cmp: tuple[str, str] | None = None  # a comparison's (lhs, rhs) expressions

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(re.findall(r"\b([xt]\d+)\b", self.expr)))


@dataclass(frozen=True)
class Program:
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype)
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    out_kind: str  # single | tuple | list | dict
    seed: int
    mode: str = "default"
    fallbacks: int = 0  # steps the generator had to replace (a generator bug if > 0)
    params: tuple[str, ...] | None = None  # the inputs fn takes (None: all; a shrinker drops unused ones)

    def param_names(self) -> tuple[str, ...]:
        return self.params if self.params is not None else tuple(n for n, _, _ in self.inputs)

    def __repr__(self):
        return f"<program {self.mode} seed={self.seed}:\n{describe(self)}>"

    def live_steps(self) -> list[Step]:
        """Steps that an output depends on (the rest is dead code)."""
        need = set(self.outputs)
        keep = []
        for step in reversed(self.steps):
            if step.name in need:
                keep.append(step)
                need.update(step.deps)  # a comparison's operands are part of its expression
        return keep[::-1]


@dataclass
class Val:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rank(self):
        return len(self.shape)

    @property
    def kind(self):
        if self.dtype == torch.bool:
            return "bool"
        return "float" if self.dtype.is_floating_point else "int"


def _fmt(v) -> str:
    return repr(v) if not isinstance(v, tuple) or len(v) != 1 else f"({v[0]!r},)"


def input_source(name, shape, dtype) -> str:
    shape_s = _fmt(tuple(shape))
    if dtype == "float32":
        return f"{name} = torch.rand({shape_s}, generator=g) * 4 - 2"
    if dtype == "float64":
        return f"{name} = torch.rand({shape_s}, generator=g, dtype=torch.float64) * 4 - 2"
    if dtype == "int64":
        return f"{name} = torch.randint(-5, 6, {shape_s}, generator=g)"
    if dtype == "int64:big":  # neighbours that float32 cannot tell apart (it rounds past 2**24)
        return f"{name} = torch.randint(-5, 6, {shape_s}, generator=g) + 2 ** 40"
    if dtype == "bool":
        return f"{name} = torch.rand({shape_s}, generator=g) > 0.5"
    raise ValueError(dtype)


def make_inputs(inputs, seed) -> list[torch.Tensor]:
    env = {"torch": torch, "g": torch.Generator().manual_seed(seed)}
    for name, shape, dtype in inputs:
        exec(input_source(name, shape, dtype), env)
    return [env[name] for name, _, _ in inputs]


class _Ctx:
    def __init__(self, d: Drawer, mode: str, sizes, env):
        self.d, self.mode, self.sizes, self.env = d, mode, sizes, env
        self.live: list[Val] = []
        self.steps: list[Step] = []
        self.fallbacks = 0
        self._meta: dict[str, tuple] = {}  # name -> (value, its meta tensor): _too_big converts each value once

    def emit(self, expr: str, fallback: Val, cmp=None, tentative: bool = False) -> Val | None:
        """Evaluates the step now (eager semantics decide its shape and dtype).
        A tentative step that torch rejects is not a generator bug: None."""
        name = f"t{len(self.steps)}"
        if self._attention_unrunnable(expr) or self._too_big(expr):  # sized on meta tensors, before it runs
            if tentative:
                return None
            expr, cmp = f"{fallback.name}.clone()", None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = eval(expr, {"torch": torch, "F": F}, self.env)
            ok = isinstance(value, torch.Tensor)
        except Exception as exc:  # noqa: BLE001 - a generator bug; counted, and the step replaced
            ok, value = False, exc
        if tentative and not (ok and value.dim() <= MAX_RANK and value.numel() <= _limit):
            return None
        if ok and (value.dim() > MAX_RANK or value.numel() > _limit):  # too big: not a bug, just replaced
            expr, cmp = f"{fallback.name}.clone()", None
            value = self.env[fallback.name].clone()
        elif not ok:
            GENERATOR_FAILURES.append((expr, {k: (tuple(v.shape), v.dtype) for k, v in self.env.items()
                                              if re.search(rf"\b{k}\b", expr)}, repr(value)[:200]))
            self.fallbacks += 1
            expr, cmp = f"{fallback.name}.clone()", None
            value = self.env[fallback.name].clone()
        self.env[name] = value
        self.steps.append(Step(name, expr, cmp))
        val = Val(name, tuple(value.shape), value.dtype)
        self.live.append(val)
        return val

    def _too_big(self, expr: str) -> bool:
        """The step, run on meta tensors: is its result, or any value inside it
        (`(a @ b.mT) @ c` builds a score matrix nobody returns), over the limit?"""
        meta = {k: self._as_meta(k, self.env[k]) for k in set(re.findall(r"\w+", expr)) if k in self.env}
        sizes = _LargestValue()
        try:
            with warnings.catch_warnings(), sizes:
                warnings.simplefilter("ignore")
                value = eval(expr, {"torch": torch, "F": F}, meta)
        except Exception:  # noqa: BLE001 - no meta kernel, or data-dependent: the real run decides
            return False
        return sizes.largest > _limit or (isinstance(value, torch.Tensor) and value.dim() > MAX_RANK)

    def _as_meta(self, name: str, value):
        if not isinstance(value, torch.Tensor):
            return value
        cached = self._meta.get(name)
        if cached is None or cached[0] is not value:
            cached = self._meta[name] = (value, value.to("meta"))
        return cached[1]

    def _attention_unrunnable(self, expr: str) -> bool:
        """Attention whose scores would be over the limit, or over empty tensors (eager torch 2.11's
        CPU sdpa dies of SIGFPE on some of those under some thread counts: the soak's only crashes,
        in the eager run, before any compile; empty attention has its own regression tests), or
        with fewer keys than values (soak 9501, on CUDA: eager's CPU answer is no answer)."""
        m = re.search(r"scaled_dot_product_attention\((\w+), (\w+), (\w+)", expr)
        if m is None or not all(g in self.env for g in m.groups()):
            return False
        q, k, v = (self.env[g] for g in m.groups())
        if any(self.env[g].numel() == 0 for g in m.groups()):
            return True
        if k.dim() > 1 and v.dim() > 1 and k.shape[-2] != v.shape[-2]:  # as many keys as values: torch's
            return True  # CPU kernel does not check it (and gives a meaningless number), CUDA's refuse it
        rows = math.prod(q.shape[:-1]) if q.dim() > 1 else 1
        return rows * (k.shape[-2] if k.dim() > 1 else 1) > _limit

    def partner(self, pred) -> Val | None:
        cands = [v for v in self.live if pred(v)]
        return self.d.recent(cands) if cands else None

    def size(self) -> int:
        """A size to expand a dim to: one of the program's sizes."""
        return self.d.choice(sorted(set(self.sizes) - ({0} if self.mode != "zero" else set())) or [1])


class _LargestValue(TorchDispatchMode):
    """The most elements of any tensor an op produces while it is active."""
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _broadcasts(a: Val, b: Val) -> bool:
    return _broadcast_fits(tuple(a.shape), tuple(b.shape), _limit)


@functools.lru_cache(maxsize=65536)  # generation asks about the same pairs of shapes many times over
def _broadcast_fits(a: tuple, b: tuple, limit: int) -> bool:
    try:
        shape = torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return len(shape) <= MAX_RANK and math.prod(shape) <= limit


def _dim(d: Drawer, rank: int) -> int:
    """A dim of a tensor of `rank`, spelt negative or positive; -1 is simplest."""
    return d.choice([-i for i in range(1, rank + 1)] + list(range(rank)))


def _dims(d: Drawer, rank: int):
    """One dim, a tuple of two, or None (all dims)."""
    form = d.choice(["one", "two", "one", "all"]) if rank >= 2 else d.choice(["one", "all"])
    if form == "one":
        return _dim(d, rank)
    if form == "all":
        return None
    a = _dim(d, rank)
    rest = [x for x in [-i for i in range(1, rank + 1)] + list(range(rank)) if x % rank != a % rank]
    return (a, d.choice(rest))


def _norm(dims, rank):
    if dims is None:
        return set(range(rank))
    return {x % rank for x in (dims if isinstance(dims, tuple) else (dims,))}


CONSTS = [0.5, 2.0, -1.5, 3.0, 0.1, -0.25]
UNARY_FLOAT = [
    "torch.tanh({x})", "torch.cos({x})", "torch.sin({x}) * 2", "torch.sigmoid({x})", "torch.relu({x})", "{x}.abs()", "-{x}",
    "torch.exp({x}.clamp(-6.0, 3.0))", "torch.exp(3.0 - torch.relu(3.0 - {x}))",
    "torch.sqrt({x}.abs() + {eps})", "torch.log({x}.abs() + 1.0)", "torch.erf({x})", "F.gelu({x})",
    "F.gelu({x}, approximate='tanh')", "F.silu({x})", "torch.rsqrt({x}.abs() + 0.5)",
    "{x} * {c}", "{x} + {c}", "{c} - {x}", "{x} / {c}", "{x} ** 2", "{x} ** 3", "({x}.abs() + 0.5) ** {p}",
    "torch.pow(2.0, torch.tanh({x}))", "{x}.clamp(min={c})", "torch.sigmoid({x}) * {x}",
    "{x}.clamp(-1.5, 0.5)", "{x}.clamp(max={c})", "torch.ceil({x} * 2)", "torch.square({x})",
]
BINARY_FLOAT = ["{x} + {y}", "{x} - {y}", "{x} * {y}", "{x} / ({y}.abs() + 1.0)", "torch.maximum({x}, {y})",
                "{y} - {x}", "({x}.abs() + 0.5) ** torch.tanh({y})"]
COMPARE = [">", ">=", "<", "<=", "==", "!="]


def _unary(c: _Ctx, x: Val):
    t = c.d.choice(UNARY_FLOAT)
    expr = t.format(x=x.name, c=c.d.choice(CONSTS), eps=c.d.choice([0.1, 0.5, 0.01]),
                    p=c.d.choice([0.5, -1.0, 1.5, -0.5, 2.0]))
    c.emit(expr, x)


def _binary(c: _Ctx, x: Val):
    how = c.d.choice(["value", "scalar", "self"])
    y = c.partner(lambda v: v.kind != "bool" and _broadcasts(x, v)) if how == "value" else x
    if how == "scalar" or y is None:
        if c.d.flag():
            return c.emit(c.d.choice(["{x} + {c}", "{x} * {c}", "{x} - {c}", "{c} - {x}"]).format(
                x=x.name, c=c.d.choice(CONSTS)), x)
        return c.emit(f"{x.name}.clamp(min={c.d.choice(CONSTS)})", x)
    c.emit(c.d.choice(BINARY_FLOAT).format(x=x.name, y=y.name), x)


def _compare(c: _Ctx, x: Val) -> Val:
    op = c.d.choice(COMPARE)
    if x.kind == "bool":
        y = c.partner(lambda v: v.kind == "bool" and _broadcasts(x, v)) or x
        rhs = y.name
    else:
        how = c.d.choice(["scalar", "value", "amax"])
        y = c.partner(lambda v: v.kind != "bool" and _broadcasts(x, v)) if how == "value" else None
        if y is not None:
            rhs = y.name
        elif how == "amax" and x.rank >= 1 and x.shape[-1] > 0:
            rhs = f"{x.name}.amax({c.d.choice([-1, x.rank - 1])}, keepdim=True)"
            op = c.d.choice(["==", ">=", "<"])
        else:
            rhs = repr(c.d.choice([0.0, 0.5, -0.5, 1.0] if x.kind == "float" else [0, 1, -2, 3]))
    return c.emit(f"{x.name} {op} {rhs}", x, cmp=(x.name, rhs))


def _where(c: _Ctx, x: Val):
    if x.kind == "bool":
        cond, a = x, c.partner(lambda v: v.kind != "bool" and _broadcasts(x, v))
        a_name = a.name if a is not None and c.d.flag() else repr(c.d.choice([1.0, 0.5, -2.0]))
        x = a if a is not None and a_name == a.name else x
    else:
        cond = c.partner(lambda v: v.kind == "bool" and _broadcasts(x, v))
        if cond is None or c.d.flag():
            cond = _compare(c, x)
        a, a_name = x, x.name
    b = c.partner(lambda v: v.kind != "bool" and _broadcasts(cond, v) and _broadcasts(x, v)
                  and (a_name != getattr(a, "name", None) or _broadcasts(a, v)))
    b_name = b.name if b is not None and c.d.flag() else repr(c.d.choice([0.0, -1.0, 2.5]))
    c.emit(f"torch.where({cond.name}, {a_name}, {b_name})", x)


def _bool_arith(c: _Ctx, x: Val):
    """Arithmetic on bools, as torch defines it: + is a logical or, * an and (both targets' own
    + carried, and Triton's int1 wrapped: TESTING.md, nineteenth session), and the logical ops."""
    y = c.partner(lambda v: v.kind == "bool" and _broadcasts(x, v)) or x
    c.emit(c.d.choice(["{x} + {y}", "{x} * {y}", "{x} | {y}", "{x} ^ {y}", "~{x}", "({x} + True) * {y}"])
           .format(x=x.name, y=y.name), x)


def _mask_mul(c: _Ctx, x: Val):
    m = c.partner(lambda v: v.kind == "bool" and _broadcasts(x, v))
    if m is None:
        return _unary(c, x) if x.kind == "float" else _int_arith(c, x)
    c.emit(f"{x.name} * {m.name}", x)


def _reduce(c: _Ctx, x: Val):
    if x.rank == 0:
        return _unary(c, x) if x.kind == "float" else c.emit(f"{x.name}.float()", x)
    ops = ["sum", "mean", "amax"] if x.kind == "float" else ["sum", "amax"]
    op = c.d.choice(ops)
    dims = _dims(c.d, x.rank)
    keep = c.d.flag()
    if op == "amax" and any(x.shape[i] == 0 for i in _norm(dims, x.rank)):
        op = "sum"  # torch: amax over a size-0 dim has no identity
    if dims is None and not keep:
        expr = f"{x.name}.{op}()"
    elif dims is None:
        expr = f"{x.name}.{op}(dim={tuple(range(x.rank))}, keepdim=True)"
    else:
        spelling = c.d.choice(["method", "function"])
        if spelling == "method":
            expr = f"{x.name}.{op}({dims!r}{', keepdim=True' if keep else ''})"
        else:
            expr = f"torch.{op}({x.name}, dim={dims!r}, keepdim={keep})"
    c.emit(expr, x)


def _view(c: _Ctx, x: Val):
    r, s = x.rank, x.shape
    kinds = ["transpose", "permute", "t", "reshape", "slice", "expand", "unsqueeze", "squeeze", "contiguous",
             "select", "split_heads", "merge_heads", "flatten"]
    ok = {"transpose": r >= 2, "permute": r >= 2, "t": r == 2, "reshape": r >= 1,
          "slice": any(n >= 2 for n in s), "expand": (1 in s) or r < MAX_RANK, "unsqueeze": r < MAX_RANK,
          "squeeze": 1 in s, "contiguous": True, "select": any(n >= 1 for n in s),
          "split_heads": r == 3 and s[-1] >= 2 and s[-1] % 2 == 0, "merge_heads": r == 4, "flatten": r >= 2}
    kind = c.d.choice([k for k in kinds if ok[k]])
    n = x.name
    if kind == "transpose":
        a = _dim(c.d, r)
        b = c.d.choice([d for d in [-i for i in range(1, r + 1)] + list(range(r)) if d % r != a % r])
        expr = f"{n}.transpose({a}, {b})"
    elif kind == "permute":
        rest, perm = list(range(r)), []
        while rest:
            perm.append(rest.pop(len(rest) - 1 - c.d.integer(0, len(rest) - 1)))
        expr = f"{n}.permute{tuple(perm)!r}"
    elif kind == "t":
        expr = f"{n}.t()"
    elif kind == "reshape":
        form = c.d.choice(["merge", "split", "all"])
        if form == "merge" and r >= 2:
            i = c.d.integer(0, r - 2)
            shape = s[:i] + (s[i] * s[i + 1],) + s[i + 2:]
        elif form == "split" and r < MAX_RANK and any(m % 2 == 0 and m >= 2 for m in s):
            i = c.d.choice([k for k, m in enumerate(s) if m % 2 == 0 and m >= 2])
            shape = s[:i] + (2, s[i] // 2) + s[i + 1:]
        else:
            shape = (-1,)
        if shape != (-1,) and 0 not in s and c.d.flag():  # a -1 for one dim
            j = c.d.integer(0, len(shape) - 1)
            shape = shape[:j] + (-1,) + shape[j + 1:] if shape[j] != 0 else shape
        expr = f"{n}.reshape{_fmt(shape) if len(shape) > 1 else f'({shape[0]},)'}"
    elif kind == "flatten":
        i = c.d.integer(0, r - 2)
        j = c.d.integer(i + 1, r - 1)
        expr = f"{n}.flatten({i}, {j})"
    elif kind == "slice":
        i = c.d.choice([k for k, m in enumerate(s) if m >= 2])
        start, step = c.d.choice([0, 1]), c.d.choice([2, 1, 3])
        end = c.d.choice(["", str(s[i] - 1)])
        if (start, step, end) == (0, 1, ""):
            start = 1
        lead = ":, " * i if c.d.flag() or i == r - 1 else ""
        idx = f"{start}:{end}:{step}" if step != 1 else f"{start}:{end}"
        if lead or i == 0:
            expr = f"{n}[{lead}{idx}]"
        else:
            expr = f"{n}[..., {idx}{', :' * (r - 1 - i)}]"
    elif kind == "expand":
        ones = [k for k, m in enumerate(s) if m == 1]
        if ones and (r >= MAX_RANK or c.d.flag()):
            shape = list(s)
            for k in ones:
                if c.d.flag() or k == ones[-1]:
                    shape[k] = c.size()
            shape = tuple(-1 if (m == s[k] and c.d.flag()) else m for k, m in enumerate(shape))
        else:
            shape = (c.size(),) + s
        expr = f"{n}.expand{_fmt(tuple(shape)) if len(shape) != 1 else f'({shape[0]},)'}"
    elif kind == "unsqueeze":
        expr = f"{n}.unsqueeze({c.d.choice([0, -1] + list(range(1, r + 1)) + [-i for i in range(2, r + 2)])})"
    elif kind == "squeeze":
        k = c.d.choice([k for k, m in enumerate(s) if m == 1])
        expr = f"{n}.squeeze({c.d.choice([k, k - r])})"
    elif kind == "contiguous":
        expr = f"{n}.contiguous()" if r < 2 or c.d.flag() else f"{n}.transpose(0, -1).contiguous()"
    elif kind == "select":
        i = c.d.choice([k for k, m in enumerate(s) if m >= 1])
        expr = f"{n}.select({c.d.choice([i, i - r])}, {c.d.choice([0, s[i] - 1])})"
    elif kind == "split_heads":
        expr = f"{n}.unflatten(-1, (2, {s[-1] // 2})).transpose(1, 2)"
    else:
        expr = f"{n}.transpose(1, 2).flatten(2)"
    c.emit(expr, x)


def _row(c: _Ctx, x: Val):
    if x.rank == 0:
        return _unary(c, x)
    op = c.d.choice(["softmax", "log_softmax", "layer_norm", "rms_norm"])
    n = x.name
    if op in ("softmax", "log_softmax"):
        fn = c.d.choice([f"torch.{op}", f"F.{op}"])
        return c.emit(f"{fn}({n}, dim={_dim(c.d, x.rank)})", x)
    last = x.shape[-1]
    two = x.rank >= 2 and c.d.integer(0, 3) == 3
    nshape = x.shape[-2:] if two else (last,)
    w = c.partner(lambda v: v.shape == nshape and v.dtype == x.dtype) if c.d.flag() else None
    if op == "layer_norm":
        b = c.partner(lambda v: v.shape == nshape and v.dtype == x.dtype) if c.d.flag() else None
        args = f", {w.name if w else 'None'}, {b.name}" if b else (f", {w.name}" if w else "")
        eps = c.d.choice(["", ", eps=1e-6", ", eps=0.1"])
        return c.emit(f"F.layer_norm({n}, {_fmt(tuple(nshape))}{args}{eps})", x)
    eps = c.d.choice(["", ", eps=1e-6", ", eps=1e-5"])
    return c.emit(f"F.rms_norm({n}, {_fmt(tuple(nshape))}{', ' + w.name if w else ''}{eps})", x)


def _library(c: _Ctx, x: Val):
    if x.rank == 0:
        return _unary(c, x)
    op = c.d.choice(["matmul", "linear", "sdpa"])
    n, k = x.name, x.shape[-1]
    if op == "sdpa" and (x.rank == 4 or (x.rank == 3 and k % 2 == 0 and k >= 2)):
        if x.rank == 3:
            x = c.emit(f"{n}.unflatten(-1, (2, {k // 2})).transpose(1, 2)", x)
            if c.d.flag():  # (an elementwise kernel of the heads' view, as a rotary q: orders.py stores it permuted)
                x = c.emit(f"torch.tanh({x.name}) * 2", x)
        q = x
        kk = c.partner(lambda v: v.rank == 4 and v.dtype == q.dtype and v.shape[:2] == q.shape[:2]
                       and v.shape[-1] == q.shape[-1] and v.shape[-2] > 0
                       and math.prod(q.shape[:-1]) * v.shape[-2] <= _limit) or q
        if math.prod(q.shape[:-1]) * kk.shape[-2] > _limit:  # the scores would be too big
            return _unary(c, q)
        vv = c.partner(lambda v: v.rank == 4 and v.dtype == q.dtype and v.shape[:2] == q.shape[:2]
                       and v.shape[-2] == kk.shape[-2]) or kk
        extra = c.d.choice(["", ", is_causal=True", ", attn_mask=MASK", ", scale=0.5", ", is_causal=True, scale=0.3",
                            ", enable_gqa=True"])
        if "gqa" in extra:  # grouped-query attention: k and v keep every other head of theirs
            if q.shape[1] % 2 or kk.shape[1] != q.shape[1]:
                extra = ""
            else:
                kk = c.emit(f"{kk.name}[:, ::2]", kk)
                vv = c.emit(f"{vv.name}[:, ::2]", vv)
        if "MASK" in extra:
            scores = Val("", q.shape[:-1] + (kk.shape[-2],), q.dtype)
            m = c.partner(lambda v: v.kind != "int" and (v.dtype == torch.bool or v.dtype == q.dtype)
                          and v.rank >= 2 and _broadcasts(v, scores)
                          and torch.broadcast_shapes(v.shape, scores.shape) == scores.shape)
            extra = f", attn_mask={m.name}" if m is not None else ""
        return c.emit(f"F.scaled_dot_product_attention({q.name}, {kk.name}, {vv.name}{extra})", q)
    if op == "linear":
        w = c.partner(lambda v: v.rank == 2 and v.shape[-1] == k and v.dtype == x.dtype)
        if w is None and x.rank == 2:
            w = x
        if w is not None:
            b = c.partner(lambda v: v.shape == (w.shape[0],) and v.dtype == x.dtype) if c.d.flag() else None
            return c.emit(f"F.linear({n}, {w.name}{', ' + b.name if b else ''})", x)

    def fits(v):  # x @ v
        if v.dtype != x.dtype or v.rank == 0:
            return False
        if x.rank == 1:
            return v.rank >= 2 and v.shape[-2] == k and math.prod(v.shape) <= _limit
        if v.rank == 1:
            return v.shape[0] == k
        if v.shape[-2] != k:
            return False
        try:
            batch = torch.broadcast_shapes(x.shape[:-2], v.shape[:-2])
        except RuntimeError:
            return False
        return len(batch) + 2 <= MAX_RANK and math.prod(batch) * x.shape[-2] * v.shape[-1] <= _limit
    y = c.partner(fits) if c.d.flag() or x.rank < 2 else None
    if y is not None:
        forms = ["{x} @ {y}", "torch.matmul({x}, {y})"]
        if x.rank == 2 and y.rank == 2:
            forms.append("torch.mm({x}, {y})")
            b = c.partner(lambda v: v.dtype == x.dtype and _broadcasts(v, Val("", (x.shape[0], y.shape[1]), x.dtype))
                          and torch.broadcast_shapes(v.shape, (x.shape[0], y.shape[1])) == (x.shape[0], y.shape[1]))
            if b is not None:
                forms.append(f"torch.addmm({b.name}, {{x}}, {{y}})")
        if x.rank == 3 and y.rank == 3 and x.shape[0] == y.shape[0]:
            forms.append("torch.bmm({x}, {y})")
        return c.emit(c.d.choice(forms).format(x=n, y=y.name), x)
    if x.rank == 1:
        return c.emit(f"{n} @ {n}", x)
    forms = [f for f, m in [("{x} @ {x}.transpose(-1, -2)", x.shape[-2]), ("{x}.transpose(-1, -2) @ {x}", k),
                            ("{x}.mT @ {x}", k)] if math.prod(x.shape[:-2]) * m * m <= _limit]
    if not forms:
        return _unary(c, x)
    return c.emit(c.d.choice(forms).format(x=n), x)


def _aten(c: _Ctx, x: Val):
    """Ops outside the vocabulary (ATen fallbacks between generated kernels) and
    forms capture splits into views (split, chunk, squeeze of every size-1 dim)."""
    n, r = x.name, x.rank
    if r == 0:
        return c.emit(f"torch.sin({n})", x)
    d = _dim(c.d, r)
    form = c.d.choice(["cat", "flip", "cumsum", "minimum", "split", "chunk", "squeeze_all", "sin", "reciprocal",
                       "stack", "index_list", "greater"])
    if form == "stack":  # (GPT-J's rotary halves)
        return c.emit(f"torch.stack(({n}, -{n}), dim={d})", x)
    if form == "index_list" and x.shape[d % r] >= 1:  # (Falcon's qkv[..., [-2], :])
        k = c.d.integer(0, x.shape[d % r] - 1)
        return c.emit(f"{n}[{':, ' * (d % r)}[{k}, -1]]", x)
    if form == "greater":
        return c.emit(f"torch.greater({n}, {c.d.choice(CONSTS)})", x)
    if form == "cat":
        y = c.partner(lambda v: v.dtype == x.dtype and v.rank == r
                      and all(a == b for k, (a, b) in enumerate(zip(v.shape, x.shape)) if k != d % r)) or x
        return c.emit(f"torch.cat(({n}, {y.name}), dim={d})", x)
    if form == "flip":
        return c.emit(f"torch.flip({n}, ({d},))", x)
    if form == "cumsum":
        return c.emit(f"torch.cumsum({n}, dim={d})", x)
    if form == "minimum":
        y = c.partner(lambda v: v.kind == "float" and _broadcasts(x, v)) or x
        return c.emit(f"torch.minimum({n}, {y.name})", x)
    if form in ("split", "chunk") and x.shape[d] >= 2:
        k = c.d.integer(1, x.shape[d] - 1)
        if form == "split":
            return c.emit(f"{n}.split({k}, dim={d})[{c.d.choice([0, -1])}]", x)
        return c.emit(f"{n}.chunk(2, dim={d})[{c.d.choice([0, -1])}]", x)
    if form == "squeeze_all":
        return c.emit(f"{n}.squeeze()", x)
    if form == "reciprocal":
        return c.emit(f"torch.reciprocal({n}.abs() + 0.5)", x)
    return c.emit(f"torch.sin({n})", x)


_RULES: list = []


def library_rules() -> list:
    """The compiler's rule library (rules with a left side), by name."""
    if not _RULES:
        from egraph_compiler.dsl.library import library_rules as rules
        _RULES.extend(sorted((r for r in rules() if hasattr(r, "lhs")), key=lambda r: r.name))
    return _RULES


RENDER = {  # {k}: a tensor operand's expression; {k!r}: an attribute's value
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "pow": "torch.pow({0}, {1})", "matmul": "({0} @ {1})", "neg": "(-{0})", "where": "torch.where({0}, {1}, {2})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "lt": "({0} < {1})", "le": "({0} <= {1})", "eq": "({0} == {1})",
    "ne": "({0} != {1})", "silu": "F.silu({0})", "gelu": "F.gelu({0})", "gelu_tanh": "F.gelu({0}, approximate='tanh')",
    "maximum": "torch.maximum({0}, torch.as_tensor({1}))",
    "sum": "torch.sum({0}, dim={1!r}, keepdim={2!r})", "mean": "torch.mean({0}, dim={1!r}, keepdim={2!r})",
    "amax": "torch.amax({0}, dim={1!r}, keepdim={2!r})", "transpose": "{0}.transpose({1!r}, {2!r})",
    "permute": "{0}.permute({1!r})", "reshape": "{0}.reshape({1!r})", "expand": "{0}.expand({1!r})",
    "softmax": "torch.softmax({0}, dim={1!r})", "log_softmax": "torch.log_softmax({0}, dim={1!r})",
    "cast": "{0}.to(torch.{1})", "linear": "F.linear({0}, {1}, {2})",
    "layer_norm": "F.layer_norm({0}, {0}.shape[-{3!r}:], {1}, {2}, eps={4!r})",
    "rms_norm": "F.rms_norm({0}, {0}.shape[-{2!r}:], {1}, eps={3!r})",
    "sdpa": "F.scaled_dot_product_attention({0}, {1}, {2}, scale={3!r}, is_causal={4!r})",
    "sdpa_mask": "F.scaled_dot_product_attention({0}, {1}, {2}, attn_mask={3}, scale={4!r}, is_causal={5!r})",
}
DOMAIN_OPS = {"log", "sqrt", "rsqrt", "pow", "div"}  # patterns with these bind tensors to positive values
NORM_OPERANDS = {("layer_norm", 1), ("layer_norm", 2), ("rms_norm", 1), ("linear", 2)}  # 1-D, the last dim's size


def _float_for(var, conditions, d: Drawer) -> float:
    """A value of a float attribute meeting the rule's conditions on it (so that the rule can fire)."""
    lo, hi, eq, ne = -math.inf, math.inf, None, set()
    for cond in conditions:
        if getattr(cond.left, "name", None) != var or not hasattr(cond.right[0], "value"):
            continue
        v = cond.right[0].value
        if cond.op in (">", ">="):
            lo = max(lo, v)
        elif cond.op in ("<", "<="):
            hi = min(hi, v)
        elif cond.op == "==":
            eq = v
        elif cond.op == "!=":
            ne.add(v)
    if eq is not None:
        return float(eq)
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2
    ok = [v for v in CONSTS + [1e-5, 1.0] if lo < v < hi and v not in ne]
    return d.choice(ok) if ok else (lo + 1.0 if math.isfinite(lo) else hi - 1.0)


def _is_tensor(term) -> bool:
    from egraph_compiler.dsl.terms import Pat
    return isinstance(term, Pat) or getattr(term, "sort", None) == "tensor"


def _render(term, b: dict) -> str:
    """A rule side (a tensor term) as a torch expression; `b` binds its variables
    (tensors to value names, attributes to values)."""
    from egraph_compiler.dsl.terms import Lit, Pat, Var
    if isinstance(term, Var):
        return b[term.name]
    if isinstance(term, Lit):  # a scalar constant
        v = float(term.value)
        return f"float('{v}')" if not math.isfinite(v) else repr(v)
    assert isinstance(term, Pat), term
    if term.op == "const":
        return repr(float(_arith(term.args[0], b)))
    args = [_render(a, b) if _is_tensor(a) else _arith(a, b) for a in term.args]
    if term.op == "where" and args[0] in b["__cond__"]:
        args[0] = b["__cond__"][args[0]]
    if term.op in ("layer_norm", "rms_norm", "linear"):  # 1.0 and 0.0: no weight, no bias
        args = [None if (op_k in NORM_OPERANDS and a in ("1.0", "0.0")) else a
                for op_k, a in zip(((term.op, k) for k in range(len(args))), args)]
        if term.op == "linear" and args[2] is None:
            return f"F.linear({args[0]}, {args[1]})"
    return RENDER[term.op].format(*args) if term.op in RENDER else f"torch.{term.op}({', '.join(args)})"


def _arith(term, b: dict):
    from egraph_compiler.dsl.terms import Arith, Lit, Var
    if isinstance(term, tuple):  # a list of ints, some of them variables
        return tuple(_arith(t, b) for t in term)
    if isinstance(term, Var):
        return b[term.name]
    if isinstance(term, Lit):
        return term.value
    assert isinstance(term, Arith), term
    left, right = _arith(term.left, b), _arith(term.right, b)
    return {"+": left + right, "-": left - right, "*": left * right,
            "/": left / right if right else math.inf}[term.op]


def _variables(term, out: dict, under=None):
    from egraph_compiler.dsl.terms import Arith, Pat, Var
    if isinstance(term, Var):
        out.setdefault(term.name, (term.sort, under))
    elif isinstance(term, Pat):
        for k, a in enumerate(term.args):
            _variables(a, out, (term.op, k))
    elif isinstance(term, Arith):
        _variables(term.left, out, under)
        _variables(term.right, out, under)
    elif isinstance(term, tuple):
        for t in term:
            _variables(t, out, under)
    return out


def _rule(c: _Ctx, x: Val):
    """One side of a rule of the compiler's library, its variables bound to live
    values: the patterns the rules rewrite, and the forms they rewrite to, far
    more often than independent random steps would meet them."""
    from egraph_compiler.dsl.terms import Pat
    rule = c.d.choice(library_rules())
    side = rule.lhs if not isinstance(rule.rhs, Pat) or not c.d.flag() else rule.rhs
    names = _variables(side, {})
    positive = bool(DOMAIN_OPS & set(re.findall(r"op='(\w+)'", repr(side))))
    for attempt in ("drawn", "same"):
        b: dict = {"__cond__": {}}
        first = None
        for var, (sort, under) in names.items():
            if sort == "tensor" and under in NORM_OPERANDS and first is not None:  # a weight or bias
                w = c.partner(lambda v: v.dtype == x.dtype and v.shape == first.shape[-1:])
                b[var] = w.name if w is not None else "1.0" if under[1] == 1 and under[0] != "linear" else "0.0"
            elif sort == "tensor":
                v = x if attempt == "same" else c.partner(lambda v: v.kind == "float" and v.dtype == x.dtype) or x
                first = first or v
                if under == ("where", 0):
                    b["__cond__"][v.name] = f"({v.name} > 0)"
                b[var] = v.name
            elif sort == "float":
                b[var] = _float_for(var, rule.conditions, c.d)
            elif sort == "int":
                b[var] = c.d.choice([-1, -2, 0, 1])
            elif sort == "bool":
                b[var] = c.d.flag()
            elif sort == "ints":
                b[var] = c.d.choice([(-1,), (1, -1), (-1, 2)])
            else:
                b[var] = "float32"
        if positive:  # log, sqrt, pow and division stay in their domain
            made: dict = {}
            for var, (sort, _) in names.items():
                if sort == "tensor" and b[var] in c.env:
                    if b[var] not in made:
                        made[b[var]] = c.emit(f"{b[var]}.abs() + 0.5", x, tentative=True)
                    b[var] = made[b[var]].name if made[b[var]] is not None else b[var]
        try:
            expr = _render(side, b)
        except Exception:  # noqa: BLE001 - a form this renderer does not know: an ordinary step instead
            break
        if c.emit(expr, x, tentative=True) is not None:
            return
    _unary(c, x)


def _cast(c: _Ctx, x: Val):
    if x.kind == "bool":
        return c.emit(f"{x.name}.{c.d.choice(['float', 'long'])}()", x)
    if x.dtype == torch.float32:
        return c.emit(f"{x.name}.double()", x)
    c.emit(f"{x.name}.float()", x)


def _int_arith(c: _Ctx, x: Val):
    form = c.d.choice(["scalar", "value", "unary", "float_scalar"])
    n = x.name
    if form == "value":
        y = c.partner(lambda v: v.kind == "int" and _broadcasts(x, v))
        if y is not None:
            t = c.d.choice(["{x} + {y}", "{x} * {y}", "{x} - {y}", "torch.maximum({x}, {y})"])
            return c.emit(t.format(x=n, y=y.name), x)
    if form == "unary":
        return c.emit(c.d.choice(["{x}.abs()", "-{x}"]).format(x=n), x)
    if form == "float_scalar":
        return c.emit(c.d.choice(["{x} * 0.5", "{x} / 2", "{x} + 0.25"]).format(x=n), x)
    k = c.d.choice([1, 2, 3, -1])
    c.emit(c.d.choice(["{x} + {k}", "{x} * {k}", "{x} - {k}", "{k} - {x}"]).format(x=n, k=k), x)


def _constant(c: _Ctx, x: Val):
    """A mask that reads no input, built as transformers builds attention masks (arange,
    diff, cumsum, comparisons): compiled, it is folded into a constant (folding.py)."""
    if x.rank == 0:
        return _nothing(c, x)
    n, dev = x.shape[-1], f"device={x.name}.device"
    mask = c.d.choice([f"(torch.arange({n}, {dev}).cumsum(0) % 3 == 1)",
                       f"(torch.diff(torch.arange({n}, {dev}), prepend=torch.full((1,), -1, {dev})) == 1)",
                       f"(torch.arange({n}, {dev})[:, None] >= torch.arange({x.shape[-2] if x.rank >= 2 else 1}, {dev}))"
                       f".t()" if x.rank >= 2 else f"(torch.arange({n}, {dev}) >= {n // 2})"])
    if x.kind == "bool":
        return c.emit(f"{x.name} & {mask}", x)
    other = repr(c.d.choice([0.0, -1.0, 2.5])) if x.kind == "float" else repr(c.d.choice([0, 1]))
    return c.emit(f"torch.where({mask}, {x.name}, {other})", x)


def _gather(c: _Ctx, x: Val):
    """Elements picked by index (loopir.Gather): torch.gather along a dim, an embedding
    lookup of x's rows, index_select; the indices from a pattern that reads no input
    (folded into a constant) or from an integer value of the program, brought in range."""
    if x.rank == 0 or 0 in x.shape:
        return _nothing(c, x)
    s, dev = tuple(x.shape), f"device={x.name}.device"
    form = c.d.choice(["gather", "index_select"] + (["embedding"] if x.rank == 2 else []))
    if form == "gather":
        d = c.d.integer(0, x.rank - 1)
        y = c.partner(lambda v: v.kind == "int" and tuple(v.shape) == s) if c.d.flag() else None
        idx = (f"({y.name}.abs() % {s[d]})" if y is not None else
               f"(torch.arange({math.prod(s)}, {dev}).reshape({s}) * {c.d.choice([7, 1, 3])} % {s[d]})")
        return c.emit(f"torch.gather({x.name}, {c.d.choice([d, d - x.rank])}, {idx})", x)
    if x.rank >= 2 and c.d.flag():  # advanced indexing by broadcast integer tensors, negative ones wrapped
        rows = f"((torch.arange({c.d.integer(1, 4)}, {dev}) * {c.d.choice([5, 1, 2])} + 1) % {s[0]} - {s[0]})"
        cols = f"((torch.arange({c.d.integer(1, 4)}, {dev}) * 3) % {s[1]})"
        return c.emit(f"{x.name}[{rows}[:, None], {cols}[None, :]]", x)
    idx = f"((torch.arange({s[0]}, {dev}) * {c.d.choice([5, 1, 2])} + 1) % {s[0]})"
    if form == "embedding":
        return c.emit(f"F.embedding({idx}, {x.name})", x)
    return c.emit(f"torch.index_select({x.name}, 0, {idx})", x)


def _spatial(c: _Ctx, x: Val):
    """Convolutional networks' forms (convnets.py): constant padding (a negative pad crops),
    repeat, max and adaptive average pooling over windows that tile the last two dims, batch
    norm with running statistics (eval)."""
    n, r, s, dev = x.name, x.rank, tuple(x.shape), f"device={x.name}.device"
    if r == 0 or 0 in s:
        return _nothing(c, x)
    form = c.d.choice(["pad", "repeat", "pool", "batch_norm"])
    if form == "pad":
        pads = [c.d.integer(-1 if s[r - 1 - k // 2] > 1 else 0, 2) for k in range(2 * min(r, 2))]
        return c.emit(f"F.pad({n}, {tuple(pads)}, value={c.d.choice([0.0, -1.5])})", x)
    if form == "repeat":
        reps = [c.d.choice([1, 2]) for _ in range(r + c.d.integer(0, 1))]
        return c.emit(f"{n}.repeat({', '.join(map(str, reps))})", x)
    if form == "pool" and r in (3, 4):
        h, w = (c.d.choice([k for k in (1, 2, 3) if dim % k == 0]) for dim in s[-2:])
        if c.d.flag() and min(s[-2:]) >= 2 and c.d.flag():  # overlapping, padded (ResNet's 3x3 / 2 / 1)
            k = [c.d.integer(1, min(3, dim)) for dim in s[-2:]]
            pad = tuple(c.d.integer(0, kk // 2) for kk in k)
            return c.emit(f"F.max_pool2d({n}, {tuple(k)}, stride={(c.d.integer(1, 2), c.d.integer(1, 2))}, "
                          f"padding={pad}, ceil_mode={c.d.flag()})", x)
        if c.d.flag():
            return c.emit(f"F.max_pool2d({n}, ({h}, {w}))", x)
        return c.emit(f"F.adaptive_avg_pool2d({n}, ({s[-2] // h}, {s[-1] // w}))", x)
    if form == "batch_norm" and r >= 2:
        stats = ", ".join(f"torch.linspace({lo}, {hi}, {s[1]}, {dev}, dtype={n}.dtype)"
                          for lo, hi in ((-1, 1), (0.5, 2), (0.5, 1.5)))
        return c.emit(f"F.batch_norm({n}, {stats}, None, False, 0.1, 1e-5)", x)
    return c.emit(f"{n}.repeat({', '.join(['2'] + ['1'] * (r - 1))})", x)


def _nothing(c: _Ctx, x: Val):
    """No step: the simplest choice, so that shrinking can turn steps it does not need into nothing."""


KINDS = {
    "float": [_nothing] + [_unary] * 4 + [_binary] * 4 + [_view] * 4 + [_reduce] * 3 + [_row] * 2 + [_library] * 2
    + [_compare, _where, _mask_mul, _cast, _aten, _constant, _gather, _spatial] + [_rule] * 4,
    "int": [_nothing] + [_int_arith] * 4 + [_view, _view, _reduce, _reduce, _compare, _compare, _where, _mask_mul]
    + [_cast] * 2 + [_constant, _gather],
    "bool": [_nothing, _cast, _cast, _view, _reduce, _where, _where, _compare, _constant, _gather, _bool_arith],
}
SHAPES = {"BRC": lambda B, R, C: (B, R, C), "RC": lambda B, R, C: (R, C), "C": lambda B, R, C: (C,),
          "R1": lambda B, R, C: (R, 1), "1C": lambda B, R, C: (1, C), "": lambda B, R, C: (),
          "BHRC": lambda B, R, C: (B, 2, R, C), "B1C": lambda B, R, C: (B, 1, C), "BR1": lambda B, R, C: (B, R, 1)}


def generate(d: Drawer, mode: str = "default") -> Program:
    """A random program; every choice comes from `d`."""
    global _limit
    _limit = LONG_NUMEL if mode == "long" else MAX_NUMEL
    if mode == "long":  # rows longer than a row kernel's stack stash (16384 floats)
        B, R, C = d.choice([1, 2]), d.choice([2, 3, 1]), d.choice([16400, 16384, 20001])
    else:
        B = d.choice([2, 1, 3])
        R = d.choice([8, 4, 1, 5, 3, 12])
        C = d.choice([R, 8, 6, 16, 1, 7, 33])  # the first: square shapes, where transposes keep shapes
    if mode == "zero":
        which = d.integer(0, 2)
        B, R, C = [0 if i == which else v for i, v in enumerate((B, R, C))]
    n_inputs = d.integer(1, 3)
    inputs = []
    for i in range(n_inputs):
        family = d.choice(["BRC", "RC", "BHRC"]) if i == 0 else d.choice(list(SHAPES))
        if mode == "int":
            dtype = d.choice(["int64", "bool", "float32"] if i else ["int64", "bool"])
            dtype = "int64:big" if dtype == "int64" and d.integer(0, 2) == 0 else dtype
        elif i == 0:
            dtype = d.choice(["float32"] * 7 + ["float64"])
        else:
            dtype = d.choice(["float32"] * 6 + ["float64", "int64", "bool"])
        shape = SHAPES[family](B, R, C)
        inputs.append((f"x{i}", shape if math.prod(shape) <= _limit else (R, C), dtype))
    seed = d.integer(0, 2 ** 16)
    env = dict(zip([n for n, _, _ in inputs], make_inputs(inputs, seed)))
    ctx = _Ctx(d, mode, (B, R, C, 2), env)
    ctx.live = [Val(n, tuple(s), getattr(torch, t.split(":")[0])) for n, s, t in inputs]
    # "deep": a few hundred steps, a real model's graph size (egglog's global names once
    # collided only past ~370 nodes, which the short programs never reach)
    for _ in range(d.integer(600, 1000) if mode == "deep" else d.integer(5, 30)):
        d.span()
        x = d.recent(ctx.live)
        d.choice(KINDS[x.kind])(ctx, x)
    d.span()
    if mode == "multi":
        n_out = d.integer(2, 3)
    else:
        n_out = d.choice([1, 1, 2, 3])
    outputs = [ctx.live[-1].name] + [d.recent(ctx.live).name for _ in range(n_out - 1)]
    if mode == "multi":
        out_kind = d.choice(["dict", "tuple", "list"])
    else:
        out_kind = d.choice(["single", "tuple", "dict", "list"] if n_out == 1 else ["tuple", "dict", "list"])
    return Program(tuple(inputs), tuple(ctx.steps), tuple(outputs), out_kind, seed, mode, ctx.fallbacks)


def programs(mode: str = "default"):
    """Hypothesis strategy of random programs (see `generate`)."""
    assert mode in MODES, mode

    @st.composite
    def _programs(draw):
        return generate(HypothesisDrawer(draw), mode)
    return _programs()


# ---------------------------------------------------------------- source


def _return(p: Program) -> str:
    outs = p.outputs
    if p.out_kind == "single":
        return outs[0]
    if p.out_kind == "tuple":
        return "(" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")"
    if p.out_kind == "list":
        return "[" + ", ".join(outs) + "]"
    return "{" + ", ".join(f"'out{i}': {o}" for i, o in enumerate(outs)) + "}"


def fn_source(p: Program, reference: bool = False) -> str:
    lines = [f"def fn({', '.join(p.param_names())}):"]
    for step in p.live_steps():
        expr = step.expr.replace(".float()", ".double()") if reference else step.expr
        lines.append(f"    {step.name} = {expr}")
    lines.append(f"    return {_return(p)}")
    return "\n".join(lines)


def describe(p: Program) -> str:
    """Runnable source: the program (dead steps dropped) and its inputs."""
    ins = "\n".join(input_source(n, s, t) for n, s, t in p.inputs)
    return (f"import torch\nimport torch.nn.functional as F\n\n\n{fn_source(p)}\n\n\n"
            f"g = torch.Generator().manual_seed({p.seed})\n{ins}\n"
            f"inputs = [{', '.join(p.param_names())}]\n"
            f"# compiled = egc.compile(fn, inputs); compare compiled(*inputs) with fn(*inputs)")


_counter = itertools.count()


def _exec(source: str) -> dict:
    filename = f"<egc-fuzz-{next(_counter)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    env: dict = {}
    exec(compile(source, filename, "exec"), env)
    return env


def build(p: Program):
    """(fn, example_inputs): describe()'s source, executed."""
    env = _exec(describe(p))
    return env["fn"], env["inputs"]


def reference(p: Program):
    """The program in float64: float inputs cast, `.float()` casts and torch's
    default dtype (for int * 0.5 and the like) float64.  Returns (result, the
    smallest relative margin of a float comparison)."""
    inputs = [t.double() if t.is_floating_point() else t for t in make_inputs(p.inputs, p.seed)]
    env = dict(zip([n for n, _, _ in p.inputs], inputs))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for step in p.live_steps():
            expr = step.expr.replace(".float()", ".double()")
            env[step.name] = eval(expr, {"torch": torch, "F": F}, env)
        result = eval(_return(p), {}, env)
        margins = [_margin(step, env) for step in p.live_steps() if step.cmp]
    finally:
        torch.set_default_dtype(old)
    return result, min(margins, default=math.inf)


def _jitter(t, gen, ulps: float = 2.0, full: bool = False):
    """t with each float element moved by up to `ulps` units in the last place (relative);
    `full`: by `ulps` exactly, up or down at random (each element's worst case)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    if full:
        direction = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype) * 2 - 1
    else:
        direction = torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2 - 1
    return t + t * direction * (ulps * torch.finfo(t.dtype).eps)


def noisy_runs(p: Program, n: int = 3) -> list:
    """Eager, with every step's float result moved by two ulps, up or down at
    random (n runs): how far a different, equally valid rounding of each
    intermediate value (another summation order, a recomputation in a fused
    kernel, a vector math function against its scalar twin) can move the result.
    Moves of random size (uniform up to two ulps, two runs) had missed a layer
    norm of three values 2.5e-5 apart under eps 1e-6, which turns half an ulp of
    its input, a vector powf's rounding, into 1.2e-4 of output (soak seed 28001)."""
    runs = []
    for k in range(n):
        gen = torch.Generator().manual_seed(1000 + k)
        env = dict(zip([n for n, _, _ in p.inputs], make_inputs(p.inputs, p.seed)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in p.live_steps():
                value = _jitter(eval(step.expr, {"torch": torch, "F": F}, env), gen, full=True)
                env[step.name] = _sum_noise(step.expr, value, env, gen)
            runs.append(eval(_return(p), {}, env))
    return runs


_SUMS = re.compile(r"\.sum\(|\.mean\(|torch\.sum\(|torch\.mean\(| @ |matmul\(|linear\(|mm\(|attention\(")


def _sum_noise(expr: str, value, env, gen):
    """A sum's rounding depends on its order, and is proportional to the sum of
    its terms' magnitudes, not to the result (a sum that cancels to ~0 has a
    large relative error in any order): `value` moved by up to eps times the
    step evaluated on the magnitudes of its float operands."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and _SUMS.search(expr)):
        return value
    magnitudes = {k: v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in env.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scale = eval(expr, {"torch": torch, "F": F}, magnitudes)
    except Exception:  # noqa: BLE001 - a step that needs its signs (a log of a difference): no noise
        return value
    if not (isinstance(scale, torch.Tensor) and scale.shape == value.shape and scale.dtype == value.dtype):
        return value
    noise = (torch.rand(value.shape, generator=gen, dtype=value.dtype) * 2 - 1) * torch.finfo(value.dtype).eps
    return value + noise * scale.abs().nan_to_num(0.0, 0.0, 0.0)


def _margin(step: Step, env) -> float:
    """How close a float comparison's operands come (relative), in the reference."""
    lhs, rhs = (eval(e, {"torch": torch, "F": F}, env) for e in step.cmp)
    lhs, rhs = (v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in (lhs, rhs))
    if not (lhs.is_floating_point() or rhs.is_floating_point()):
        return math.inf  # integers and bools compare exactly
    lhs, rhs = torch.broadcast_tensors(lhs.double(), rhs.double())
    if lhs.numel() == 0:
        return math.inf
    m = ((lhs - rhs).abs() / (1 + lhs.abs() + rhs.abs())).nan_to_num(math.inf)
    return float(m.min())


# ---------------------------------------------------------------- checking


@dataclass
class Outcome:
    kind: str  # ok | wrong | crash | error | ill | invalid
    detail: str = ""
    error_type: str = ""
    notes: list = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.kind in ("wrong", "crash", "error", "invalid")

    def signature(self) -> str:
        """For grouping failures: kind, exception type, first line with numbers and names blanked."""
        lines = self.detail.strip().splitlines() or [""]
        first = lines[0]
        if self.kind == "wrong":
            first = first.split(":")[0] + ": " + first.split(":")[1].split("(")[0] if ":" in first else first
        cxx = [ln.split("error:", 1)[1] for ln in lines if "error:" in ln]
        if cxx:  # a C++ compile error: its first message
            first += " | " + re.sub(r"'[^']*'", "'...'", cxx[0])
        first = re.sub(r"\b[xt]\d+\b", "V", first)
        first = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", first)[:160]
        return f"{self.kind}:{self.error_type}:{first}"


def _short_exc(exc: BaseException) -> str:
    """The exception's type and message, and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = str(exc)
    if len(message) > 2500:
        message = message[:1200] + "\n[...]\n" + message[-1200:]
    return f"{type(exc).__name__}{where}: {message}"


def _compare_leaf(i, e, r, g, near: bool, others=()) -> Outcome | None:
    """None if the leaf agrees; else an Outcome (wrong, or ill).  `others`:
    the same leaf from eager runs on inputs perturbed by an ulp or two."""
    if e.is_floating_point():
        r64, e64, g64 = r.double(), e.double(), g.double()
        fin = torch.isfinite(r64)
        if bool((~torch.isfinite(e64) & fin).any()):
            return Outcome("ill", f"output {i}: {e.dtype} overflows where float64 does not", "overflow")
        if bool((torch.isfinite(e64) & ~fin).any()):  # (x - x is 0 in float32 and NaN in float64 past its range)
            return Outcome("ill", f"output {i}: float64 is not finite where {e.dtype} is", "eager-error")
        err_e = torch.zeros_like(r64)
        for o in (e, *others):
            if isinstance(o, torch.Tensor) and o.shape == e.shape and o.is_floating_point():
                err_e = torch.maximum(err_e, torch.where(fin, (o.double() - r64).abs(), torch.zeros_like(r64)))
        err_e = err_e.nan_to_num(math.inf)
        if bool((err_e > 1e-2 * r64.abs() + 1e-3).any()):
            return Outcome("ill", f"output {i}: eager differs from float64 by up to {float(err_e.max()):.3g}",
                           "eager-error")
        allowed = 1e-4 + 1e-4 * r64.abs() + 4 * err_e
        bad = fin & ~((g64 - r64).abs() <= allowed)
        same_nonfinite = (torch.isnan(g64) & torch.isnan(r64)) | (g64 == r64)
        bad |= ~fin & ~same_nonfinite
        want = r64
    else:
        if not torch.equal(e, r.to(e.dtype)):
            return Outcome("ill", f"output {i}: eager's comparisons flip against float64", "eager-flip")
        bad = g != e
        want = e
    if not bool(bad.any()):
        return None
    if near:
        return Outcome("ill", f"output {i}: differs, but a float comparison is within {NEAR} of its threshold",
                       "near-threshold")
    idx = tuple(int(v) for v in bad.nonzero()[0])
    err = (g.double() - want.double()).abs()
    err = err[torch.isfinite(err)]
    return Outcome("wrong", f"output {i}: {int(bad.sum())} of {bad.numel()} elements differ "
                   f"(max |compiled - expected| {float(err.max()) if err.numel() else float('nan'):.4g}); "
                   f"at {list(idx)}: compiled {g[idx].item()!r}, eager {e[idx].item()!r}, "
                   f"float64 {r[idx].item()!r}")


def _same_structure(e_out, g_out):
    e_leaves, e_spec = pytree.tree_flatten(e_out)
    g_leaves, g_spec = pytree.tree_flatten(g_out)
    if str(e_spec) != str(g_spec):
        return f"result structure: compiled {g_spec}, eager {e_spec}"
    for i, (e, g) in enumerate(zip(e_leaves, g_leaves)):
        if not isinstance(g, torch.Tensor):
            return f"output {i}: compiled returns {type(g).__name__}"
        if g.dtype != e.dtype:
            return f"output {i}: dtype: compiled {g.dtype}, eager {e.dtype}"
        if g.shape != e.shape:
            return f"output {i}: shape: compiled {list(g.shape)}, eager {list(e.shape)}"
    return None


def _identical(a, b) -> bool:
    """Equal shapes and values, NaN equal to NaN."""
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())


def compare_results(e_out, r_out, g_out, near: bool, perturbed=()) -> Outcome:
    """Compiled result g_out against eager e_out (structure, dtypes, shapes,
    integers) and the float64 reference r_out (floats, with a tolerance that
    grows with eager's own error, here and on `perturbed` inputs)."""
    problem = _same_structure(e_out, g_out)
    if problem:
        return Outcome("wrong", problem)
    ill = None
    others = [pytree.tree_leaves(o) for o in perturbed if not _same_structure(e_out, o)]
    for i, (e, r, g) in enumerate(zip(pytree.tree_leaves(e_out), pytree.tree_leaves(r_out),
                                      pytree.tree_leaves(g_out))):
        result = _compare_leaf(i, e, r, g, near, [o[i] for o in others])
        if result is not None and result.kind == "wrong":
            return result
        ill = ill or result
    return ill or Outcome("ok")


def check(p: Program, **compile_kwargs) -> Outcome:
    """Compile `p` with the default rules and compare it with eager and float64."""
    if p.fallbacks:
        return Outcome("invalid", f"the generator replaced {p.fallbacks} step(s) (a generator bug)")
    try:
        fn, inputs = build(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = eager_runs(fn, inputs) + noisy_runs(p)
            ref, margin = reference(p)
    except Exception as exc:  # noqa: BLE001
        return Outcome("invalid", f"eager torch rejects the program: {_short_exc(exc)}", type(exc).__name__)
    return check_compiled(fn, inputs, eager, ref, margin < NEAR, p.param_names(), **compile_kwargs)


def check_fn(fn, inputs, **compile_kwargs) -> Outcome:
    """`check` for a hand-written program (no `.float()` casts inside): the
    reference is `fn` on float inputs cast to float64, float64 the default dtype."""
    eager = eager_runs(fn, inputs)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    finally:
        torch.set_default_dtype(old)
    return check_compiled(fn, inputs, eager, ref, False, [f"input {i}" for i in range(len(inputs))],
                          **compile_kwargs)


def eager_runs(fn, inputs, n: int = 2) -> list:
    """fn on inputs, then on float inputs perturbed by up to two ulps (n
    times): how far float rounding alone moves the result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [fn(*inputs)]
        for k in range(n):
            gen = torch.Generator().manual_seed(k)
            runs.append(fn(*[_jitter(t, gen) for t in inputs]))
    return runs


def check_compiled(fn, inputs, eagers, ref, near: bool, names, **compile_kwargs) -> Outcome:
    """Compile fn for inputs, call it twice, compare with eager (structure,
    dtypes, shapes, ints and bools) and with the float64 reference (floats);
    then, the second call's results let go, a third time (the same results).
    `eagers`: eager's result, then its results on perturbed inputs.
    `device="cuda"` among the keyword arguments: the program is compiled and run
    on copies of the inputs on that device, and its results compared on the CPU."""
    import egraph_compiler as egc
    from egraph_compiler.errors import EgraphCompilerError

    device = compile_kwargs.pop("device", None)
    saved = [t.clone() for t in inputs]
    if device is not None:
        inputs = [t.to(device) for t in inputs]

    def host(tree):
        return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)
    stage = "compile"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = egc.compile(fn, inputs, **compile_kwargs)
            stage = "call"
            got = host(compiled(*inputs))
            first = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, got)
            stage = "second call"
            again = host(compiled(*inputs))
    except EgraphCompilerError as exc:
        return Outcome("error", f"{stage}: {_short_exc(exc)}", type(exc).__name__)
    except Exception as exc:  # noqa: BLE001
        return Outcome("crash", f"{stage}: {_short_exc(exc)}", type(exc).__name__)
    notes = sorted({f"{type(w.message).__name__}: {str(w.message)[:120]}" for w in caught})
    if any("EagerFallbackWarning" in n for n in notes):
        return Outcome("error", "the compiled program ran eagerly: " + "; ".join(notes), "EagerFallbackWarning")
    for name, before, after in zip(names, saved, inputs):
        if not torch.equal(before, after.cpu()):
            return Outcome("wrong", f"the compiled call modified input {name}")
    eager = eagers[0]
    outcome = compare_results(eager, ref, got, near=near, perturbed=eagers[1:])
    if outcome.kind == "ok":
        if _same_structure(first, got) or not all(
                _identical(a, b) for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(got))):
            outcome = Outcome("wrong", "a second call of the compiled program changed the first call's results")
        elif any(not torch.allclose(a.double(), b.double(), atol=1e-6, rtol=1e-6, equal_nan=True)
                 if a.is_floating_point() else not torch.equal(a, b)
                 for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(again))):
            outcome = Outcome("wrong", "a second call of the compiled program gives different results")
    if outcome.kind == "ok":  # nothing holds the second call's results now: a third call may write their
        del again  # buffers again (wrapper.KeptBuffers), and must still give the first call's results
        try:
            third = host(compiled(*inputs))
        except Exception as exc:  # noqa: BLE001
            return Outcome("crash", f"third call: {_short_exc(exc)}", type(exc).__name__)
        if any(not torch.allclose(a.double(), b.double(), atol=1e-6, rtol=1e-6, equal_nan=True)
               if a.is_floating_point() else not torch.equal(a, b)
               for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(third))):
            outcome = Outcome("wrong", "a third call of the compiled program, after the second's results were "
                                       "let go, gives different results")
    outcome.notes = notes
    return outcome


def failure_message(p: Program, outcome: Outcome) -> str:
    return (f"{outcome.kind}{' (' + outcome.error_type + ')' if outcome.error_type else ''}: {outcome.detail}\n"
            f"--- program ---\n{describe(p)}")


# ---------------------------------------------------------------- shrinking (for soak)


def replay(choices, mode: str) -> tuple[Program, ChoiceDrawer]:
    d = ChoiceDrawer(choices)
    return generate(d, mode), d


def shrink(choices, mode: str, still_fails, budget_s: float = 120.0, log=None):
    """Greedy shrinking of a recorded choice list (fewer steps, delete whole
    steps, then lower each choice) while `still_fails(program)` holds.
    Returns the smallest (program, choices) found within the budget."""
    import time
    deadline = time.monotonic() + budget_s
    program, d = replay(choices, mode)
    best, spans = d.record, d.spans
    tried: dict[str, bool] = {}

    def size(p):
        return (len(p.live_steps()), sum(math.prod(s) for _, s, _ in p.inputs), len(p.inputs), len(p.steps))

    def attempt(cand):
        nonlocal best, spans, program
        if time.monotonic() > deadline or cand == best:
            return False
        p, dd = replay(cand, mode)
        if p.fallbacks or (size(p), dd.record) >= (size(program), best):
            return False
        key = describe(p)
        if key not in tried:  # choices that only change dead steps give the same program
            tried[key] = still_fails(p)
            if log:
                log(f"  tried {len(tried)}: {size(p)} -> {tried[key]}")
        if tried[key]:
            best, spans, program = dd.record, dd.spans, p
            return True
        return False

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        if spans and spans[0] > 0:  # fewer steps: the step count is the choice just before the first step
            i = spans[0] - 1
            for v in (0, best[i] // 2, best[i] - 1):
                if 0 <= v < best[i] and attempt(best[:i] + [v] + best[i + 1:]):
                    improved = True
                    break
        k = len(spans) - 2
        while k >= 0:  # delete one step's choices
            if k + 1 < len(spans) and attempt(best[:spans[k]] + best[spans[k + 1]:]):
                improved = True
            k -= 1
        i = 0
        while i < len(best) and time.monotonic() < deadline:  # lower one choice
            for v in (0, best[i] // 2, best[i] - 1):
                if 0 <= v < best[i] and attempt(best[:i] + [v] + best[i + 1:]):
                    improved = True
                    break
            i += 1
    used = set(program.outputs).union(*(step.deps for step in program.live_steps()))
    params = tuple(n for n in program.param_names() if n in used)
    if params != program.param_names() and time.monotonic() < deadline:  # drop unused inputs
        fewer = dataclasses.replace(program, params=params)
        if still_fails(fewer):
            program = fewer
    return program, best
