"""Constant folding: the parts of a program that read no input and need an
ATen call are computed once, at compile time, and become constant inputs of
the program.  (A fill, `torch.full` and its kind, stays what it is: a scalar
that generated code broadcasts by an index map, cheaper than any load.)

`transformers` builds its attention masks from `arange`, `diff`, `cumsum` and
advanced indexing of positions that depend on the sequence length alone: a
dozen small ATen calls per forward that no kernel needs to repeat (Inductor
computes them in one fused kernel per call).  A folded value is computed in
torch by the same semantics the runtime uses (the op table's references, an
extern's ATen call), and kept on the program's device (a fill names none; a
0-d CPU tensor may meet CUDA tensors in torch).  Nothing random is folded
(an op tagged `nondeterministic_seeded`), nor a value larger than
FOLD_LIMIT_BYTES (the program keeps it for its whole life), and parameters
and buffers are inputs, never constants: a model whose weights change keeps
seeing them.  A folded value may be a program output (a training forward
returns the attention mask it saves for backward): the caller gets a copy
(runtime.Executable._result), never the program's own tensor.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import masks, ops
from .cost import itemsize
from .graph import WEAK, Bound, Graph, Node, input_node, rebuild, topo_order
from .steps import scalar_tensor, torch_dtype

FOLD_LIMIT_BYTES = 16 << 20


def fold_constants(graph: Graph, device: torch.device | str = "cpu") -> Graph:
    order = topo_order(graph.outputs)
    constant: set[int] = set()
    aten: set[int] = set()  # constants that an ATen call computes (or reads)
    for node in order:
        if _foldable(node) and all(a.op == "const" or id(a) in constant for a in node.args):
            constant.add(id(node))
            if node.op == "extern" or any(id(a) in aten for a in node.args):
                aten.add(id(node))
    outputs = {id(o) for o in graph.outputs}
    readers: dict[int, list[Node]] = {}
    for node in order:
        for a in node.args:
            readers.setdefault(id(a), []).append(node)
    frontier = [n for n in order if id(n) in aten and _bytes(n) <= FOLD_LIMIT_BYTES
                and (id(n) in outputs or any(id(r) not in constant for r in readers.get(id(n), [])))]
    if not frontier:
        return graph
    values: dict[int, torch.Tensor] = {}
    replacements: dict[int, Node] = {}
    bound = dict(graph.bound)
    for k, node in enumerate(frontier):
        name = f"folded{k}_"
        while name in bound or any(i.attr("name") == name for i in graph.inputs):
            name += "_"
        bound[name] = Bound(None, name, _evaluate(node, values, device).contiguous())
        masks.note(bound[name].value)  # (a decoder's causal mask: its kernels' causal form, masks.py)
        replacements[id(node)] = input_node(name, node.shape, node.dtype)
    folded = rebuild(graph, lambda node, args: replacements.get(id(node)))
    used = {id(n) for n in topo_order(folded.outputs)}
    inputs = list(graph.inputs) + [n for n in replacements.values() if id(n) in used]
    return replace(folded, inputs=inputs, bound=bound)


def _foldable(node: Node) -> bool:
    if node.op in ("input", "const") or node.group in ("collective", "boundary"):
        return False
    if node.op == "extern":
        call = node.attr("target")
        if call.item is not None:  # one output of a multi-output call: its siblings share the call
            return False
        target = call.target
        return torch.Tag.nondeterministic_seeded not in getattr(target, "tags", (torch.Tag.nondeterministic_seeded,))
    return True


def _bytes(node: Node) -> int:
    return 1 << 62 if node.dtype == WEAK else node.numel * itemsize(node.dtype)


def _evaluate(node: Node, values: dict, device) -> torch.Tensor:
    if id(node) in values:
        return values[id(node)]
    tensors = [None if a.op == "const" else _evaluate(a, values, device) for a in node.args]
    args = [scalar_tensor(a, node, device) if t is None else t for a, t in zip(node.args, tensors)]
    if node.op == "extern":
        out = node.attr("target").run(args)
    else:
        out = ops.get(node.op).reference(args, node.a).to(torch_dtype(node.dtype))
    values[id(node)] = out = out.to(device)
    return out
