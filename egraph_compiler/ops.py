"""The op vocabulary: one table that every stage keys off.

Capture maps ATen ops onto these names, the rules DSL checks arity and
attributes against it, the e-graph encoding declares one constructor per entry,
the cost model reads its FLOP counts and groups, lowering reads its group, and
the renderers hold one scalar formula per pointwise name.  Adding an op touches
this file (plus a shape function in shapes.py where none fits, and a scalar formula
in each renderer for pointwise ops).

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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import flash, library, shapes
from .shapes import (
    Shape, cat_shape, conv2d_grad_shape, conv2d_shape, embedding_grad_shape, embedding_shape, expand_shape,
    first_shape, gather_shape, leaf_shape, linear_shape, matmul_shape, max_pool2d_shape, permute_shape,
    reduce_shape, repeat_shape, reshape_shape, same_shape, sdpa_shape, slice_shape, transpose_shape,
    upsample_shape)

ShapeError, broadcast, norm_dim = shapes.ShapeError, shapes.broadcast, shapes.norm_dim  # (read as ops.*)
gqa = library.gqa

ATTR_KINDS = ("int", "ints", "float", "bool", "str")


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
