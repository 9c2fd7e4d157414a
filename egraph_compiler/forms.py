"""Converters for ATen ops that are the op table's ops written another way, as real
models write them (the transformers sweep: DeBERTa's clamps and ceil, Persimmon's
square, GPT-J's and CodeGen's stacked rotary halves, Falcon's `x[:, [i]]`, Mixtral's
`torch.greater`):

- `minimum(a, b)` is `-maximum(-a, -b)` for floats (negation is exact and keeps NaN,
  which `maximum` propagates as torch does) and `where(a < b, a, b)` for integers (their
  `maximum` likewise: generated code has none);
- `clamp(x, lo, hi)` is `minimum(maximum(x, lo), hi)`, torch's own definition (a lower
  bound above the upper gives the upper), `clamp_max` the `minimum`;
- `ceil(x)` is `-floor(-x)`, exact (integers are their own ceiling);
- `square(x)` is `x * x`; `stack` is an unsqueeze of each tensor and a cat;
- `_weight_norm(v, g, dim)` (a weight-normed layer in eval) is `v * (g / ||v||)`, and a vector
  norm of order 2 (or 1) its sum of squares' root (or of absolute values);
- `greater`, `less_equal`... are `gt`, `le`...;
- activations as torch's kernels compute them: `hardtanh` (ReLU6) a clamp, `leaky_relu` and
  `elu` (selu, celu) a `where` (elu's negative side `expm1`); `isnan(x)` is `x != x`, `isinf(x)`
  `|x| == inf`, `amin` `-amax(-x)`, a xor of bools `a != b`;
- `any` the amax of `x != 0` (all: torch's not-any-not);
- `argmax`/`argmin` and `max`/`min` along a dim with their indices: the first position where x
  is the row's amax (or NaN), by an amin over a folded arange;
- `slice_scatter` and `select_scatter` (`x[:, a:b] = y` once functionalised) a cat of x's parts
  around y.

capture.py reads this table with converters.py's."""
from __future__ import annotations

import torch

from . import ops
from .converters import _binary, _cat, _neg_dims, _reshape, _slice, _t, _unsqueeze
from .graph import ExternCall, Node, const

aten = torch.ops.aten


def _negated(x):
    return const(-float(x)) if not isinstance(x, Node) else Node.make("neg", (x,))


def _integer(x) -> bool:
    return isinstance(x, Node) and x.dtype in ops.INTEGERS


def _integers(a, b) -> bool:
    return _integer(a) and (_integer(b) or isinstance(b, int))


def _picked(a, b, smaller: bool):
    """The smaller (or larger) of two integers, by a comparison."""
    less = Node.make("lt", (a, _t(b)))
    return Node.make("where", (less, a, _t(b)) if smaller else (less, _t(b), a))


def _minimum(a, b):
    if any(isinstance(x, Node) and x.dtype == "bool" for x in (a, b)):
        return None
    if _integers(a, b):
        return _picked(a, b, smaller=True)
    if _integer(a) or _integer(b):  # (an integer tensor against a float: torch promotes; ATen)
        return None
    return Node.make("neg", (Node.make("maximum", (_negated(a), _negated(b))),))


def _maximum(a, b):
    if _integers(a, b):  # (generated code has no integer maximum)
        return _picked(a, b, smaller=False)
    return _binary("maximum")(a, b)


def _clamp(x, min=None, max=None):
    out = x
    if min is not None:
        out = _maximum(out, min)
    return _minimum(out, max) if max is not None else out


def _ceil(x):
    if x.dtype in ops.INTEGERS:
        return x
    return Node.make("neg", (Node.make("floor", (Node.make("neg", (x,)),)),))


def _stack(tensors, dim=0):
    if not tensors or len({t.shape for t in tensors}) != 1:
        return None
    return _cat([_unsqueeze(t, dim) for t in tensors], dim)


def _weight_norm(v, g, dim=0):
    """`_weight_norm(v, g, dim)` (weight_norm's weight in eval): v * (g / ||v||), the norm over every
    dim but `dim` (over all of v for dim -1), as torch's norm_except_dim; float32 (ATen otherwise)."""
    if v.dtype != "float32" or not v.shape:
        return None
    rank = len(v.shape)
    keep = None if dim == -1 else ops.norm_dim(dim, rank)
    dims = tuple(d - rank for d in range(rank) if d != keep)
    if not dims:
        return None
    return Node.make("mul", (v, Node.make("div", (g, _vector_norm(v, 2, list(dims), keepdim=True)))))


def _vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    """`torch.linalg.vector_norm` / `x.norm(dim=...)` for ord 2 (CLIP's `x / x.norm(dim=-1,
    keepdim=True)`) and 1, over float32; other orders and dtypes: ATen."""
    if x.dtype != "float32" or dtype is not None or ord not in (1, 2) or not x.shape:
        return None
    dims = _neg_dims(dim, len(x.shape))
    terms = Node.make("abs", (x,)) if ord == 1 else Node.make("mul", (x, x))
    total = Node.make("sum", (terms,), {"dims": dims, "keepdim": bool(keepdim)})
    return total if ord == 1 else Node.make("sqrt", (total,))


def _float(x) -> bool:
    return isinstance(x, Node) and x.dtype in ("float32", "bfloat16", "float16")


def _scaled(x, factor):
    return x if factor == 1 else Node.make("mul", (x, const(float(factor))))


def _leaky_relu(x, negative_slope=0.01):
    """x > 0 ? x : x * slope, torch's own form (NaN stays NaN)."""
    if not _float(x):
        return None
    return Node.make("where", (Node.make("gt", (x, const(0.0))), x, _scaled(x, negative_slope)))


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """x <= 0 ? expm1(x * input_scale) * alpha * scale : x * scale, as torch's kernel (selu and
    celu are this with other constants)."""
    if not _float(x):
        return None
    negative = _scaled(Node.make("expm1", (_scaled(x, input_scale),)), alpha * scale)
    return Node.make("where", (Node.make("le", (x, const(0.0))), negative, _scaled(x, scale)))


def _isnan(x):
    return Node.make("ne", (x, x)) if _float(x) else None


def _isinf(x):
    return Node.make("eq", (Node.make("abs", (x,)), const(float("inf")))) if _float(x) else None


def _amin(x, dim=(), keepdim=False):
    """-amax(-x): negation is exact, and a NaN in the row wins either way."""
    if not _float(x):
        return None
    largest = Node.make("amax", (Node.make("neg", (x,)),), {"dims": _neg_dims(dim, len(x.shape)),
                                                            "keepdim": bool(keepdim)})
    return Node.make("neg", (largest,))


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """`x[:, a:b] = src` once functionalised (a KV cache's update, a setitem): x's part before the
    slice, src, x's part after it, one cat; steps other than 1: ATen."""
    if step != 1 or not x.shape or src.dtype != x.dtype or len(src.shape) != len(x.shape):
        return None
    d = ops.norm_dim(dim, len(x.shape))
    start, end, _ = slice(start, end, 1).indices(x.shape[d])
    end = max(start, end)
    if src.shape != x.shape[:d] + (end - start,) + x.shape[d + 1:]:
        return None
    return _cat([_slice(x, d, 0, start), src, _slice(x, d, end, x.shape[d])], d)


def _select_scatter(x, src, dim, index):
    """`x[:, i] = src`: the slice i:i+1 scattered."""
    if not x.shape:
        return None
    d = ops.norm_dim(dim, len(x.shape))
    index = index + x.shape[d] if index < 0 else index
    return _slice_scatter(x, _unsqueeze(src, d), d, index, index + 1) if 0 <= index < x.shape[d] else None


def _iota(n: int) -> Node:
    """0, 1, ..., n - 1 in float32 (exact below 2**24): an ATen arange, which folding computes once."""
    call = ExternCall(aten.arange.start_step, (0, n, 1), (("dtype", torch.float32),), (n,), "float32", None, "")
    return Node.make("extern", (), {"target": call}, shape=(n,), dtype="float32")


def _extreme_value(x, dim, keepdim, largest):
    """The row's amax, or amin."""
    if not largest:
        return _amin(x, dim, keepdim)
    return Node.make("amax", (x,), {"dims": _neg_dims(dim, len(x.shape)), "keepdim": bool(keepdim)})


def _extreme_at(x, dim=None, keepdim=False, largest=True):
    """torch.argmax / argmin: the first position of the row's largest (smallest) value, or of its
    first NaN, as torch's: the smallest position where x equals the row's amax (or x is NaN), over
    positions counted by a folded arange.  Floats only (integers: ATen)."""
    if not _float(x) or not x.shape or 0 in x.shape:
        return None
    rank = len(x.shape)
    if dim is None:
        flat = _extreme_at(_reshape(x, [x.numel]), 0, False, largest)
        return _reshape(flat, [1] * rank) if keepdim and flat is not None else flat
    d = ops.norm_dim(dim, rank)
    n = x.shape[d]
    if n >= 1 << 24:
        return None
    best = _extreme_value(x, d, True, largest)
    hit = Node.make("where", (Node.make("eq", (x, best)), const(1.0), Node.make("ne", (x, x))))
    positions = _reshape(_iota(n), [n] + [1] * (rank - 1 - d))
    first = _amin(Node.make("where", (hit, positions, const(float(n)))), d, keepdim)
    return Node.make("cast", (first,), {"dtype": "int64"})


def _extreme(largest: bool):
    """max(x, dim) / min(x, dim): (values, indices)."""
    def convert(x, dim, keepdim=False):
        at = _extreme_at(x, dim, keepdim, largest)
        if at is None:
            return None
        return [_extreme_value(x, dim, keepdim, largest), at]
    return convert


def _any(x, dim=None, keepdim=False):
    """torch.any: whether some entry of the row is nonzero (NaN counts), as the row's amax of
    `x != 0` in float32; all(x) is torch's `not any(not x)` over this."""
    if not x.shape or 0 in x.shape:
        return None
    nonzero = Node.make("cast", (Node.make("ne", (x, const(0.0))),), {"dtype": "float32"})
    largest = Node.make("amax", (nonzero,), {"dims": _neg_dims(dim, len(x.shape)), "keepdim": bool(keepdim)})
    return Node.make("gt", (largest, const(0.0)))


def _xor(a, b):
    """Of two bool tensors: a != b."""
    if not all(isinstance(t, Node) and t.dtype == "bool" for t in (a, b)):
        return None
    return Node.make("ne", (a, b))


FORMS = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten._weight_norm.default: _weight_norm,
    aten.minimum.default: _minimum, aten.maximum.default: _maximum, aten.clamp_min.default: _maximum,
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_max.default: _minimum, aten.clamp_max.Tensor: _minimum,
    aten.clamp_min.Tensor: _maximum,
    aten.ceil.default: _ceil,
    aten.square.default: lambda x: Node.make("mul", (x, x)),
    aten.stack.default: _stack,
    aten.hardtanh.default: lambda x, min_val=-1.0, max_val=1.0: _clamp(x, min_val, max_val) if _float(x) else None,
    aten.leaky_relu.default: _leaky_relu, aten.elu.default: _elu,
    aten.isnan.default: _isnan, aten.isinf.default: _isinf, aten.amin.default: _amin,
    aten.argmax.default: lambda x, dim=None, keepdim=False: _extreme_at(x, dim, keepdim, True),
    aten.argmin.default: lambda x, dim=None, keepdim=False: _extreme_at(x, dim, keepdim, False),
    aten.max.dim: _extreme(True), aten.min.dim: _extreme(False),
    aten.any.dim: _any, aten.any.dims: _any, aten.any.default: _any,
    aten.slice_scatter.default: _slice_scatter, aten.select_scatter.default: _select_scatter,
    aten.bitwise_xor.Tensor: _xor, aten.__xor__.Tensor: _xor, aten.logical_xor.default: _xor,
}
for _alias, _name in [("greater", "gt"), ("greater_equal", "ge"), ("less", "lt"), ("less_equal", "le"),
                      ("not_equal", "ne")]:
    for _overload in ("Tensor", "Scalar"):
        if hasattr(getattr(aten, _alias), _overload):
            FORMS[getattr(getattr(aten, _alias), _overload)] = _binary(_name)
