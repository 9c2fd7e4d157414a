"""Training through `torch.compile(backend="egraph")`: AOTAutograd splits a
graph that needs gradients into a forward graph (which also returns the
activations backward needs) and a backward graph, with its default min-cut
partitioner; both are ATen graphs, and each is compiled by the pipeline like
any other program.  This is the only module that imports AOTAutograd.

Backward ATen ops (`_softmax_backward_data`, `native_layer_norm_backward`,
`gelu_backward`, ...) are decomposed into the primitives of the op table by
torch's own decompositions, so the rules fuse them like written-out math;
forward composites stay whole (softmax, gelu) except `native_layer_norm`, whose
saved mean and rstd are primitives' values.  Attention becomes `egc::attention`
(flash.py: the fused kernel with its logsumexp, and its own backward) where the
kernels take it, and is written out (softmax(q k^T s) v) elsewhere.
"""
from __future__ import annotations

import operator
import warnings

import torch
import torch.utils._pytree as pytree
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._decomp import get_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.checkpoint import CheckpointPolicy

from . import flash
from .errors import EagerFallbackWarning
from .capture import MISSING, retarget
from .sources import user_line

aten = torch.ops.aten

DECOMPOSED = [
    # backward composites -> primitives
    aten._softmax_backward_data, aten._log_softmax_backward_data, aten.gelu_backward, aten.silu_backward,
    aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward, aten.native_layer_norm_backward,
    aten._fused_rms_norm_backward, aten.native_dropout_backward,
    # forward ops whose saved outputs only primitives give (mean/rstd), or that only ATen runs otherwise
    aten.native_layer_norm, aten._fused_rms_norm,
    # batch norm: statistics as reductions, the running ones' update as arithmetic (written back by
    # copy: convnets.py), its backward as primitives
    aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit, aten.native_batch_norm, aten.native_batch_norm_backward,
    # group norm likewise (its statistics per group as reductions)
    aten.native_group_norm, aten.native_group_norm_backward,
]


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention before autograd: `egc::attention` where its kernels
    take the operands (flash.supported; its backward `egc::attention_backward`, both
    library calls of the op table), else written out (softmax(q k^T * scale + mask) v,
    whose backward is matmuls and softmax's backward, which the rules fuse).  Fully
    masked rows give 0 either way, as torch's math does."""
    if dropout_p != 0.0:  # dropout inside attention: torch's own kernel and its random stream
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    learned = attn_mask is not None and attn_mask.requires_grad  # (a bias whose gradient the kernels do not give)
    if (enable_gqa or q.shape[-3:-2] == k.shape[-3:-2]) and not learned and flash.supported(q, k, v, attn_mask,
                                                                                             is_causal):
        return flash.attention(q, k, v, attn_mask, q.shape[-1] ** -0.5 if scale is None else scale, is_causal)[0]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = torch.where(keep, scores, float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = torch.where(attn_mask, scores, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    return aten._safe_softmax(scores, -1) @ v


_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_TARGETS = {_SDPA, torch._C._nn.scaled_dot_product_attention}


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _unrepeated(node) -> tuple[torch.fx.Node, int, list] | None:
    """(x, g, the chain's nodes) where `node` is x [B, H, S, D] with each head repeated g times
    in place (transformers' `repeat_kv`: x[:, :, None].expand(B, H, g, S, D).reshape(B, H * g, S, D),
    or `x.repeat_interleave(g, dim=1)`), read from the shapes Dynamo recorded; else None."""
    out = _shape(node)
    if out is None or len(out) != 4 or node.op not in ("call_method", "call_function"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "repeat_interleave":
        x, g = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if isinstance(g, int) and g > 1 and dim in (1, -3) and _shape(x) == (out[0], out[1] // g, *out[2:]):
            return x, g, [node]
        return None
    if name not in ("reshape", "view") or not node.args:
        return None
    expanded = node.args[0]
    wide = _shape(expanded)
    if (wide is None or len(wide) != 5 or expanded.op != "call_method" or expanded.target != "expand"
            or out != (wide[0], wide[1] * wide[2], *wide[3:])):
        return None
    single = expanded.args[0]
    if not isinstance(single, torch.fx.Node) or _shape(single) != (*wide[:2], 1, *wide[3:]):
        return None
    if single.op == "call_function" and single.target is operator.getitem:
        x, index = single.args
        if not (isinstance(index, tuple) and index.count(None) == 1
                and all(i is None or i is Ellipsis or i == slice(None) for i in index)):
            return None
    elif (single.op == "call_method" and single.target == "unsqueeze") or single.target is torch.unsqueeze:
        x = single.args[0]
    else:
        return None
    if _shape(x) != (*wide[:2], *wide[3:]) or wide[2] < 2:
        return None
    return x, wide[2], [node, expanded, single]


def _takes_groups(q) -> bool:
    """Whether the fused kernels for q's device take k and v with fewer heads as they are (on CUDA,
    flash.py repeats them per call, forward and backward: not measured against one saved repeat)."""
    value = q.meta.get("example_value") if isinstance(q, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and flash.cpu_groups()


def _grouped_kv(gm: torch.fx.GraphModule) -> None:
    """Attention on keys and values repeated per query head (`repeat_kv`) becomes attention with
    `enable_gqa=True` on the unrepeated ones, edited in place, where the fused kernels take them
    so (`_takes_groups`): they then read (and backward saves) k and v once, and their gradients
    need no sum over each group.  Inference gets the same from the rule
    `attention_grouped_kv_masked`; in training the attention is a library call before autograd
    (`_sdpa_math`), which no rule of the e-graph reaches.  Attention with dropout is left alone
    (torch's own kernel runs it, drawing its random numbers as eager does)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        k, v = node.kwargs.get("key", args[1]), node.kwargs.get("value", args[2])
        dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if node.kwargs.get("enable_gqa") or len(node.args) > 7 or dropout != 0.0:
            continue
        found = [_unrepeated(t) for t in (k, v)]
        q = node.kwargs.get("query", node.args[0] if node.args else None)
        if (None in found or found[0][1] != found[1][1] or _shape(q) is None
                or _shape(q)[:2] != _shape(k)[:2] or _shape(k)[:2] != _shape(v)[:2] or not _takes_groups(q)):
            continue  # (query heads one to one with the repeated ones: anything else is sdpa's error)
        args, kwargs = list(node.args), dict(node.kwargs, enable_gqa=True)
        for i, (key, (x, _, _)) in enumerate(zip(("key", "value"), found), 1):
            if key in kwargs:
                kwargs[key] = x
            else:
                args[i] = x
        node.args, node.kwargs = tuple(args), kwargs
        for _, _, chain in found:
            for n in chain:
                if not n.users:
                    gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()


def training_backend(gm: torch.fx.GraphModule, example_inputs, compile_graph):
    """A Dynamo graph that needs gradients: forward and backward graphs, each
    compiled by `compile_graph(gm)` -> callable(*args) returning a tuple
    (api._PerSize: one program per distinct size)."""
    _grouped_kv(gm)
    retarget(gm, _SDPA_TARGETS, _sdpa_math)  # attention's math, before autograd sees torch's fused kernel

    def compiler(graph: torch.fx.GraphModule, inputs, **extra):
        run = compile_graph(graph, **extra)
        shapes_known = all(not isinstance(x, torch.Tensor) or all(isinstance(d, int) for d in x.shape)
                           for x in inputs)
        if shapes_known and all(isinstance(x, torch.Tensor) for x in inputs):
            with unset_fake_temporarily():  # compiled now, for inputs shaped like AOTAutograd's fake ones
                program, slots = run.compile([_real(x) for x in inputs])
            if not run.scalars and len(slots) == len(inputs):  # one size (AOTAutograd's runtime checks
                def static(*args):  # what its graphs were traced for): no size key per call
                    out = program(*args)
                    return out if isinstance(out, tuple) else (out,)
                static.compiled = program
                return make_boxed_func(static)
        return make_boxed_func(run)

    table = (MISSING | get_decompositions(DECOMPOSED)
             | {aten.scaled_dot_product_attention.default: _sdpa_math})  # (losses, roll, ...: decompose.py)
    def forward_compiler(graph: torch.fx.GraphModule, inputs):
        """The forward returns the user's outputs, then the activations backward reads: those are
        lent by a CUDA graph, not copied (graphs.py), and backward reads them in place."""
        context = TracingContext.try_get()
        metadata = context.fw_metadata if context is not None else None
        if metadata is not None:
            _check_user_outputs(gm, graph, metadata)
        return compiler(graph, inputs, lend_outputs=metadata.num_forward if metadata is not None else None,
                        guarded=True)  # (its inputs are Dynamo's graph's, held by its guards: api._PerSize)

    def backward_compiler(graph: torch.fx.GraphModule, inputs):
        """Gradients are lent too: autograd accumulates them, and `zero_grad()` lets them go."""
        return compiler(graph, inputs, lend_outputs=0)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler, decompositions=table,
                           partition_fn=_partition, keep_inference_input_mutations=True)
    try:
        return backend(gm, example_inputs)
    except _Misaligned as e:
        warnings.warn(f"{e}: this graph runs eagerly ({_first_line(gm)})", EagerFallbackWarning, stacklevel=2)
        return gm.forward


SELECTIONS = (aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.max.default, aten.min.default)


def _partition(joint: torch.fx.GraphModule, joint_inputs, **kwargs):
    """The min-cut partitioner, with what a max or min selects from saved, never recomputed: its
    gradient picks the elements equal to the max (`x == amax(x)`), and a transcendental x
    recomputed by backward in another loop may round otherwise than the forward's (libmvec's
    vector cosf against glibc's scalar one: no element equal, a gradient of 0 or 0 / 0)."""
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.target in SELECTIONS and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].op == "call_function":
            node.args[0].meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


class _Misaligned(Exception):
    """AOTAutograd's forward graph does not return the user's outputs where its metadata says."""


def _check_user_outputs(gm: torch.fx.GraphModule, forward: torch.fx.GraphModule, metadata) -> None:
    """AOTAutograd (torch 2.13) can trace a forward graph that returns an input in place of a user
    output: a buffer updated in place with a value that requires grad, beside a buffer's `+=`
    (`self.steps += 1`), gave the step count as the model's output, under Inductor too.  The user
    outputs follow the mutated inputs' new values; each must have the shape and dtype Dynamo's graph
    gave it, and one that aliases nothing must not be an input of the graph."""
    expected = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a
                for a in pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])]
    returned = list(forward.graph.nodes)[-1].args[0]
    start = metadata.num_mutated_inp_runtime_indices
    for i, (info, want) in enumerate(zip(metadata.output_info, expected)):
        got = returned[start + i] if start + i < len(returned) else None
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.fx.Node):
            continue
        val = got.meta.get("val")
        if (not isinstance(val, torch.Tensor) or val.shape != want.shape or val.dtype != want.dtype
                or (info.output_type.name == "non_alias" and got.op == "placeholder")):
            raise _Misaligned(f"torch's AOTAutograd traced a forward graph whose output {i} is not the "
                              f"program's (a {_describe(val)} where the program returns a {_describe(want)}; "
                              f"a buffer updated in place with a value that requires grad can cause it: detach "
                              f"that value, or update the buffer under torch.no_grad())")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def _first_line(gm: torch.fx.GraphModule) -> str:
    """The user's first source line in the graph, to say which graph runs eagerly."""
    return next((user_line(n) for n in gm.graph.nodes if n.meta.get("stack_trace")), "a graph with no source line")


def _real(fake: torch.Tensor) -> torch.Tensor:
    """A real tensor with a fake one's shape, strides and dtype (its values are
    never used for results: plans depend on shapes and dtypes only), filled with
    ones: random normals took 5.4 s of GPT-2's first training step at the GPU size
    on a CPU (144 tensors), a fill is a memory-bound pass."""
    out = torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype, device=fake.device)
    return out.fill_(1) if out.is_floating_point() else out.zero_()
