"""The straight-line Python a compiled program runs per call (as Inductor's wrapper code):
one line per kernel launch, allocation and release, made once per program from its plan
(runtime.Executable), so that no call interprets the plan."""
from __future__ import annotations

import collections
import math
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch._prims_common import make_contiguous_strides_for

from . import ops
from .graph import view_source
from .orders import strides_for
from .steps import empty, no_bias, onednn_linear, reinterpret, same_dtypes, torch_dtype


@dataclass
class Wrapper:
    """A program's wrapper: `source` prints; `names` are its globals."""
    source: str
    names: dict = field(default_factory=dict)


def straight_line(executable, loops_by_name: dict, nodes: dict, release) -> Wrapper:
    """The wrapper of an Executable: its generated kernels' calls (`loops_by_name`: their loop
    IR; `nodes`: buffer name -> node) and torch steps, with each value released where
    `release` (plan.release_schedule) says, and a released buffer taken over by a later
    value of its shape and dtype (`reused_buffers`)."""
    plan, target = executable.plan, executable.target
    local: dict[int, str] = {}
    names: dict = {}
    allocations = allocated(plan, loops_by_name, nodes, target)
    reuse = reused_buffers(plan, allocations, release)
    handed = {old for old, _ in reuse.values()}  # (released by the value that takes its buffer over)
    kept = executable.kept  # (a CPU program's buffers, kept for its next call: KeptBuffers)
    lines = ["def run(env):"] + (["    _kept, _new = _take(), {}"] if kept is not None else [])
    if kept is not None:
        names["_take"], names["_keep"], names["_alone"] = kept.take, kept.keep, kept.alone
    dense = set(executable.steps.dense)  # values held contiguous, of their node's shape
    generated_reads = {id(i) for k in plan.kernels if k.kind == "generated" for i in k.inputs}
    for i, node in enumerate(plan.graph.inputs):
        local[id(node)] = f"a{i}"
        lines.append(f"    a{i} = env[{id(node)}]")
    for step, kernel in enumerate(plan.kernels):
        for name, node in allocations[step]:
            local[id(node)] = name
            if not _ordered(kernel, node):  # (a buffer stored in another order: orders.py)
                dense.add(id(node))
            if name in reuse and reuse[name][1] is None:
                lines.append(f"    {name} = {reuse[name][0]}; del {reuse[name][0]}  # (its buffer, free now)")
            elif name in reuse:  # (as many elements in another shape or order: the buffer viewed so)
                names[f"_as_{name}"] = _viewed(*reuse[name][1])
                lines.append(f"    {name} = _as_{name}({reuse[name][0]}); del {reuse[name][0]}  # (its buffer, free now)")
            else:
                names[f"_empty_{name}"] = empty(node.shape, torch_dtype(node.dtype), target.device,
                                                _stride(kernel, node))
                lines.append(f"    {name} = _new['{name}'] = _kept.pop('{name}') if _alone(_kept, '{name}') else _empty_{name}()"
                             if kept is not None else f"    {name} = _empty_{name}()")
        if kernel.kind == "generated" and kernel.loop_nest:
            pass  # computed by its sibling's loop nest
        elif kernel.kind == "generated":
            loop = loops_by_name[kernel.name]
            params = [local[id(nodes[p.name])] for p in loop.params if p.role == "in"] + \
                [p.name for p in loop.params if p.role == "out"]
            names[f"_{kernel.name}"] = executable._calls[kernel.name]
            lines.append(f"    _{kernel.name}({', '.join(params)})  # {kernel.output.op}")
        elif allocations[step]:  # a library call into the buffer just allocated
            if kernel.output.op == "matmul":
                operands = [view_operand(a, f"_{kernel.name}_{i}", local, dense - executable._any_strides, names)
                            for i, a in enumerate(kernel.output.args)]
                operands = None if None in operands else operands
            else:
                operands = direct_operands(kernel.output, local, dense)
            if operands is None:
                names[f"_{kernel.name}"] = executable.torch_step_into(kernel)
            elif kernel.output.op == "matmul":
                names[f"_{kernel.name}"] = executable.steps.matmul_direct()
            else:
                names[f"_{kernel.name}"] = executable.steps.linear_direct(
                    kernel.output, weight_transposed(kernel.output, local))
            args = ", ".join((operands or [local[id(i)] for i in kernel.inputs]) + [f"t{step}"])
            lines.append(f"    _{kernel.name}({args})  # {kernel.kind}: {kernel.output.op}, into t{step}"
                         + (", direct" if operands else ""))
        else:
            local[id(kernel.output)] = f"t{step}"
            contiguous = id(kernel.output) in generated_reads
            attention = direct_attention(kernel, target)
            if attention:
                operands = [view_operand(a, f"_{kernel.name}_{i}", local, dense - executable._any_strides, names)
                            for i, a in enumerate(kernel.output.args)]
                operands = None if None in operands else operands
            else:
                operands = direct_operands(kernel.output, local) if direct_linear(kernel) else None
            if not contiguous and (operands is None or attention):  # (torch's strides, not F.linear's: no fixed view)
                dense.discard(id(kernel.output))
            if operands is None:
                names[f"_{kernel.name}"] = executable.torch_step(kernel, contiguous)
            elif attention:
                call = executable.steps.attention_direct(kernel.output)
                names[f"_{kernel.name}"] = (lambda *t, call=call: call(*t).contiguous()) if contiguous else call
            else:
                names[f"_{kernel.name}"] = executable.steps.linear_call(
                    kernel.output, contiguous, weight_transposed(kernel.output, local))
            args = ", ".join(operands or [local[id(i)] for i in kernel.inputs])
            lines.append(f"    t{step} = _{kernel.name}({args})  # {kernel.kind}: {kernel.output.op}"
                         + (", direct" if operands else ""))
        dead = [local[id(n)] for n in release[step] if local[id(n)] not in handed]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    released = {id(n) for step in release for n in step}
    live = [(key, name) for key, name in local.items() if key not in released]
    result = "{" + ", ".join(f"{key}: {name}" for key, name in live) + "}"
    lines += [f"    _r = {result}", "    _keep(_new)", "    return _r"] if kept is not None else [f"    return {result}"]
    return Wrapper("\n".join(lines), names)


def _ordered(kernel, node) -> bool:
    return bool(kernel.order) and node is kernel.output


def _stride(kernel, node) -> tuple | None:
    return strides_for(node.shape, kernel.order) if _ordered(kernel, node) else None


def into_buffer(kernel, target) -> bool:
    """Whether a library call writes a buffer the wrapper allocates (steps.linear_into,
    matmul_into): a CPU linear whose operands are of its own dtype (on CUDA the caching
    allocator already hands a warm block, and `addmm` into a buffer of ours measured slower
    inside LLaMA, BENCHMARKS.md, eighth session) that torch's GEMM runs, not oneDNN's
    (cpu_linear: it makes its own result); a CPU product of two matrices of its dtype."""
    node = kernel.output
    if not (target.device == "cpu" and kernel.kind == "library" and node.op in ("linear", "matmul")
            and node.dtype in ("float32", "bfloat16")):
        return False
    if node.op == "matmul":
        return len(node.shape) == 2 and all(len(a.shape) == 2 and a.dtype == node.dtype for a in node.args)
    return same_dtypes(node) and not onednn_linear(node)  # (oneDNN's makes its own result)


def view_operand(node, name: str, local: dict, dense, names: dict) -> str | None:
    """The wrapper's expression for a library call's operand: a value it holds, or a view of
    one (`name`, a function the wrapper's globals get, takes it): with fixed sizes and strides
    where the value is held contiguous (`dense`) and each op of the chain is a view of it (as
    torch decides on a meta tensor), else the chain's ops per call (a reshape of another
    layout copies, as torch's would); None where the chain reaches nothing the wrapper holds."""
    chain = []
    while id(node) not in local:
        if node.group != "layout":
            return None
        chain.append(node)
        node = node.args[0]
    if not chain:
        return local[id(node)]
    steps = [(ops.get(n.op).reference, n.a) for n in reversed(chain)]
    value, viewed = torch.empty(node.shape, dtype=torch_dtype(node.dtype), device="meta"), True
    for reference, attrs in steps:
        value = reference([value], attrs)
        viewed = viewed and value._is_view()
    if id(node) in dense and viewed:
        layout = (tuple(value.shape), value.stride(), value.storage_offset())
        names[name] = lambda t: reinterpret(t, *layout)
    else:
        def view(t):
            for reference, attrs in steps:
                t = reference([t], attrs)
            return t
        names[name] = view
    return f"{name}({local[id(node)]})"


def direct_operands(node, local: dict, dense: set | None = None) -> list[str] | None:
    """The wrapper's names of a linear's operands where it holds each itself (not a view the
    step would take) and, where `dense` is given, x is one of those, contiguous and of its
    node's shape (steps.linear_direct and linear_call then take them as they are); None otherwise.
    The weight may be the transpose of a matrix the wrapper holds (GPT-2's Conv1D weights are
    [in, out]): that matrix is named, and `weight_transposed` says so (a step reading the view
    through the environment took 33 us of host time a call on CUDA, Inductor's addmm 18)."""
    x, w, bias = node.args
    operands = [x] if no_bias(node) else [x, bias]
    if (dense is not None and id(x) not in dense) or any(id(a) not in local for a in operands):
        return None
    if id(w) not in local and not weight_transposed(node, local):
        return None
    weight = local[id(w.args[0])] if id(w) not in local else local[id(w)]
    return [local[id(x)], weight] + ([] if no_bias(node) else [local[id(bias)]])


def weight_transposed(node, local: dict) -> bool:
    """Whether a linear's weight is a 2-d transpose the wrapper does not hold, of a matrix it does."""
    w = node.args[1]
    return (id(w) not in local and w.op == "transpose" and len(w.shape) == 2 and len(w.args[0].shape) == 2
            and id(w.args[0]) in local)


def direct_attention(kernel, target) -> bool:
    """A CPU attention call without a mask or with one (not training's fused calls, which share a
    call between nodes) whose q, k, v and result are of one dtype: called on the operands the
    wrapper holds or views (AttentionSteps.attention_direct)."""
    node = kernel.output
    return (target.device == "cpu" and kernel.kind == "library" and node.op in ("sdpa", "sdpa_mask")
            and node.dtype in ("float32", "bfloat16", "float16", "float64")
            and all(a.dtype == node.dtype for a in node.args[:3]))


def direct_linear(kernel) -> bool:
    """A library linear whose operands are of its own dtype (F.linear gives it, no cast after)."""
    node = kernel.output
    if kernel.kind != "library" or node.op != "linear":
        return False
    x, w, bias = node.args
    return x.dtype == w.dtype == node.dtype and (no_bias(node) or bias.dtype == node.dtype)


def allocated(plan, loops_by_name: dict, nodes: dict, target) -> list[list[tuple[str, object]]]:
    """Per kernel, the buffers the wrapper allocates for it (name, node): a generated kernel's
    outputs, an `into_buffer` library call's result."""
    out = []
    for step, kernel in enumerate(plan.kernels):
        if kernel.kind == "generated" and not kernel.loop_nest:
            out.append([(p.name, nodes[p.name]) for p in loops_by_name[kernel.name].params if p.role == "out"])
        else:
            out.append([(f"t{step}", kernel.output)] if into_buffer(kernel, target) else [])
    return out


def reused_buffers(plan, allocations: list, release) -> dict[str, tuple]:
    """Which allocation takes over the buffer of a value released before it (its name -> (the
    released buffer's name, None where the layouts are the same, else the new (shape, strides)
    to view it with)), as Inductor's wrapper reuses buffers: a buffer the wrapper allocated, of
    as many elements of the same dtype (every buffer it allocates is dense: any shape and
    order of that many elements covers it exactly), that no ATen fallback reads (a fallback may
    hand out a view of what it reads, which would see the next value's writes; a library call's
    result is its own).  On a CPU every fresh buffer is a malloc whose pages, past glibc's trim
    threshold, fault in again on each call: a LLaMA training step at --size cpu took ~2,500
    page faults (2 cores), 1,000 of them in each of the two SwiGLU backward loop nests, whose
    [512, 1024] outputs found only [4, 128, 1024] buffers free while buffers were reused by
    shape alone."""
    torch_reads = {id(view_source(i)) for k in plan.kernels if k.kind != "generated"
                   and (k.kind, k.output.group) != ("library", "library") for i in k.inputs}
    ours: dict[int, tuple] = {}  # a value in a buffer the wrapper allocated -> (the buffer's name, its layout)
    free: dict[tuple, list[tuple]] = {}  # (elements, dtype) -> released buffers (name, layout)
    reuse: dict[str, tuple] = {}
    for step, kernel in enumerate(plan.kernels):
        for name, node in allocations[step]:
            layout = (tuple(node.shape), _stride(kernel, node) or tuple(make_contiguous_strides_for(node.shape)))
            size = (math.prod(node.shape), torch_dtype(node.dtype))
            ours[id(node)] = (name, layout, size)
            pool = free.get(size)
            if pool:
                old, old_layout = pool.pop()
                reuse[name] = (old, None if old_layout == layout else layout)
        for n in release[step]:
            if id(n) in ours and id(n) not in torch_reads:
                name, layout, size = ours[id(n)]
                free.setdefault(size, []).append((name, layout))
    return reuse


def _viewed(shape: tuple, stride: tuple):
    return lambda buffer: reinterpret(buffer, shape, stride, 0)


def exec_wrapper(source: str, names: dict):
    scope = dict(names)
    exec(compile(source, "<egraph-compiler wrapper>", "exec"), scope)
    return scope["run"]


class KeptBuffers:
    """A CPU program's buffers, kept for its next call, as the CUDA caching allocator keeps a
    GPU's blocks.  On a CPU each fresh buffer is a malloc whose pages, where glibc has handed the
    heap's top back, fault in again inside the kernel that first writes them: a LLaMA training
    step at --size cpu took ~1,200-3,000 page faults on 2 cores (Inductor's ~20-120), in the
    backward's SwiGLU loop nests (the call's first allocations) and in the GEMMs writing the
    activations the forward saves (BENCHMARKS.md, forty-fifth session).

    A call takes a set of the buffers earlier calls allocated (`take`; an empty one when other
    calls hold the others) and, at its end, hands in those it allocated (`keep`), results and
    saved activations included.  A buffer of the set is written again only where nothing but
    the set holds it when the call takes it (`alone`): no Python reference (the caller's result,
    a list of them), no tensor sharing it (a view holds its storage; autograd's saved tensors
    and views hold the tensor itself; in inference mode a view holds only the storage), and
    its storage still of its size (FSDP2 frees the gradients it has reduced by resizing their
    storage to 0 bytes).  So a value handed out is never written while anyone can see it: a
    training step's activations are taken again once backward has let them go, a result the
    caller still holds is not.
    At most LIMIT sets are kept (calls from several threads at once each need their own), and
    only the HOLDERS programs that kept last hold any: a process with many programs (graph
    breaks; a generation compiling each length, whose logits alone may be 100s of MB each)
    holds the memory of a few."""
    LIMIT, HOLDERS = 2, 8
    _uses = getattr(torch._C, "_storage_Use_Count", None)  # (a torch without it: no program keeps buffers)
    _holders: collections.OrderedDict = collections.OrderedDict()  # id -> weakref of one, the last to keep last

    def __init__(self):
        self.sets: list[dict] = []

    def take(self) -> dict:
        try:
            return self.sets.pop()
        except IndexError:
            return {}

    def keep(self, new: dict) -> None:
        """Keeps this call's buffers; one handed out (a result) as a new tensor on its memory
        (`detach`): the tensor handed out carries what autograd gave it (a training forward's
        results get the step's graph as their grad_fn, which holds the step's saved tensors), and
        taken again it would be handed out twice as one object."""
        if len(self.sets) < self.LIMIT:
            self.sets.append({name: new[name] if _references(new, name) == self._HELD else new[name].detach()
                              for name in new})
        holders = KeptBuffers._holders
        holders[id(self)] = weakref.ref(self)  # (a program deleted frees its own sets)
        holders.move_to_end(id(self))
        while len(holders) > self.HOLDERS:
            try:
                oldest = holders.popitem(last=False)[1]()
            except KeyError:  # (another thread's call emptied it first)
                break
            if oldest is not None:
                oldest.sets.clear()

    @classmethod
    def alone(cls, held: dict, name: str) -> bool:
        """Whether `held[name]` exists and nothing else holds it or its memory."""
        t = held.get(name)
        if t is None or _references(held, name) != cls._ALONE or t._use_count() != 1:
            return False
        storage = t.untyped_storage()
        # no other tensor on its storage, and the storage still of its size (FSDP2 frees the
        # gradients it has reduced by resizing their storage to 0 bytes)
        return cls._uses(storage._cdata) == 2 and storage.nbytes() == t.numel() * t.element_size()


def _references(held: dict, name: str) -> int:
    """Python's references to a held tensor, counted from here (`held`, this frame's `t`,
    getrefcount's argument; from `alone`, its own `t` too): _HELD from `keep` and _ALONE
    from `alone` where nothing else holds it."""
    t = held[name]
    return sys.getrefcount(t)


KeptBuffers._HELD = _references({"probe": torch.empty(0)}, "probe")  # (only the dict holds it)
KeptBuffers._ALONE = KeptBuffers._HELD + 1  # (+ `alone`'s own `t`)
