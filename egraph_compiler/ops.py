"""The op vocabulary: one table that every stage keys off.

Capture maps ATen ops onto these names, the rules DSL checks arity and
attributes against it, the e-graph encoding declares one constructor per entry,
the cost model reads its FLOP counts and groups, lowering reads its group, and
the renderers hold one scalar formula per pointwise name.  Adding an op touches
this file (plus a scalar formula in each renderer for pointwise ops).

Groups:
  source    graph leaves (inputs, scalar constants)
  pointwise elementwise with broadcasting
  reduction reduce over `dims`, optionally `keepdim`
  layout    index remapping only (a view: no arithmetic)
  row       composites computed as one row kernel (softmax, layer_norm, ...)
  gather    rows of a matrix picked by an integer tensor (embedding): indexed loads
  library   run by a tuned library call (matmul, sdpa, linear)
  collective  a functional collective of torch.distributed (all_reduce, all_gather,
            reduce_scatter, and wait_tensor, which waits for one): a library call
            that moves bytes over the link between processes; nothing fuses across it
  boundary  `inline`: its operand is computed inside the consumer's kernel
  extern    anything else, run by ATen and listed as a fallback
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import flash, library
from .library import gqa

Shape = tuple[int, ...]

ATTR_KINDS = ("int", "ints", "float", "bool", "str")


class ShapeError(ValueError):
    """Operand shapes or attributes an op cannot accept."""


@dataclass(frozen=True)
class OpDef:
    name: str
    group: str
    arity: int  # tensor operands; -1 for variadic (extern only)
    attrs: tuple[tuple[str, str], ...]  # (name, kind) in positional order
    shape: Callable[[list[Shape], dict], Shape]
    flops: float  # per output element (pointwise) or per input element (reduction)
    reference: Callable  # eager torch semantics: (tensors, attrs) -> tensor
    dtype: str = "promote"  # promote | bool | first | attr | sum (integers widen to int64)

    def attr_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.attrs)


def broadcast(*shapes: Shape) -> Shape:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"shapes {list(map(list, shapes))} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def norm_dim(d: int, rank: int) -> int:
    if not -rank <= d < max(rank, 1):
        raise ShapeError(f"dim {d} out of range for rank {rank}")
    return d % rank if rank else 0


def reduce_shape(shapes, a):
    (s,) = shapes
    dims = {norm_dim(d, len(s)) for d in a["dims"]}
    if a["keepdim"]:
        return tuple(1 if i in dims else n for i, n in enumerate(s))
    return tuple(n for i, n in enumerate(s) if i not in dims)


def matmul_shape(shapes, a):
    x, y = shapes
    if len(x) < 1 or len(y) < 1:
        raise ShapeError("matmul needs operands of rank >= 1")
    x2 = x if len(x) > 1 else (1,) + x
    y2 = y if len(y) > 1 else y + (1,)
    if x2[-1] != y2[-2]:
        raise ShapeError(f"matmul: inner sizes differ ({list(x)} @ {list(y)})")
    out = broadcast(x2[:-2], y2[:-2]) + (x2[-2], y2[-1])
    if len(x) == 1:
        out = out[:-2] + out[-1:]
    if len(y) == 1:
        out = out[:-1]
    return out


def transpose_shape(shapes, a):
    (s,) = shapes
    d0, d1 = norm_dim(a["dim0"], len(s)), norm_dim(a["dim1"], len(s))
    out = list(s)
    out[d0], out[d1] = out[d1], out[d0]
    return tuple(out)


def permute_shape(shapes, a):
    (s,) = shapes
    if sorted(norm_dim(d, len(s)) for d in a["dims"]) != list(range(len(s))):
        raise ShapeError(f"permute dims {list(a['dims'])} are not a permutation of rank {len(s)}")
    return tuple(s[d] for d in a["dims"])


def reshape_shape(shapes, a):
    (s,) = shapes
    if math.prod(s) != math.prod(a["shape"]):
        raise ShapeError(f"cannot reshape {list(s)} to {list(a['shape'])}")
    return tuple(a["shape"])


def expand_shape(shapes, a):
    (s,) = shapes
    out = tuple(a["shape"])
    if broadcast(s, out) != out:
        raise ShapeError(f"cannot expand {list(s)} to {list(out)}")
    return out


def cat_shape(shapes, a):
    x, y = shapes
    d = norm_dim(a["dim"], len(x))
    if len(x) != len(y) or x[:d] + x[d + 1:] != y[:d] + y[d + 1:]:
        raise ShapeError(f"cat: {list(x)} and {list(y)} differ outside dim {a['dim']}")
    return x[:d] + (x[d] + y[d],) + x[d + 1:]


def slice_shape(shapes, a):
    (s,) = shapes
    d = norm_dim(a["dim"], len(s))
    n = len(range(a["start"], min(a["end"], s[d]), a["step"]))
    return s[:d] + (n,) + s[d + 1:]


def repeat_shape(shapes, a):
    (s,) = shapes
    d = norm_dim(a["dim"], len(s))
    return s[:d] + (s[d] * a["repeats"],) + s[d + 1:]


def same_shape(shapes, a):
    return broadcast(*shapes)


def first_shape(shapes, a):
    return shapes[0]


def sdpa_shape(shapes, a):
    q, k, v = shapes[:3]
    if q[-1] != k[-1] or k[-2] != v[-2]:
        raise ShapeError(f"sdpa: q {list(q)}, k {list(k)}, v {list(v)} do not agree")
    if gqa(q, k, v):  # grouped-query attention: k and v's heads serve groups of q's heads
        k, v = (x[:-3] + (q[-3],) + x[-2:] for x in (k, v))
    batch = broadcast(q[:-2], k[:-2], v[:-2])
    if len(shapes) > 3:  # the mask's batch dims broadcast with q, k and v's (as the primitive form does)
        m = shapes[3]
        if broadcast(m[-2:], (q[-2], k[-2])) != (q[-2], k[-2]):
            raise ShapeError(f"sdpa: mask {list(m)} does not broadcast to the scores {[q[-2], k[-2]]}")
        batch = broadcast(batch, m[:-2])
    return batch + (q[-2], v[-1])


def conv2d_shape(shapes, a):
    x, w, b = shapes
    if len(x) != 4 or len(w) != 4 or x[1] != w[1] * a["groups"] or w[0] % a["groups"] or len(b) not in (0, 1):
        raise ShapeError(f"conv2d: input {list(x)}, weight {list(w)}, groups {a['groups']} do not agree")
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1
           for n, k, s, p, d in zip(x[2:], w[2:], a["stride"], a["padding"], a["dilation"])]
    if min(out) < 1:
        raise ShapeError(f"conv2d: kernel {list(w[2:])} larger than the padded input {list(x[2:])}")
    return (x[0], w[0], *out)


def upsample_shape(shapes, a):
    (x,) = shapes
    if len(x) != 4 or len(a["size"]) != 2 or min(a["size"]) < 1:
        raise ShapeError(f"upsample_bilinear2d: input {list(x)} is not [N, C, H, W] or size {list(a['size'])} is not 2 sizes")
    return (*x[:-2], *a["size"])


def max_pool2d_shape(shapes, a):
    (x,) = shapes
    if len(x) not in (3, 4):
        raise ShapeError(f"max_pool2d: input {list(x)} is not [N,] C, H, W")
    out = []
    for n, k, s, p, d in zip(x[-2:], a["kernel"], a["stride"], a["padding"], a["dilation"]):
        span = n + 2 * p - d * (k - 1) - 1
        size = -(-span // s) + 1 if a["ceil"] else span // s + 1
        if a["ceil"] and (size - 1) * s >= n + p:  # torch's: the last window starts inside the input
            size -= 1
        if size < 1 or 2 * p > k:
            raise ShapeError(f"max_pool2d: kernel {list(a['kernel'])}, padding {list(a['padding'])} do not fit "
                             f"the input {list(x[-2:])}")
        out.append(size)
    return (*x[:-2], *out)


def conv2d_grad_shape(wrt: str):
    """The shape of conv2d's gradient with respect to `wrt` ("input" or "weight"): the attribute
    `shape`, checked against the output gradient's (operand 0) and the other operand's."""
    def shape(shapes, a):
        grad, other = shapes
        x, w = (tuple(a["shape"]), other) if wrt == "input" else (other, tuple(a["shape"]))
        if len(grad) != 4 or conv2d_shape([x, w, ()], a) != tuple(grad):
            raise ShapeError(f"conv2d's {wrt} gradient: output gradient {list(grad)} does not fit input {list(x)},"
                             f" weight {list(w)}")
        return tuple(a["shape"])
    return shape


def embedding_grad_shape(shapes, a):
    grad, ids = shapes
    if tuple(grad[:-1]) != tuple(ids) or not grad:
        raise ShapeError(f"embedding's gradient: gradient {list(grad)} does not fit ids {list(ids)}")
    return (a["rows"], grad[-1])


def linear_shape(shapes, a):
    x, w, b = shapes
    return matmul_shape([x, w[::-1]], a)


def embedding_shape(shapes, a):
    weight, ids = shapes
    if len(weight) != 2:
        raise ShapeError(f"embedding: the weight must be a matrix [rows, dim], got {list(weight)}")
    return tuple(ids) + (weight[1],)


def gather_shape(shapes, a):
    source, index = shapes
    if len(source) != len(index) or not -len(source) <= a["dim"] < len(source) or any(
            i > n for k, (n, i) in enumerate(zip(source, index)) if k != a["dim"] % len(source)):
        raise ShapeError(f"gather along {a['dim']}: index {list(index)} does not fit {list(source)}")
    return tuple(index)


def leaf_shape(shapes, a):
    return tuple(a.get("shape", ()))


def _scalar_reference(tensors, a):
    return torch.tensor(a["value"], dtype=torch.float64)


COMPARISONS = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})  # pointwise ops with a bool result
INTEGERS = frozenset({"int64", "int32"})

OPS: dict[str, OpDef] = {}


def _op(name, group, arity, attrs, shape, flops, reference, dtype="promote"):
    OPS[name] = OpDef(name, group, arity, tuple(attrs), shape, flops, reference, dtype)


_DIMS = [("dims", "ints"), ("keepdim", "bool")]

# sources
_op("input", "source", 0, [("name", "str")], leaf_shape, 0, None, "attr")
_op("const", "source", 0, [("value", "float")], leaf_shape, 0, _scalar_reference, "attr")
# pointwise: unary
for _name, _flops, _fn in [
    ("exp", 4, torch.exp), ("log", 4, torch.log), ("tanh", 6, torch.tanh), ("erf", 8, torch.erf),
    ("cos", 6, torch.cos), ("sin", 6, torch.sin), ("floor", 1, torch.floor),
    ("log1p", 6, torch.log1p), ("expm1", 6, torch.expm1),
    ("relu", 1, torch.relu), ("sigmoid", 6, torch.sigmoid), ("neg", 1, torch.neg),
    ("abs", 1, torch.abs), ("sqrt", 2, torch.sqrt), ("rsqrt", 2, torch.rsqrt),
    ("silu", 6, F.silu), ("gelu", 10, F.gelu), ("gelu_tanh", 12, lambda x: F.gelu(x, approximate="tanh")),
]:
    _op(_name, "pointwise", 1, [], same_shape, _flops, lambda t, a, fn=_fn: fn(t[0]))
_op("cast", "pointwise", 1, [("dtype", "str")], same_shape, 1,
    lambda t, a: t[0].to(getattr(torch, a["dtype"])), "attr")
# pointwise: binary and ternary
for _name, _fn in [("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div),
                   ("maximum", torch.maximum), ("pow", torch.pow)]:
    _op(_name, "pointwise", 2, [], same_shape, 1 if _name != "pow" else 4, lambda t, a, fn=_fn: fn(t[0], t[1]))
for _name, _fn in [("gt", torch.gt), ("ge", torch.ge), ("lt", torch.lt), ("le", torch.le),
                   ("eq", torch.eq), ("ne", torch.ne)]:
    _op(_name, "pointwise", 2, [], same_shape, 1, lambda t, a, fn=_fn: fn(t[0], t[1]), "bool")
_op("where", "pointwise", 3, [], same_shape, 1, lambda t, a: torch.where(t[0].bool(), t[1], t[2]))
# reductions (dims are stored negative, so rules are rank-agnostic)
_op("sum", "reduction", 1, _DIMS, reduce_shape, 1, lambda t, a: torch.sum(t[0], a["dims"], a["keepdim"]), "sum")
_op("mean", "reduction", 1, _DIMS, reduce_shape, 1, lambda t, a: torch.mean(t[0], a["dims"], a["keepdim"]))
_op("amax", "reduction", 1, _DIMS, reduce_shape, 1, lambda t, a: torch.amax(t[0], a["dims"], a["keepdim"]))
# layout: views, lowered to index maps
_op("transpose", "layout", 1, [("dim0", "int"), ("dim1", "int")], transpose_shape, 0,
    lambda t, a: t[0].transpose(a["dim0"], a["dim1"]), "first")
_op("permute", "layout", 1, [("dims", "ints")], permute_shape, 0,
    lambda t, a: t[0].permute(a["dims"]), "first")
_op("reshape", "layout", 1, [("shape", "ints")], reshape_shape, 0,
    lambda t, a: t[0].reshape(a["shape"]), "first")
_op("expand", "layout", 1, [("shape", "ints")], expand_shape, 0,
    lambda t, a: t[0].expand(a["shape"]), "first")
# each element `repeats` times in a row along `dim` (a head repeat: grouped-query attention's K and V)
_op("repeat_interleave", "layout", 1, [("dim", "int"), ("repeats", "int")], repeat_shape, 0,
    lambda t, a: t[0].repeat_interleave(a["repeats"], a["dim"]), "first")
_op("slice", "layout", 1, [("dim", "int"), ("start", "int"), ("end", "int"), ("step", "int")], slice_shape, 0,
    lambda t, a: t[0][(slice(None),) * (a["dim"] % t[0].dim()) + (slice(a["start"], a["end"], a["step"]),)],
    "first")
# concatenation along one dim (a negative index, as every dim attribute): each element from one operand
_op("cat", "concat", 2, [("dim", "int")], cat_shape, 0, lambda t, a: torch.cat([t[0], t[1]], a["dim"]))
# row composites: a reduction plus its re-broadcast epilogue, one kernel each
_op("softmax", "row", 1, [("dim", "int")], first_shape, 7, lambda t, a: torch.softmax(t[0], a["dim"]))
_op("log_softmax", "row", 1, [("dim", "int")], first_shape, 7, lambda t, a: torch.log_softmax(t[0], a["dim"]))
# (per element, layer_norm: the mean's add, the centring, the square and its sum, the scale, the
# weight, the bias: 7, below its decomposition into mean, sub, rms_norm and add (1 + 1 + 5 + 1))
_op("layer_norm", "row", 3, [("ndim", "int"), ("eps", "float")], first_shape, 7,
    lambda t, a: F.layer_norm(t[0], t[0].shape[-a["ndim"]:], t[1].expand(t[0].shape[-a["ndim"]:]),
                              t[2].expand(t[0].shape[-a["ndim"]:]), a["eps"]))
_op("rms_norm", "row", 2, [("ndim", "int"), ("eps", "float")], first_shape, 5,
    lambda t, a: F.rms_norm(t[0], t[0].shape[-a["ndim"]:], t[1].expand(t[0].shape[-a["ndim"]:]), a["eps"]))
# rows of a [rows, dim] matrix picked by integer indices of any shape (torch's embedding lookup)
_op("embedding", "gather", 2, [], embedding_shape, 0, lambda t, a: F.embedding(t[1], t[0]), "first")
# torch.gather: out[..., i, ...] = source[..., index[..., i, ...], ...] along `dim`
_op("gather", "gather", 2, [("dim", "int")], gather_shape, 0, lambda t, a: torch.gather(t[0], a["dim"], t[1]),
    "first")
# library calls
_op("matmul", "library", 2, [], matmul_shape, 2, lambda t, a: torch.matmul(t[0], t[1]))
_op("linear", "library", 3, [], linear_shape, 2, lambda t, a: F.linear(t[0], t[1], t[2]))
# linears with an activation, or a product by a tensor of the result's shape, in oneDNN's epilogue
# (rules/onednn.rules, CPU only; cpu_linear.py): elsewhere these run as written
_op("linear_silu", "library", 3, [], linear_shape, 2, lambda t, a: F.silu(F.linear(t[0], t[1], t[2])))
_op("linear_gelu_tanh", "library", 3, [], linear_shape, 2,
    lambda t, a: F.gelu(F.linear(t[0], t[1], t[2]), approximate="tanh"))
_op("linear_mul", "library", 4, [], lambda s, a: linear_shape(s[:3], a), 2,
    lambda t, a: F.linear(t[0], t[1], t[2]) * t[3])
_CONV = [("stride", "ints"), ("padding", "ints"), ("dilation", "ints"), ("groups", "int")]
_op("conv2d", "library", 3, _CONV, conv2d_shape, 2, library.conv2d)
# gradients that AOTAutograd's backward graphs hold (convolution_backward's outputs, one op each;
# the bias's is a sum), and an embedding's weight gradient (rows of zeros, each id's gradient added)
_op("conv2d_input_grad", "library", 2, [("shape", "ints")] + _CONV, conv2d_grad_shape("input"), 2,
    library.conv2d_input_grad, "first")
_op("conv2d_weight_grad", "library", 2, [("shape", "ints")] + _CONV, conv2d_grad_shape("weight"), 2,
    library.conv2d_weight_grad, "first")
_op("embedding_grad", "library", 2, [("rows", "int"), ("padding_idx", "int"), ("scale", "bool")],
    embedding_grad_shape, 1, library.embedding_grad, "first")
# overlapping or padded max pooling (windows that tile the input are a reshape and an amax), and
# a running sum (transformers' position ids from the padding mask)
_POOL = [("kernel", "ints"), ("stride", "ints"), ("padding", "ints"), ("dilation", "ints"), ("ceil", "bool")]
_op("max_pool2d", "library", 1, _POOL, max_pool2d_shape, 1, library.max_pool2d, "first")
# training's max_pool2d_with_indices: the values (above) and, apart, where each came from (flat
# positions in its plane, dtype int64); the gradient sends each output's gradient to that position
_op("max_pool2d_indices", "library", 1, _POOL + [("dtype", "str")], max_pool2d_shape, 1,
    library.max_pool2d_indices, "attr")
_op("max_pool2d_grad", "library", 3, _POOL, lambda shapes, a: tuple(shapes[1]), 1, library.max_pool2d_grad, "first")
_op("cumsum", "library", 1, [("dim", "int")], same_shape, 1, lambda t, a: torch.cumsum(t[0], a["dim"]), "first")
# bilinear resampling of [N, C, H, W] to a size (BEiT's relative position bias table)
_op("upsample_bilinear2d", "library", 1, [("size", "ints"), ("align_corners", "bool")], upsample_shape, 8,
    lambda t, a: F.interpolate(t[0], size=a["size"], mode="bilinear", align_corners=a["align_corners"]), "first")
_op("sdpa", "library", 3, [("scale", "float"), ("causal", "bool")], sdpa_shape, 4, library.sdpa)
_op("sdpa_mask", "library", 4, [("scale", "float"), ("causal", "bool")], sdpa_shape, 4, library.sdpa)
# training's fused attention (flash.py): output and logsumexp of one call; the gradient of q, k or v
# (`which`) of (dout, q, k, v, out, lse[, mask]) of one backward call (steps.py makes each call once);
# outputs and gradients [B, S, H, D] as the kernels lay them out (capture permutes them back)
_FUSED = [("scale", "float"), ("causal", "bool")]
_heads_last = lambda shape: (shape[0], shape[2], shape[1], shape[3])  # noqa: E731
for _mask in ("", "_mask"):
    _n = 3 + bool(_mask)
    _op("sdpa_fwd" + _mask, "library", _n, _FUSED, lambda shapes, a: _heads_last(sdpa_shape(shapes, a)), 4,
        lambda t, a: flash.reference(t, a)[0].transpose(1, 2))
    _op("sdpa_lse" + _mask, "library", _n, _FUSED + [("dtype", "str")], lambda shapes, a: tuple(shapes[0][:3]), 0,
        lambda t, a: flash.reference(t, a)[1], "attr")
    _op("sdpa_grad" + _mask, "library", _n + 3, _FUSED + [("which", "int")],
        lambda shapes, a: _heads_last(shapes[1 + a["which"]]), 10,
        lambda t, a: flash.reference_grad(t, a)[a["which"]].transpose(1, 2), "first")
_op("softmax_attention", "library", 4, [("scale", "float"), ("causal", "bool")], sdpa_shape, 4,
    library.softmax_attention)
# functional collectives (torch.distributed._functional_collectives as Dynamo captures them): each
# returns a tensor that `wait_tensor` must wait for before it is read; `group` names the process group
_c10d = getattr(torch.ops, "_c10d_functional", None)
_op("all_reduce", "collective", 1, [("reduce", "str"), ("group", "str")], first_shape, 0,
    lambda t, a: _c10d.all_reduce(t[0], a["reduce"], a["group"]), "first")
_op("all_gather", "collective", 1, [("group_size", "int"), ("group", "str")],
    lambda s, a: (s[0][0] * a["group_size"],) + tuple(s[0][1:]), 0,
    lambda t, a: _c10d.all_gather_into_tensor(t[0], a["group_size"], a["group"]), "first")
_op("reduce_scatter", "collective", 1, [("reduce", "str"), ("group_size", "int"), ("group", "str")],
    lambda s, a: (s[0][0] // a["group_size"],) + tuple(s[0][1:]), 0,
    lambda t, a: _c10d.reduce_scatter_tensor(t[0], a["reduce"], a["group_size"], a["group"]), "first")
_op("wait_tensor", "collective", 1, [], first_shape, 0, lambda t, a: _c10d.wait_tensor(t[0]), "first")
# kernel boundary: the operand is computed inside the consumer's kernel (value: identity)
_op("inline", "boundary", 1, [], first_shape, 0, lambda t, a: t[0], "first")
# anything else: run by ATen, named in the plan's fallbacks
_op("extern", "extern", -1, [("target", "str")], leaf_shape, 0, None, "attr")


CALLS = frozenset({"library", "collective", "extern"})  # groups run as calls on whole tensors


def operand_in_memory(group: str, position: int) -> bool:
    """Whether an op of this group needs its operand at `position` materialised, never
    computed inside its kernel: a call's operands are whole tensors, and a gather
    indexes its matrix (operand 0) by row number."""
    return group in CALLS or (group == "gather" and position == 0)


def get(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}") from None


def group_of(name: str) -> str:
    return get(name).group
