"""Capture: a torch program -> functional ATen graph -> Graph IR.

torch.export (non-strict) gives a functional ATen graph with shapes and
dtypes; `run_decompositions({})` functionalises it while keeping composites
(softmax, layer_norm, gelu, silu, linear, sdpa) whole, because decomposing
them is the rules' job.  Each ATen op is translated onto the op table by the
converters' tables (converters.py; reads by index: indexing.py; backward
graphs' own ops: gradients.py; convnets': convnets.py; torch's encoder layer: encoder.py); anything
they lack becomes an `extern` node run by ATen.  With symbolic.py (a Dynamo graph of symbolic
sizes, exported once), the only module that imports torch.export / torch.fx.
"""
from __future__ import annotations

import inspect
import itertools
import math
import operator
import types
import warnings

import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import ops
from .errors import CaptureError
from .sources import failed_at, keep_stack_traces, user_line
from .converters import CONVERTERS
from .decompose import missing
from .convnets import CONVNETS
from .encoder import ENCODER
from .forms import FORMS
from .gradients import GRADIENTS
from .indexing import INDEXING
from .graph import TENSOR_SLOT, WEAK, Bound, ExternCall, Graph, Literal, Node, input_node

aten = torch.ops.aten
TABLE = CONVERTERS | INDEXING | GRADIENTS | CONVNETS | FORMS | ENCODER  # every ATen op capture maps onto the op table
MISSING = missing(TABLE)  # torch's core decompositions of the ops TABLE lacks (decompose.py)


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_aten(module: torch.nn.Module, example_inputs, dynamic_shapes=None) -> torch.export.ExportedProgram:
    fn = module.fn if isinstance(module, _Wrap) else module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Strict (Dynamo) capture records the user's source lines; a graph that
        # Dynamo already captured (torch.compile backend) must not re-enter Dynamo,
        # nor may any capture made while Dynamo compiles (a backend's own compile,
        # such as the first CPU calibration: strict export there crashed the process).
        program = None
        if not isinstance(fn, torch.fx.GraphModule) and torch._guards.TracingContext.try_get() is None:
            try:
                program = torch.export.export(module, tuple(example_inputs), strict=True,
                                              dynamic_shapes=dynamic_shapes)
            except Exception:
                program = None
        if program is None:
            try:  # outside Dynamo's tracing context: its fake values hold guards on Dynamo's own arguments
                with torch._guards.tracing(None):
                    program = torch.export.export(module, tuple(example_inputs), strict=False,
                                                  dynamic_shapes=dynamic_shapes)
            except Exception as exc:  # torch's own message names the failing construct; the user's line where it is
                raise CaptureError(f"torch.export could not capture the program{failed_at(exc)}: {exc}") from exc
        if _functional_already(program):
            return program
        decomposed = program.run_decompositions(MISSING)
        keep_stack_traces(program.graph_module, decomposed.graph_module)
        return decomposed


def with_ambient_autocast(gm):
    """A graph compiled inside `with torch.autocast(...)` around the compiled model: Dynamo hands it
    over without the region (the state is its guard's), so each op's traced dtype is autocast's while
    its operands are not cast (every linear then an ATen fallback, "torch's result type differs").
    The region is written into the graph as Dynamo writes one the model opens itself, so that
    capture exports its casts.  (AOTAutograd's training graphs trace the state themselves.)"""
    regions = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
               if torch.is_autocast_enabled(device)]
    if not regions:
        return gm
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    for device, dtype in regions:
        with graph.inserting_before(first):
            region = graph.call_function(_enter_autocast, (device, dtype, True, torch.is_autocast_cache_enabled()))
        with graph.inserting_before(output):
            graph.call_function(_exit_autocast, (region,))
    gm.recompile()
    return gm


def _functional_already(program) -> bool:
    """The exported graph is one `run_decompositions({})` would only rename: no input or buffer
    mutated, and every op one the converters map or one decomposition keeps whole (functional,
    without an implicit decomposition: it runs through ATen either way); no in-place op, no
    higher-order op such as an autocast region.  Skipping it saves 0.15-0.5 s of each capture
    (it traces the program again)."""
    if any(spec.kind.name != "USER_OUTPUT" for spec in program.graph_signature.output_specs):
        return False
    return all(n.op != "call_function" or n.target in TABLE or n.target is operator.getitem or _kept_whole(n.target)
               for n in program.graph_module.graph.nodes)


def _kept_whole(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable or target in MISSING:
        return False
    if torch.Tag.maybe_aliasing_or_mutating in target.tags or target is aten.native_batch_norm.default:
        return False  # (export always decomposes these: native_batch_norm writes its running statistics
        # though its schema says it does not, as torch._decomp._should_decompose_because_unsafe_op notes)
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # an overload the dispatcher does not know: decomposition decides
        return False


def _exported_already(fn):
    """An AOTAutograd graph (training's forward and backward) as the ExportedProgram export would
    make of it, without tracing it again (0.4-0.9 s a graph): it is a functional ATen graph with
    every value's fake tensor in its metadata already.  Only where export would change nothing
    (as `_functional_already`: every op one the converters map or one kept whole, none mutating,
    static sizes, tensors in and out); None otherwise, and capture exports it."""
    if not isinstance(fn, torch.fx.GraphModule):
        return None
    from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument
    nodes = list(fn.graph.nodes)
    for n in nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and not (isinstance(val, torch.Tensor) and all(
                isinstance(d, int) for d in (*val.shape, *val.stride()))):
            return None
        if n.op == "call_function" and n.target is not operator.getitem and not (
                isinstance(n.target, torch._ops.OpOverload) and (n.target in TABLE or _kept_whole(n.target))
                and not n.target._schema.is_mutable and "val" in n.meta):
            return None
        if n.op in ("call_module", "call_method", "get_attr"):
            return None
    outputs = nodes[-1].args[0]
    if not isinstance(outputs, (tuple, list)) or any(
            isinstance(o, torch.fx.Node) and not isinstance(o.meta.get("val"), torch.Tensor) for o in outputs):
        return None
    specs = [InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None) for n in nodes if n.op == "placeholder"]
    out_specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name if isinstance(o, torch.fx.Node) else ""),
                            None) for o in outputs]
    return types.SimpleNamespace(
        graph_module=fn, graph_signature=types.SimpleNamespace(input_specs=specs, output_specs=out_specs),
        state_dict={}, constants={},
        call_spec=types.SimpleNamespace(out_spec=pytree.tree_structure(type(outputs)(range(len(outputs))))))


def capture(fn, example_inputs) -> tuple[Graph, str]:
    """Returns the Graph IR and the ATen graph's text."""
    module = fn if isinstance(fn, torch.nn.Module) else _Wrap(fn)
    # a Dynamo graph of symbolic sizes brings its export at these sizes (symbolic.py)
    program = getattr(fn, "egc_exported", None) or _exported_already(fn) or export_aten(module, example_inputs)
    gm = program.graph_module
    kinds = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    env: dict[str, object] = {}
    inputs, bound, where = [], {}, {}
    user_names = _parameter_names(fn, len(example_inputs))
    placeholder_names: dict[str, str] = {}
    user_index = 0
    device = next((t.device for t in [*example_inputs, *program.state_dict.values()] if isinstance(t, torch.Tensor)),
                  None)
    mutated = {spec.target for spec in program.graph_signature.output_specs if spec.kind.name == "USER_INPUT_MUTATION"}
    orders: dict[str, tuple] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            val = fx_node.meta["val"]
            spec = kinds[fx_node.name]
            user = spec.kind.name == "USER_INPUT"
            name = user_names[user_index] if user else spec.target.replace(".", "_")
            dims = storage_order(val) if user and fx_node.name not in mutated else None
            shape = tuple(val.shape) if dims is None else tuple(val.shape[d] for d in dims)
            node = input_node(name, shape, str(val.dtype).removeprefix("torch."))
            if user:
                user_index += 1
            else:
                bound[name] = _bound(module, program, spec.target, device)
            inputs.append(node)
            env[fx_node.name] = node
            if dims is not None:
                orders[name] = (dims, tuple(val.shape))
                env[fx_node.name] = Node.make("permute", (node,), {"dims": tuple(dims.index(d) for d in range(len(dims)))})
            placeholder_names[fx_node.name] = name
        elif fx_node.op == "call_function":
            if "val" not in fx_node.meta and not fx_node.users:
                continue  # a check with no result (e.g. _assert_tensor_metadata)
            env[fx_node.name] = _convert(fx_node, env, where)
        elif fx_node.op == "output":
            outs = tuple(env[a.name] if isinstance(a, torch.fx.Node) else Literal(a) for a in fx_node.args[0])
            transposed = {id(env[a.name]): tuple(a.meta["val"].stride()) for a in fx_node.args[0]
                          if isinstance(a, torch.fx.Node) and storage_order(a.meta.get("val")) is not None}
    outs, mutations, leaves = _split_outputs(program, outs, placeholder_names)
    strides = {i: transposed[id(n)] for i, n in enumerate(outs[:len(outs) - len(mutations)]) if id(n) in transposed}
    graph = Graph(inputs, outs, bound, where, mutations, (program.call_spec.out_spec, leaves), orders=orders,
                  output_strides=strides)
    return graph, gm.code.strip()


def storage_order(val) -> tuple | None:
    """The dims of a tensor that is a permutation of a dense one (a transpose), outermost in
    memory first; None where it is contiguous already, or has gaps, an offset or repeats."""
    if (not isinstance(val, torch.Tensor) or val.dim() < 2 or val.is_contiguous() or val.storage_offset() != 0
            or not all(isinstance(n, int) for n in (*val.shape, *val.stride()))):
        return None
    dims = tuple(sorted(range(val.dim()), key=lambda d: (-val.stride(d), d)))
    expected = 1
    for d in reversed(dims):
        if val.shape[d] != 1:
            if val.stride(d) != expected:
                return None
            expected *= val.shape[d]
    return dims


def _bound(module: torch.nn.Module, program, target: str, device) -> Bound:
    """Where a parameter or buffer input comes from: read from the module at
    call time when its attribute path leads to the captured tensor, else the
    captured constant, on the device the program runs on (a model on the GPU
    may make `torch.tensor(4)` on the CPU: eager mixes the two, our kernels do not)."""
    value = program.state_dict[target] if target in program.state_dict else program.constants[target]
    live = Bound(module, target)
    try:
        if live.get() is value:
            return live
    except AttributeError:
        pass
    if isinstance(value, torch.Tensor) and device is not None:
        value = value.to(device)
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


def _convert(fx_node, env, where) -> object:
    if fx_node.target is operator.getitem:
        seq, index = fx_node.args
        return env[seq.name][index]
    args = [_arg(a, env) for a in fx_node.args]
    kwargs = {k: _arg(v, env) for k, v in fx_node.kwargs.items()}
    converter = TABLE.get(fx_node.target)
    result, reason = None, "outside the vocabulary"
    if any(isinstance(a, float) and math.isnan(a) for a in [*args, *kwargs.values()]):
        converter, reason = None, "a NaN constant (the e-graph's numbers cannot hold NaN)"
    if fx_node.target in STORAGE_VIEWS and not _dense(fx_node.args[0]):
        converter, reason = None, "a view by strides of a tensor not dense in its storage"
    if converter is not None:
        reason = "an argument or form the op table does not model"
        try:
            result = converter(*args, **kwargs)
        except ops.ShapeError as exc:  # (sdpa whose k and v disagree, which torch's CPU kernel takes)
            result, reason = None, f"{reason}: {exc}"
        except (TypeError, ValueError, KeyError, ArithmeticError):
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


STORAGE_VIEWS = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_scatter.default)


def _dense(fx_node) -> bool:
    """A value laid out as its own contiguous storage: strides address it as the op table's tensors."""
    val = fx_node.meta.get("val") if isinstance(fx_node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0


def _as_torch_types(node: Node, val) -> Node | None:
    """The converted node with torch's result dtype and shape, or None (run it
    through ATen) where the op table's rules cannot give them.  Arithmetic
    operands are cast to the result dtype first, as torch computes in it:
    `int64 * 0.5` is float32 arithmetic, and so is `int64 / 2`, whose rewrite
    to `* 0.5` then keeps its type."""
    if not isinstance(val, torch.Tensor):
        return node
    want = str(val.dtype).removeprefix("torch.")
    if node.group == "pointwise" and node.op not in ops.COMPARISONS and node.op != "cast":
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


_CALL_ORDER = itertools.count()  # ExternCall.order: increasing in the order capture meets calls


def _extern(fx_node, env, reason: str) -> object:
    tensors, template, dense = [], [], []

    def freeze(a):
        if isinstance(a, torch.fx.Node):
            tensors.append(env[a.name])
            dense.append(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_contiguous())
            return TENSOR_SLOT
        if isinstance(a, (list, tuple)):
            return ("__list__",) + tuple(freeze(x) for x in a)
        return a

    template = tuple(freeze(a) for a in fx_node.args)
    kwargs = tuple((k, freeze(v)) for k, v in fx_node.kwargs.items())
    val = fx_node.meta["val"]
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    results, pending = [], {}  # one dict shared by the outputs of one call (ExternCall.pending)
    order = next(_CALL_ORDER)
    for i, v in enumerate(vals):
        if v is None:  # an output the call does not compute (convolution_backward's unasked-for gradients)
            results.append(None)
            continue
        call = ExternCall(fx_node.target, template, kwargs, tuple(v.shape),
                          str(v.dtype).removeprefix("torch."),
                          i if isinstance(val, (list, tuple)) else None, user_line(fx_node), reason=reason,
                          pending=pending, dense=tuple(dense), order=order)
        results.append(Node.make("extern", tuple(tensors), {"target": call}, shape=call.shape, dtype=call.dtype))
    return results if isinstance(val, (list, tuple)) else results[0]


def retarget(gm: torch.fx.GraphModule, targets, replacement) -> torch.fx.GraphModule:
    """The graph with every call of a function in `targets` calling `replacement`
    instead (same arguments), edited in place."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = replacement
    gm.recompile()
    return gm
