"""Capture: a torch program -> functional ATen graph -> Graph IR.

torch.export (non-strict) gives a functional ATen graph with shapes and
dtypes; `run_decompositions({})` functionalises it while keeping composites
(softmax, layer_norm, gelu, silu, linear, sdpa) whole, because decomposing
them is the rules' job.  Each ATen op is translated onto the op table by the
CONVERTERS table below; anything it lacks becomes an `extern` node run by
ATen.  This is the only module that imports torch.export / torch.fx.
"""
from __future__ import annotations

import inspect
import math
import operator
import os
import warnings

import torch
import torch.fx

from . import ops
from .errors import CaptureError
from .graph import TENSOR_SLOT, WEAK, Bound, ExternCall, Graph, Literal, Node, const, input_node

aten = torch.ops.aten
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))  # torch's frames are not the user's source


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_aten(module: torch.nn.Module, example_inputs) -> torch.export.ExportedProgram:
    fn = module.fn if isinstance(module, _Wrap) else module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Strict (Dynamo) capture records the user's source lines; a graph that
        # Dynamo already captured (torch.compile backend) must not re-enter Dynamo.
        program = None
        if not isinstance(fn, torch.fx.GraphModule):
            try:
                program = torch.export.export(module, tuple(example_inputs), strict=True)
            except Exception:
                program = None
        if program is None:
            try:
                program = torch.export.export(module, tuple(example_inputs), strict=False)
            except Exception as exc:  # torch's own message names the failing construct
                raise CaptureError(f"torch.export could not capture the program: {exc}") from exc
        return program.run_decompositions({})


def capture(fn, example_inputs) -> tuple[Graph, str]:
    """Returns the Graph IR and the ATen graph's text."""
    module = fn if isinstance(fn, torch.nn.Module) else _Wrap(fn)
    program = export_aten(module, example_inputs)
    gm = program.graph_module
    kinds = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    env: dict[str, object] = {}
    inputs, bound, where = [], {}, {}
    user_names = _parameter_names(fn, len(example_inputs))
    placeholder_names: dict[str, str] = {}
    user_index = 0
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            val = fx_node.meta["val"]
            spec = kinds[fx_node.name]
            name = user_names[user_index] if spec.kind.name == "USER_INPUT" else spec.target.replace(".", "_")
            node = input_node(name, tuple(val.shape), str(val.dtype).removeprefix("torch."))
            if spec.kind.name == "USER_INPUT":
                user_index += 1
            else:
                bound[name] = _bound(module, program, spec.target)
            inputs.append(node)
            env[fx_node.name] = node
            placeholder_names[fx_node.name] = name
        elif fx_node.op == "call_function":
            if "val" not in fx_node.meta and not fx_node.users:
                continue  # a check with no result (e.g. _assert_tensor_metadata)
            env[fx_node.name] = _convert(fx_node, env, where)
        elif fx_node.op == "output":
            outs = tuple(env[a.name] if isinstance(a, torch.fx.Node) else Literal(a) for a in fx_node.args[0])
    outs, mutations, leaves = _split_outputs(program, outs, placeholder_names)
    graph = Graph(inputs, outs, bound, where, mutations, (program.call_spec.out_spec, leaves))
    return graph, gm.code.strip()


def _bound(module: torch.nn.Module, program, target: str) -> Bound:
    """Where a parameter or buffer input comes from: read from the module at
    call time when its attribute path leads to the captured tensor, else the
    captured constant."""
    value = program.state_dict[target] if target in program.state_dict else program.constants[target]
    live = Bound(module, target)
    try:
        if live.get() is value:
            return live
    except AttributeError:
        pass
    return Bound(None, target, value)


def _split_outputs(program, outs, placeholder_names):
    """User outputs first, then the new values of mutated inputs and buffers;
    and the leaves of the user's result structure (an index into the outputs,
    or a Literal the program returns as it is)."""
    user, mutated, leaves = [], [], []
    for spec, node in zip(program.graph_signature.output_specs, outs):
        kind = spec.kind.name
        if kind == "USER_OUTPUT" and isinstance(node, Literal):
            leaves.append(node)
        elif kind == "USER_OUTPUT" and isinstance(node, Node):
            leaves.append(len(user))
            user.append(node)
        elif kind == "USER_OUTPUT":
            raise CaptureError(f"the program returns a {type(node).__name__}; compiled programs return tensors, "
                               f"Python scalars, or dicts, lists and tuples of them")
        elif kind == "USER_INPUT_MUTATION":
            mutated.append((placeholder_names[spec.target], node))
        elif kind == "BUFFER_MUTATION":
            mutated.append((spec.target.replace(".", "_"), node))
        else:
            raise CaptureError(f"unsupported program output ({kind.lower()}); only tensors, and in-place "
                               f"updates of inputs and buffers, are supported")
    mutations = [(name, len(user) + i) for i, (name, _) in enumerate(mutated)]
    return tuple(user) + tuple(node for _, node in mutated), mutations, leaves


def _parameter_names(fn, count: int) -> list[str]:
    try:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        params = [p for p in inspect.signature(target).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params][:count]
    except (TypeError, ValueError):
        names = []
    names += [f"arg{i}" for i in range(len(names), count)]
    return names if len(set(names)) == count else [f"arg{i}" for i in range(count)]


def user_line(fx_node) -> str:
    trace = fx_node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and _TORCH_DIR not in lines[i] and _PACKAGE_DIR not in lines[i]:
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
    return f"<no source line> ({fx_node.name})"


def _convert(fx_node, env, where) -> object:
    if fx_node.target is operator.getitem:
        seq, index = fx_node.args
        return env[seq.name][index]
    args = [_arg(a, env) for a in fx_node.args]
    kwargs = {k: _arg(v, env) for k, v in fx_node.kwargs.items()}
    converter = CONVERTERS.get(fx_node.target)
    result, reason = None, "outside the vocabulary"
    if any(isinstance(a, float) and math.isnan(a) for a in [*args, *kwargs.values()]):
        converter, reason = None, "a NaN constant (the e-graph's numbers cannot hold NaN)"
    if converter is not None:
        reason = "an argument or form the op table does not model"
        try:
            result = converter(*args, **kwargs)
        except (ops.ShapeError, TypeError, ValueError, KeyError, ArithmeticError):
            result = None  # a form of the op we do not model (sdpa over size-0 heads...): run it through ATen
    if isinstance(result, Node):
        result = _as_torch_types(result, fx_node.meta.get("val"))
        reason = "torch's result type differs from the op table's"
    if result is None:
        result = _extern(fx_node, env, reason)
    for node in result if isinstance(result, (list, tuple)) else [result]:
        if node is not None:
            where.setdefault(id(node), user_line(fx_node))
    return result


COMPARISONS = {"gt", "ge", "lt", "le", "eq", "ne"}


def _as_torch_types(node: Node, val) -> Node | None:
    """The converted node with torch's result dtype and shape, or None (run it
    through ATen) where the op table's rules cannot give them.  Arithmetic
    operands are cast to the result dtype first, as torch computes in it:
    `int64 * 0.5` is float32 arithmetic, and so is `int64 / 2`, whose rewrite
    to `* 0.5` then keeps its type."""
    if not isinstance(val, torch.Tensor):
        return node
    want = str(val.dtype).removeprefix("torch.")
    if node.group == "pointwise" and node.op not in COMPARISONS and node.op != "cast":
        values = range(1, 3) if node.op == "where" else range(len(node.args))
        args = tuple(Node.make("cast", (a,), {"dtype": want}) if k in values and a.dtype not in (want, WEAK) else a
                     for k, a in enumerate(node.args))
        node = node if args == node.args else Node.make(node.op, args, node.a)
    try:
        same_shape = tuple(int(d) for d in val.shape) == node.shape
    except TypeError:  # symbolic sizes
        same_shape = False
    return node if same_shape and node.dtype == want else None


def _arg(a, env):
    if isinstance(a, torch.fx.Node):
        return env[a.name]
    if isinstance(a, (list, tuple)):
        return [_arg(x, env) for x in a]
    return a


def _extern(fx_node, env, reason: str) -> object:
    tensors, template = [], []

    def freeze(a):
        if isinstance(a, torch.fx.Node):
            tensors.append(env[a.name])
            return TENSOR_SLOT
        if isinstance(a, (list, tuple)):
            return ("__list__",) + tuple(freeze(x) for x in a)
        return a

    template = tuple(freeze(a) for a in fx_node.args)
    kwargs = tuple((k, freeze(v)) for k, v in fx_node.kwargs.items())
    val = fx_node.meta["val"]
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    results, pending = [], {}  # one dict shared by the outputs of one call (ExternCall.pending)
    for i, v in enumerate(vals):
        if v is None:  # an output the call does not compute (convolution_backward's unasked-for gradients)
            results.append(None)
            continue
        call = ExternCall(fx_node.target, template, kwargs, tuple(v.shape),
                          str(v.dtype).removeprefix("torch."),
                          i if isinstance(val, (list, tuple)) else None, user_line(fx_node), reason=reason,
                          pending=pending)
        object.__setattr__(call, "key", f"{fx_node.target}#{id(call):x}")
        results.append(Node.make("extern", tuple(tensors), {"target": call}, shape=call.shape, dtype=call.dtype))
    return results if isinstance(val, (list, tuple)) else results[0]


# ---- converters: ATen op -> Graph IR (return None to fall back to ATen) ----

def _t(x):
    return x if isinstance(x, Node) else const(x)


def _neg_dims(dims, rank):
    if dims is None or dims == []:
        dims = list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(ops.norm_dim(d, rank) - rank for d in dims)) if rank else ()


def _reduce(op):
    def convert(x, dims=None, keepdim=False, dtype=None):
        if dtype is not None:
            return None
        return Node.make(op, (x,), {"dims": _neg_dims(dims, len(x.shape)), "keepdim": bool(keepdim)})
    return convert


def _binary(op):
    def convert(a, b, alpha=1):
        b = _t(b)
        if alpha != 1:
            b = Node.make("mul", (b, const(alpha)))
        return Node.make(op, (_t(a), b))
    return convert


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
    return x if tuple(shape) == x.shape else Node.make("reshape", (x,), {"shape": tuple(shape)})


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


def _cast(x, dtype=None, **kw):
    if dtype is None or set(kw) - {"layout", "device", "pin_memory", "non_blocking", "memory_format"}:
        return None
    name = str(dtype).removeprefix("torch.")
    return x if name == x.dtype else Node.make("cast", (x,), {"dtype": name})


def _layer_norm(x, shape, w=None, b=None, eps=1e-5, cudnn=False):
    return Node.make("layer_norm", (x, w if w is not None else const(1.0), b if b is not None else const(0.0)),
                     {"ndim": len(shape), "eps": float(eps)})


def _rms_norm(x, shape, w=None, eps=None):
    eps = torch.finfo(getattr(torch, x.dtype)).eps if eps is None else eps
    return Node.make("rms_norm", (x, w if w is not None else const(1.0)), {"ndim": len(shape), "eps": float(eps)})


def _softmax(op, internal=False):
    """softmax.int(x, dim, dtype=None) or _softmax(x, dim, half_to_float)."""
    def convert(x, dim, third=None, dtype=None):
        dtype = dtype if internal else (third if third is not None else dtype)
        if (internal and third) or (dtype is not None and str(dtype).removeprefix("torch.") != x.dtype):
            return None
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


def _logical(op):
    """and / or / not over bool tensors, as `where` (exact: no arithmetic); integers: ATen."""
    def convert(a, b=None):
        if not all(isinstance(x, Node) and x.dtype == "bool" for x in (a, b) if x is not None):
            return None
        if op == "not":
            return Node.make("eq", (a, const(0.0)))
        return Node.make("where", (a, b, const(0.0)) if op == "and" else (a, const(1.0), b))
    return convert


def _where(c, a, b):
    return Node.make("where", (c, _t(a), _t(b)))


def _gelu(x, approximate="none"):
    return Node.make("gelu" if approximate == "none" else "gelu_tanh", (x,))


def _div(a, b, rounding_mode=None):
    return None if rounding_mode is not None else Node.make("div", (_t(a), _t(b)))


def _addmm(bias, a, b, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        return None
    return Node.make("add", (Node.make("matmul", (a, b)), bias))


def _linear(x, w, b=None):
    if len(w.shape) == 1:  # x @ w: the library's linear (an addmm with a bias) needs a matrix
        out = Node.make("matmul", (x, w))
        return out if b is None else Node.make("add", (out, b))
    return Node.make("linear", (x, w, b if b is not None else const(0.0)))


def _conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    pair = (lambda v: tuple(v) * (2 // len(v)) if isinstance(v, (list, tuple)) else (v, v))
    if isinstance(padding, str) or len(x.shape) != 4:  # padding="same"/"valid", unbatched input: ATen
        return None
    return Node.make("conv2d", (x, w, b if b is not None else const(0.0)),
                     {"stride": pair(stride), "padding": pair(padding), "dilation": pair(dilation), "groups": groups})


def _fill(value, shape, dtype=None, like=None, **kwargs):
    """A tensor of one value (zeros, ones, full, scalar_tensor, new_zeros...): a constant broadcast
    by an index map, never stored unless it is an output."""
    if set(kwargs) - {"layout", "device", "pin_memory", "memory_format", "requires_grad"} or kwargs.get(
            "requires_grad"):
        return None
    name = str(dtype).removeprefix("torch.") if dtype is not None else (like.dtype if like else "float32")
    if name not in ("float32", "float16", "bfloat16", "float64", "bool") or isinstance(value, complex):
        return None  # integer fills: ATen (generated code computes in floating point)
    scalar = Node.make("cast", (const(value),), {"dtype": name})
    return scalar if not shape else Node.make("expand", (Node.make("reshape", (scalar,), {"shape": (1,) * len(
        shape)}),), {"shape": tuple(int(d) for d in shape)})


def _slice_backward(grad, sizes, dim, start, end, step):
    """The gradient of a slice: the slice's gradient with zeros around it."""
    d = ops.norm_dim(dim, len(sizes))
    start, end, step = slice(start, end, step).indices(sizes[d])
    if step != 1:
        return None
    parts = []
    for length, part in ((start, None), (end - start, grad), (sizes[d] - end, None)):
        if length > 0:
            parts.append(part if part is not None else _fill(0.0, [*sizes[:d], length, *sizes[d + 1:]], like=grad))
    return _cat(parts, d) if parts else grad


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
    aten.where.Scalar: _where,
    aten.transpose.int: _transpose, aten.t.default: lambda x: _transpose(x, 0, 1) if len(x.shape) == 2 else x,
    aten.permute.default: lambda x, dims: Node.make("permute", (x,), {"dims": tuple(
        ops.norm_dim(d, len(x.shape)) for d in dims)}),
    aten.view.default: _reshape, aten._unsafe_view.default: _reshape, aten.reshape.default: _reshape,
    aten.expand.default: _expand, aten.slice.Tensor: _slice, aten.cat.default: _cat, aten.split.Tensor: _split,
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
    aten.linear.default: _linear, aten.conv2d.default: _conv2d,
    aten.addmm.default: _addmm, aten.scaled_dot_product_attention.default: _sdpa,
    aten.var_mean.correction: _var_mean, aten.var.correction: lambda *a, **k: (_var_mean(*a, **k) or [None])[0],
    aten.var_mean.dim: lambda x, dim=None, unbiased=True, keepdim=False: _var_mean(x, dim, int(unbiased), keepdim),
    aten.var.dim: lambda x, dim=None, unbiased=True, keepdim=False: (_var_mean(x, dim, int(unbiased), keepdim)
                                                                     or [None])[0],
    aten.slice_backward.default: _slice_backward,
    aten.select_backward.default: lambda g, sizes, dim, i: _slice_backward(
        _unsqueeze(g, dim), sizes, dim, i % sizes[dim], i % sizes[dim] + 1, 1),
    aten.full.default: lambda size, value, **kw: _fill(value, size, **kw),
    aten.zeros.default: lambda size, **kw: _fill(0.0, size, **kw),
    aten.ones.default: lambda size, **kw: _fill(1.0, size, **kw),
    aten.scalar_tensor.default: lambda value, **kw: _fill(value, (), **kw),
    aten.new_zeros.default: lambda x, size, **kw: _fill(0.0, size, like=x, **kw),
    aten.new_ones.default: lambda x, size, **kw: _fill(1.0, size, like=x, **kw),
    aten.full_like.default: lambda x, value, **kw: _fill(value, x.shape, like=x, **kw),
    aten.zeros_like.default: lambda x, **kw: _fill(0.0, x.shape, like=x, **kw),
    aten.ones_like.default: lambda x, **kw: _fill(1.0, x.shape, like=x, **kw),
    aten.bitwise_and.Tensor: _logical("and"), aten.__and__.Tensor: _logical("and"),
    aten.logical_and.default: _logical("and"), aten.bitwise_or.Tensor: _logical("or"),
    aten.__or__.Tensor: _logical("or"), aten.logical_or.default: _logical("or"),
    aten.bitwise_not.default: _logical("not"), aten.logical_not.default: _logical("not"),
    aten.clamp_min.default: lambda x, m: Node.make("maximum", (x, _t(m))),
    aten.rsub.Scalar: lambda x, other, alpha=1: _binary("sub")(other, x, alpha) if alpha == 1 else None,
    aten.rsub.Tensor: lambda x, other, alpha=1: _binary("sub")(other, x, alpha) if alpha == 1 else None,
    aten.reciprocal.default: lambda x: Node.make("div", (const(1.0), x)),
}
for _name in ["exp", "log", "tanh", "erf", "cos", "sin", "relu", "sigmoid", "neg", "abs", "sqrt", "rsqrt", "silu"]:
    CONVERTERS[getattr(aten, _name).default] = _unary(_name)
for _name in ["add", "sub", "mul", "maximum", "gt", "ge", "lt", "le", "eq", "ne"]:
    for _overload in ("Tensor", "Scalar", "default"):
        if hasattr(getattr(aten, _name), _overload):
            CONVERTERS[getattr(getattr(aten, _name), _overload)] = _binary(_name)


def bind_sizes(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """The graph with its non-tensor arguments (SymInts at capture) replaced by
    this call's values: a static graph over the tensor arguments alone."""
    graph, env = torch.fx.Graph(), {}
    placeholders = iter(args)
    for node in gm.graph.nodes:
        value = next(placeholders) if node.op == "placeholder" else None
        if node.op == "placeholder" and not isinstance(value, torch.Tensor):
            env[node] = value
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph)
