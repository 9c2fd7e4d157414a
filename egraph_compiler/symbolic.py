"""A Dynamo graph with symbolic sizes, exported once: each new size costs a pass of fake
tensors over the exported ATen graph, not another export.

`torch.compile(dynamic=True)` (or Dynamo's automatic dynamic shapes) hands over one graph whose
sizes are symbols.  The plan is made per size (extraction weighs sizes), but the ATen graph
need not be: torch.export with those dimensions dynamic gives one functional ATen graph valid
for every size within its range constraints.  `Symbolic.program(inputs)` is that graph at
these inputs' sizes: each node run once on fake tensors of these shapes (FakeTensorMode, no
data), its shape arithmetic (`sym_size`, `mul` of sizes) folded to ints, its runtime
assertions (`_assert_scalar`) checked, and every tensor node copied with the fake result as
its value: what torch.export would record at these sizes, at a tenth of its cost (two
traces and a functionalisation per size before).  Where anything does not hold (a size out
of the exported range, an assertion false, a symbol no tensor carries, an export that
failed), the answer is None and capture exports the graph at these sizes, as before.

With capture.py, the only module that imports torch.export / torch.fx.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode


class Symbolic:
    """One Dynamo graph's export with its sizes dynamic (made at the first call that asks)."""

    def __init__(self, gm: torch.fx.GraphModule, constants: dict | None = None):
        """`constants`: placeholder index -> the value bound into the graph (`constants`)."""
        self.gm = gm
        self.exported = None  # the ExportedProgram, False once it could not be made
        self.tensor_only = _tensor_only(gm, constants or {})  # (sizes read off tensors; None: not possible)

    def program(self, tensors: list) -> object | None:
        """The exported program at these tensor arguments' sizes (an object with the attributes
        capture reads of an ExportedProgram), or None (capture then exports at these sizes)."""
        if self.tensor_only is None or self.exported is False:
            return None
        if self.exported is None:
            self.exported = _export(*self.tensor_only, tensors) or False
            if self.exported is False:
                return None
        try:
            return _at_sizes(self.exported, tensors)
        except Exception:  # (out of range, an assertion false, an op with no fake kernel)
            return None


def constants(gm: torch.fx.GraphModule, args: list, scalars: frozenset) -> dict:
    """The arguments a graph is exported with as constants (placeholder index -> value): a float
    argument's value (scalar_slots: a 0-d tensor read by `.item()`) and a plain Python
    value that is not a size (an int the function closed over)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {i: a.item() if i in scalars else a for i, (node, a) in enumerate(zip(placeholders, args))
            if i in scalars or not isinstance(a, torch.Tensor) and not isinstance(node.meta.get("example_value"),
                                                                                 torch.SymInt)}


def _tensor_only(gm: torch.fx.GraphModule, constants: dict):
    """(a graph over the tensor arguments alone, each size argument replaced by the size of a
    tensor dimension that carries its symbol and each constant (`constants`) by its value; per
    tensor argument its dynamic dimensions), or None where some size argument is no tensor's
    dimension or the metadata is missing."""
    everything = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders = [n for i, n in enumerate(everything) if i not in constants]
    items = {everything[i]: value for i, value in constants.items()}  # (a float's tensor, or a plain value)
    values = [n.meta.get("example_value") for n in placeholders]
    if any(v is None for v in values) or not any(isinstance(v, torch.SymInt) or _symbolic(v) for v in values):
        return None
    carriers, dynamic = {}, []
    for node, value in zip(placeholders, values):
        if isinstance(value, torch.Tensor):
            dims = {}
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    carriers.setdefault(size.node.expr, (node, d))
                    dims[d] = torch.export.Dim.AUTO
            dynamic.append(dims or None)
    graph, env = torch.fx.Graph(), {node: value for node, value in items.items()
                                     if not isinstance(node.meta.get("example_value"), torch.Tensor)}
    for node in placeholders:
        if isinstance(node.meta["example_value"], torch.Tensor):
            env[node] = graph.node_copy(node, lambda n: env[n])
    for node in placeholders:
        value = node.meta["example_value"]
        if isinstance(value, torch.SymInt) and value.node.expr.is_number:  # (a size Dynamo specialised)
            env[node] = int(value.node.expr)
        elif not isinstance(value, torch.Tensor):
            if not isinstance(value, torch.SymInt) or value.node.expr not in carriers:
                return None
            tensor, d = carriers[value.node.expr]
            env[node] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], d))
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "item" and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0] in items:
            env[node] = items[node.args[0]]
        elif node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph), dynamic


def _symbolic(value) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def _export(gm: torch.fx.GraphModule, dynamic: list, tensors: list):
    from .capture import export_aten  # (one export path: warnings, tracing context, decompositions)
    try:
        return export_aten(gm, tensors, dynamic_shapes=tuple(dynamic))
    except Exception:
        return None


def _at_sizes(program, tensors: list):
    """The exported graph run on fake tensors of these inputs, as a concrete graph."""
    specs = program.graph_signature.input_specs
    if not _in_range(program, [s for s in specs if s.kind.name == "USER_INPUT"], tensors):
        return None
    user = iter(tensors)
    graph, env = torch.fx.Graph(), {}
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        warnings.simplefilter("ignore")
        values = {}
        for spec in specs:
            if spec.kind.name == "USER_INPUT":
                values[spec.arg.name] = mode.from_tensor(next(user))
            elif spec.target in program.state_dict:
                values[spec.arg.name] = mode.from_tensor(program.state_dict[spec.target])
            else:
                constant = program.constants[spec.target]
                values[spec.arg.name] = mode.from_tensor(constant) if isinstance(constant, torch.Tensor) else constant
        for node in program.graph_module.graph.nodes:
            if node.op == "placeholder":
                new = graph.placeholder(node.name)
                new.meta = dict(node.meta, val=values[node.name])
                if new.name != node.name:
                    return None
                env[node] = new
                continue
            if node.op == "output":
                graph.output(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: _value(env[n]))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _value(env[n]))
            result = node.target(*args, **kwargs)
            if not _holds_tensor(result):
                env[node] = result  # a size, a flag, an assertion's None: folded
                continue
            new = graph.create_node("call_function", node.target,
                                    torch.fx.node.map_arg(node.args, lambda n: env[n]),
                                    torch.fx.node.map_arg(node.kwargs, lambda n: env[n]), node.name)
            new.meta = dict(node.meta, val=result)
            env[node] = new
    return types.SimpleNamespace(graph_module=torch.fx.GraphModule(program.graph_module, graph),
                                 graph_signature=program.graph_signature, state_dict=program.state_dict,
                                 constants=program.constants, call_spec=program.call_spec)


def _in_range(program, user_specs, tensors) -> bool:
    """Whether these inputs' sizes give the exported graph's symbols values within its range
    constraints (the assumptions its trace made), and its static sizes their own values."""
    placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    symbols, expressions = {}, []
    for spec, tensor in zip(user_specs, tensors):
        shape = placeholders[spec.arg.name].meta["val"].shape
        if len(shape) != tensor.dim():
            return False
        for size, actual in zip(shape, tensor.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                if symbols.setdefault(size.node.expr, actual) != actual:
                    return False
            elif isinstance(size, torch.SymInt):
                expressions.append((size.node.expr, actual))
            elif size != actual:
                return False
    if any(int(expr.xreplace(symbols)) != actual for expr, actual in expressions):
        return False
    for symbol, bounds in program.range_constraints.items():
        value = symbols.get(symbol)
        if value is None or not (bounds.lower <= value <= bounds.upper):
            return False
    return True


def _value(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _holds_tensor(result) -> bool:
    if isinstance(result, torch.Tensor):
        return True
    return isinstance(result, (list, tuple)) and any(isinstance(r, torch.Tensor) for r in result)


def scalar_slots(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Arguments that Dynamo made of a Python float whose value changed between
    calls: 0-d tensors the graph reads only through `.item()`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(placeholders)
                     if n.users and all(u.op == "call_method" and u.target == "item" for u in n.users))


def bind_sizes(gm: torch.fx.GraphModule, args: list, scalars: frozenset = frozenset()) -> torch.fx.GraphModule:
    """The graph with its non-tensor arguments (SymInts at capture) and its
    `scalars` (scalar_slots) replaced by this call's values: a static graph
    over the other tensor arguments alone."""
    graph, env = torch.fx.Graph(), {}
    placeholders = iter(enumerate(args))
    items = {}
    for node in gm.graph.nodes:
        i, value = next(placeholders) if node.op == "placeholder" else (None, None)
        if node.op == "placeholder" and i in scalars:
            items[node] = value.item()
        elif node.op == "call_method" and node.target == "item" and node.args[0] in items:
            env[node] = items[node.args[0]]
        elif node.op == "placeholder" and not isinstance(value, torch.Tensor):
            env[node] = value
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph)
