"""Converters: each ATen op the op table models -> Graph IR nodes.

CONVERTERS maps an ATen overload to a function of its (converted) arguments
that builds the op table's nodes, or returns None for a form the table does not
model (the op then runs through ATen, named in the plan).  capture.py walks the
fx graph and calls these; they never see torch.fx.
"""
from __future__ import annotations

import math

import torch

from . import ops
from .graph import Node, const

aten = torch.ops.aten


def _t(x):
    if isinstance(x, int) and not isinstance(x, bool) and int(float(x)) != x:
        raise ValueError(f"integer scalar {x} is not exact as a float64 constant")  # the op runs through ATen
    return x if isinstance(x, Node) else const(x)


def _neg_dims(dims, rank):
    """Dims as the op table stores them (negative, sorted); none given: all of them, as torch's."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        dims = list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(ops.norm_dim(d, rank) - rank for d in dims)) if rank else ()


def _reduce(op):
    def convert(x, dims=None, keepdim=False, dtype=None):
        if dtype is not None and str(dtype).removeprefix("torch.") != x.dtype:  # (the input cast first, as torch)
            x = Node.make("cast", (x,), {"dtype": str(dtype).removeprefix("torch.")})
        return Node.make(op, (x,), {"dims": _neg_dims(dims, len(x.shape)), "keepdim": bool(keepdim)})
    return convert


def _binary(op):
    def convert(a, b, alpha=1):
        if op in ops.COMPARISONS:  # an integer tensor against a float: compared in the float's dtype
            a, b = (_float_if_int(x, y) for x, y in ((a, b), (b, a)))
        if op == "add" and alpha == 1 and _bool(a) and (_bool(b) or isinstance(b, bool)):
            return Node.make("maximum", (_t(a), _t(b)))  # (bools add as a logical or; targets' + carries)
        b = _t(b)
        if alpha != 1:
            b = Node.make("mul", (b, const(alpha)))
        return Node.make(op, (_t(a), b))
    return convert


def _bool(x) -> bool:
    return isinstance(x, Node) and x.dtype == "bool"


def _float_if_int(x, other):
    """An integer tensor compared with a float is compared in the float's dtype, as torch
    promotes: float32 for a Python float, the tensor's dtype for a float tensor."""
    if not (isinstance(x, Node) and x.dtype in ops.INTEGERS):
        return x
    if isinstance(other, float):
        return Node.make("cast", (x,), {"dtype": "float32"})
    if isinstance(other, Node) and other.dtype in ("float16", "bfloat16", "float32", "float64"):
        return Node.make("cast", (x,), {"dtype": other.dtype})
    return x


def _unary(op):
    return lambda x: Node.make(op, (x,))


def _transpose(x, d0, d1):
    r = len(x.shape)
    d0, d1 = sorted((ops.norm_dim(d0, r) - r, ops.norm_dim(d1, r) - r))
    return x if d0 == d1 else Node.make("transpose", (x,), {"dim0": d0, "dim1": d1})


def _reshape(x, shape):
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = x.numel // known if known else 0
    if tuple(shape) == x.shape:
        return x
    return _repeat_form(x, tuple(shape)) or Node.make("reshape", (x,), {"shape": tuple(shape)})


def _repeat_form(x, shape):
    """`x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)` (transformers' `repeat_kv`) is
    `repeat_interleave(x, g, dim=1)`: one index map, which the attention rules see through."""
    if x.op != "expand" or x.args[0].op != "reshape":
        return None
    src, unit, wide = x.args[0].args[0].shape, x.args[0].shape, x.shape
    for p in range(1, len(unit)):
        if unit[p] == 1 and unit[:p] + unit[p + 1:] == src and wide[:p] + wide[p + 1:] == src:
            if shape == src[:p - 1] + (src[p - 1] * wide[p],) + src[p:]:
                return Node.make("repeat_interleave", (x.args[0].args[0],), {"dim": p - 1 - len(src),
                                                                              "repeats": wide[p]})
    return None


def _repeat_interleave(x, repeats, dim=None, output_size=None):
    if not isinstance(repeats, int) or dim is None:
        return None
    return Node.make("repeat_interleave", (x,), {"dim": ops.norm_dim(dim, len(x.shape)) - len(x.shape),
                                                 "repeats": repeats})


def _slice(x, dim=0, start=None, end=None, step=1):
    r = len(x.shape)
    d = ops.norm_dim(dim, r)
    start, end, _ = slice(start, end, step).indices(x.shape[d])
    if (start, end, step) == (0, x.shape[d], 1):
        return x
    return Node.make("slice", (x,), {"dim": d - r, "start": start, "end": end, "step": step})


def _cat(tensors, dim=0):
    """torch.cat of n tensors: nested two-operand cats (empty operands dropped; torch also skips
    legacy 1-D empty tensors of another rank)."""
    tensors = [t for t in tensors if 0 not in t.shape] or list(tensors[:1])
    if len({len(t.shape) for t in tensors}) != 1:
        return None
    out = tensors[0]
    for t in tensors[1:]:
        out = Node.make("cat", (out, t), {"dim": ops.norm_dim(dim, len(t.shape)) - len(t.shape)})
    return out


def _split(x, size, dim=0):
    d = ops.norm_dim(dim, len(x.shape))
    sizes = size if isinstance(size, list) else [size] * -(-x.shape[d] // size)
    out, start = [], 0
    for s in sizes:
        out.append(_slice(x, dim, start, min(start + s, x.shape[d])))
        start += s
    return out


def _squeeze(x, dims=None):
    dims = range(len(x.shape)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    drop = {ops.norm_dim(d, len(x.shape)) for d in dims if x.shape[d] == 1}
    return _reshape(x, [s for i, s in enumerate(x.shape) if i not in drop])


def _unsqueeze(x, dim):
    d = ops.norm_dim(dim, len(x.shape) + 1)
    return _reshape(x, list(x.shape[:d]) + [1] + list(x.shape[d:]))


def _select(x, dim, index):
    d = ops.norm_dim(dim, len(x.shape))
    index = index % x.shape[d]
    return _reshape(_slice(x, d, index, index + 1), x.shape[:d] + x.shape[d + 1:])


def _expand(x, shape):
    shape = [x.shape[i - (len(shape) - len(x.shape))] if s == -1 else s for i, s in enumerate(shape)]
    return x if tuple(shape) == x.shape else Node.make("expand", (x,), {"shape": tuple(shape)})


def _repeat(x, repeats):
    """torch's repeat (tiling): each dim of x (leading 1s added) as [1, n] expanded to [r, n], merged."""
    shape = [1] * (len(repeats) - len(x.shape)) + list(x.shape)
    if len(repeats) < len(x.shape) or min(repeats, default=1) < 0:
        return None
    spread = _reshape(x, [d for n in shape for d in (1, n)])
    tiled = _expand(spread, [d for r, n in zip(repeats, shape) for d in (r, n)])
    return _reshape(tiled, [r * n for r, n in zip(repeats, shape)])


def _cast(x, dtype=None, **kw):
    if dtype is None or set(kw) - {"layout", "device", "pin_memory", "non_blocking", "memory_format"}:
        return None
    name = str(dtype).removeprefix("torch.")
    return x if name == x.dtype else Node.make("cast", (x,), {"dtype": name})


def _layer_norm(x, shape, w=None, b=None, eps=1e-5, cudnn=False):
    w, b = w if w is not None else const(1.0), b if b is not None else const(0.0)
    attrs = {"ndim": len(shape), "eps": float(eps)}
    if x.dtype in ("bfloat16", "float16") and "float32" in (w.dtype, b.dtype):  # torch's mixed kernel (autocast)
        return _cast(Node.make("layer_norm", (_cast(x, torch.float32), w, b), attrs), getattr(torch, x.dtype))
    return Node.make("layer_norm", (x, w, b), attrs)


def _rms_norm(x, shape, w=None, eps=None):
    eps = torch.finfo(getattr(torch, x.dtype)).eps if eps is None else eps
    return Node.make("rms_norm", (x, w if w is not None else const(1.0)), {"ndim": len(shape), "eps": float(eps)})


def _softmax(op, internal=False):
    """softmax.int(x, dim, dtype=None) or _softmax(x, dim, half_to_float)."""
    def convert(x, dim, third=None, dtype=None):
        dtype = ("float32" if third else None) if internal else (third if third is not None else dtype)
        if dtype is not None:  # computed in dtype (BLOOM's float32 softmax of bf16 scores): a cast first
            x = _cast(x, dtype)
        if not x.shape:  # a 0-d tensor: torch treats it as one row of one element
            row = Node.make(op, (Node.make("reshape", (x,), {"shape": (1,)}),), {"dim": -1})
            return Node.make("reshape", (row,), {"shape": ()})
        return Node.make(op, (x,), {"dim": ops.norm_dim(dim, len(x.shape)) - len(x.shape)})
    return convert


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p != 0.0:
        return None
    heads = [x.shape[-3] if len(x.shape) >= 3 else None for x in (q, k, v)]
    if enable_gqa and not (ops.gqa(q.shape, k.shape, v.shape) or heads[1] == heads[2] in (1, heads[0])):
        return None  # (GQA over equal heads, or one k/v head, is plain broadcasting attention)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if attn_mask is not None:
        return Node.make("sdpa_mask", (q, k, v, _t(attn_mask)), {"scale": scale, "causal": bool(is_causal)})
    return Node.make("sdpa", (q, k, v), {"scale": scale, "causal": bool(is_causal)})


def _var_mean(x, dims=None, correction=None, keepdim=False):
    """(var, mean) as primitives: the mean, then the mean square deviation from it."""
    dims = _neg_dims(dims, len(x.shape))
    correction = 1 if correction is None else correction
    count = math.prod(x.shape[d] for d in dims)
    if count - correction <= 0 or not x.dtype.startswith(("float", "bfloat")):
        return None  # torch's inf/nan for too few elements, and integer inputs: ATen
    mean = Node.make("mean", (x,), {"dims": dims, "keepdim": True})
    centred = Node.make("sub", (x, mean))
    squares = Node.make("sum", (Node.make("mul", (centred, centred)),), {"dims": dims, "keepdim": bool(keepdim)})
    var = Node.make("div", (squares, const(float(count - correction))))
    return [var, mean if keepdim else Node.make("mean", (x,), {"dims": dims, "keepdim": False})]


def _safe_softmax(x, dim, dtype=None):
    """softmax whose rows of -inf only (attention rows that mask every key) are 0, not NaN."""
    soft = _softmax("softmax")(x, dim, dtype)
    if soft is None or not x.shape:
        return soft
    top = Node.make("amax", (x,), {"dims": (ops.norm_dim(dim, len(x.shape)) - len(x.shape),), "keepdim": True})
    return Node.make("where", (Node.make("gt", (top, const(-math.inf))), soft, const(0.0)))


def _logical(op, truth: bool = False):
    """and / or / not over bools as `where` (exact); `truth` (logical_*): others as x != 0; else ATen."""
    def convert(a, b=None):
        if truth:
            a, b = (x if not isinstance(x, Node) or x.dtype == "bool" else Node.make("ne", (x, const(0.0)))
                    for x in (a, b))
        if not all(isinstance(x, Node) and x.dtype == "bool" for x in (a, b) if x is not None):
            return None
        if op == "not":
            return Node.make("eq", (a, const(0.0)))
        return Node.make("where", (a, b, const(0.0)) if op == "and" else (a, const(1.0), b))
    return convert


def _where(c, a, b):
    return Node.make("where", (c, _t(a), _t(b)))


def _masked_fill(x, mask, value):
    """`x.masked_fill(mask, v)`: where(mask, v, x), in x's dtype (a tensor `v`: ATen)."""
    if not isinstance(mask, Node) or mask.dtype != "bool" or isinstance(value, Node) or not isinstance(x, Node):
        return None
    return Node.make("where", (mask, const(float(value)), x))


def _gelu(x, approximate="none"):
    return Node.make("gelu" if approximate == "none" else "gelu_tanh", (x,))


def _div(a, b, rounding_mode=None):
    return None if rounding_mode is not None else Node.make("div", (_t(a), _t(b)))


def _addmm(bias, a, b, beta=1, alpha=1):
    """addmm and baddbmm (BLOOM's alibi scores): beta * bias + alpha * (a @ b); beta 0 ignores the
    bias (its NaN too, as torch's)."""
    product = Node.make("matmul", (a, b))
    product = product if alpha == 1 else Node.make("mul", (product, _t(alpha)))
    if beta == 0:
        return product
    return Node.make("add", (product, bias if beta == 1 else Node.make("mul", (bias, _t(beta)))))


def _linear(x, w, b=None):
    if len(w.shape) == 1:  # x @ w: the library's linear (an addmm with a bias) needs a matrix
        out = Node.make("matmul", (x, w))
        return out if b is None else Node.make("add", (out, b))
    return Node.make("linear", (x, w, b if b is not None else const(0.0)))


def _fill(value, shape, dtype=None, like=None, infer=False, **kwargs):
    """A tensor of one value (zeros, ones, full, scalar_tensor, new_zeros...): a constant broadcast
    by an index map, never stored unless it is an output."""
    if set(kwargs) - {"layout", "device", "pin_memory", "memory_format", "requires_grad"} or kwargs.get(
            "requires_grad"):
        return None
    inferred = "float32"
    if infer:  # torch.full takes its dtype from the value
        inferred = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else "float32"
    name = str(dtype).removeprefix("torch.") if dtype is not None else (like.dtype if like else inferred)
    integral = isinstance(value, (bool, int)) or (isinstance(value, float) and value.is_integer())
    if name not in ("float32", "float16", "bfloat16", "float64", "bool", "int64", "int32") or isinstance(
            value, complex) or (name in ("int64", "int32") and not (integral and abs(value) <= 2**53)):
        return None
    scalar = Node.make("cast", (const(value),), {"dtype": name})
    return scalar if not shape else Node.make("expand", (Node.make("reshape", (scalar,), {"shape": (1,) * len(
        shape)}),), {"shape": tuple(int(d) for d in shape)})


def _identity(x, *args, **kwargs):
    return x if not kwargs.get("dtype") else None


CONVERTERS = {
    aten.gelu.default: _gelu,
    aten.div.Tensor: _binary("div"), aten.div.Scalar: _binary("div"), aten.div.Tensor_mode: _div,
    aten.pow.Tensor_Scalar: _binary("pow"), aten.pow.Tensor_Tensor: _binary("pow"),
    aten.pow.Scalar: lambda a, b: Node.make("pow", (const(a), b)),
    aten.sum.dim_IntList: _reduce("sum"), aten.sum.default: _reduce("sum"),
    aten.mean.dim: _reduce("mean"), aten.mean.default: _reduce("mean"), aten.amax.default: _reduce("amax"),
    aten.where.self: _where, aten.where.ScalarOther: _where, aten.where.ScalarSelf: _where,
    aten.where.Scalar: _where, aten.masked_fill.Scalar: _masked_fill,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.transpose.int: _transpose, aten.t.default: lambda x: _transpose(x, 0, 1) if len(x.shape) == 2 else x,
    aten.permute.default: lambda x, dims: Node.make("permute", (x,), {"dims": tuple(
        ops.norm_dim(d, len(x.shape)) for d in dims)}),
    aten.view.default: _reshape, aten._unsafe_view.default: _reshape, aten.reshape.default: _reshape,
    aten.expand.default: _expand, aten.repeat.default: _repeat, aten.slice.Tensor: _slice, aten.cat.default: _cat, aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze, aten.unsqueeze.default: _unsqueeze, aten.select.int: _select,
    aten.clone.default: _identity, aten.alias.default: _identity, aten.detach.default: _identity,
    aten.contiguous.default: _identity, aten.lift_fresh_copy.default: _identity,
    aten._to_copy.default: _cast, aten.to.dtype: lambda x, dtype, *a, **k: _cast(x, dtype),
    aten.type_as.default: lambda x, other: _cast(x, other.dtype),
    aten.softmax.int: _softmax("softmax"), aten._softmax.default: _softmax("softmax", internal=True),
    aten._safe_softmax.default: _safe_softmax, aten.log_softmax.int: _softmax("log_softmax"),
    aten._log_softmax.default: _softmax("log_softmax", internal=True),
    aten.layer_norm.default: _layer_norm, aten.rms_norm.default: _rms_norm,
    aten.matmul.default: lambda a, b: Node.make("matmul", (a, b)),
    aten.mm.default: lambda a, b: Node.make("matmul", (a, b)),
    aten.bmm.default: lambda a, b: Node.make("matmul", (a, b)),
    aten.linear.default: _linear,
    aten.addmm.default: _addmm, aten.baddbmm.default: _addmm, aten.scaled_dot_product_attention.default: _sdpa,
    aten.var_mean.correction: _var_mean, aten.var.correction: lambda *a, **k: (_var_mean(*a, **k) or [None])[0],
    aten.var_mean.dim: lambda x, dim=None, unbiased=True, keepdim=False: _var_mean(x, dim, int(unbiased), keepdim),
    aten.var.dim: lambda x, dim=None, unbiased=True, keepdim=False: (_var_mean(x, dim, int(unbiased), keepdim)
                                                                     or [None])[0],
    aten.full.default: lambda size, value, **kw: _fill(value, size, infer=True, **kw),
    aten.zeros.default: lambda size, **kw: _fill(0.0, size, **kw),
    aten.ones.default: lambda size, **kw: _fill(1.0, size, **kw),
    aten.scalar_tensor.default: lambda value, **kw: _fill(value, (), **kw),
    aten.new_zeros.default: lambda x, size, **kw: _fill(0.0, size, like=x, **kw),
    aten.new_ones.default: lambda x, size, **kw: _fill(1.0, size, like=x, **kw),
    aten.full_like.default: lambda x, value, **kw: _fill(value, x.shape, like=x, **kw),
    aten.zeros_like.default: lambda x, **kw: _fill(0.0, x.shape, like=x, **kw),
    aten.ones_like.default: lambda x, **kw: _fill(1.0, x.shape, like=x, **kw),
    aten.bitwise_and.Tensor: _logical("and"), aten.__and__.Tensor: _logical("and"),
    aten.logical_and.default: _logical("and", truth=True), aten.bitwise_or.Tensor: _logical("or"),
    aten.__or__.Tensor: _logical("or"), aten.logical_or.default: _logical("or", truth=True),
    aten.bitwise_not.default: _logical("not"), aten.logical_not.default: _logical("not", truth=True),
    aten.clamp_min.default: lambda x, m: Node.make("maximum", (x, _t(m))),
    aten.rsub.Scalar: lambda x, other, alpha=1: _binary("sub")(other, x, alpha) if alpha == 1 else None,
    aten.rsub.Tensor: lambda x, other, alpha=1: _binary("sub")(other, x, alpha) if alpha == 1 else None,
    aten.reciprocal.default: lambda x: Node.make("div", (const(1.0), x)),
}
for _name in ["exp", "log", "tanh", "erf", "cos", "sin", "floor", "relu", "sigmoid", "neg", "abs", "sqrt", "rsqrt",
              "silu", "log1p", "expm1"]:
    CONVERTERS[getattr(aten, _name).default] = _unary(_name)
CONVERTERS[aten.floor.default] = lambda x: x if x.dtype in ops.INTEGERS else _unary("floor")(x)  # integers: as they are
for _name in ["add", "sub", "mul", "maximum", "gt", "ge", "lt", "le", "eq", "ne"]:
    for _overload in ("Tensor", "Scalar", "default"):
        if hasattr(getattr(aten, _name), _overload):
            CONVERTERS[getattr(getattr(aten, _name), _overload)] = _binary(_name)


# functional collectives (ops.py: the "collective" group), where this torch has them
_c10d = getattr(torch.ops, "_c10d_functional", None)
if _c10d is not None and hasattr(_c10d, "wait_tensor"):
    CONVERTERS.update({
        _c10d.all_reduce.default: lambda x, reduce, group: Node.make(
            "all_reduce", (x,), {"reduce": str(reduce), "group": str(group)}),
        _c10d.all_gather_into_tensor.default: lambda x, size, group: Node.make(
            "all_gather", (x,), {"group_size": int(size), "group": str(group)}),
        _c10d.reduce_scatter_tensor.default: lambda x, reduce, size, group: Node.make(
            "reduce_scatter", (x,), {"reduce": str(reduce), "group_size": int(size), "group": str(group)}),
        _c10d.wait_tensor.default: lambda x: Node.make("wait_tensor", (x,)),
    })
