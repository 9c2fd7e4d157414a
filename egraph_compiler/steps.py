"""A plan's torch steps (library calls, ATen fallbacks, and the views in front of
them) as callables made once per node, not interpreted per call.

Without CUDA graphs a real model's forward is bound by the host (BENCHMARKS.md:
on the H200 box one torch op costs 10-16 us of Python and dispatch), so what
can be decided once is: which tensors a step reads and how (a constant operand
is a tensor made on the first call; a fused producer is its own callable), which
torch function runs it (a linear without bias passes no bias), and a chain of
views, taken with one `reinterpret_tensor` (Inductor's own fast view) once the
first call has seen what it gives for its base's layout.  A chain that copied
(a reshape of a layout torch cannot view) is taken again each call, and a base
of another layout than the one seen is never read through the old strides.
"""
from __future__ import annotations

import math
import threading

import torch
from torch._prims_common import make_contiguous_strides_for

from . import cpu_linear, ops
from .attention_steps import ATTENTION, AttentionSteps, plan_shaped
from .errors import CodegenError
from .cost import ONEDNN_LINEARS
from .graph import WEAK, Node, view_source

_GUARDS = getattr(torch._C, "_dynamo", None) and getattr(torch._C._dynamo, "guards", None)
_REINTERPRET = getattr(_GUARDS, "_reinterpret_tensor", None)


def reinterpret(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """`base` viewed with these sizes and strides, `offset` elements past its own start."""
    if _REINTERPRET is not None:
        return _REINTERPRET(base, size, stride, offset)
    return base.as_strided(size, stride, base.storage_offset() + offset)


def empty(shape, dtype: torch.dtype, device: str, stride=None):
    """A function making a buffer of this shape, contiguous unless `stride` is given (Inductor's
    `empty_strided_*` where torch has it: a third of `torch.empty`'s host time)."""
    shape = tuple(shape)
    stride = tuple(stride) if stride else tuple(make_contiguous_strides_for(shape))
    fast = getattr(_GUARDS, f"_empty_strided_{device}", None)
    if fast is not None:
        return lambda: fast(shape, stride, dtype)
    return lambda: torch.empty_strided(shape, stride, dtype=dtype, device=device)


def torch_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype == WEAK else getattr(torch, dtype)


class TorchSteps(AttentionSteps):
    """The callables, per node, that read a value out of a run's environment (id(node) -> tensor)."""

    def __init__(self, device: str, dense: frozenset = frozenset(), computed: frozenset = frozenset()):
        """`dense`: the nodes whose tensors are always contiguous, of the node's shape (the
        program's inputs, generated kernels' buffers): a view of one is the same view every call;
        `computed`: every node a kernel computes (a view chain reads the nearest one)."""
        self.device = device
        self.dense, self.computed = dense, computed
        self._runs = threading.local()  # `memo`: values one run shares between its steps, per thread
        self.views: dict[int, dict] = {}  # a view's node -> {its base's layout: (size, stride, offset) | None}
        self._getters: dict[int, object] = {}
        self._inline_reads: dict[int, int] = {}  # an inline node's id -> the steps built over it (_computed_once)

    @property
    def memo(self) -> dict:
        """The values this thread's run shares between its steps (a mask converted once for the
        layers that read it, one attention call's two results).  The runtime starts a fresh one
        per run.  Per thread: with one dict per program, two threads' runs read each other's
        values (a mask's dead rows taken from the other thread's mask: wrong results)."""
        memo = getattr(self._runs, "memo", None)
        if memo is None:  # (a thread's first step outside a run: timing a step alone)
            memo = self._runs.memo = {}
        return memo

    @memo.setter
    def memo(self, value: dict) -> None:
        self._runs.memo = value

    def tensor(self, node: Node, env) -> torch.Tensor:
        value = env.get(id(node))
        return value if value is not None else self.getter(node)(env)

    def getter(self, node: Node):
        got = self._getters.get(id(node))
        if got is None:
            got = self._getters[id(node)] = self._make_getter(node)
        return got

    def _make_getter(self, node: Node):
        key = id(node)
        if node.op == "const":
            return _once(lambda: torch.tensor(node.attr("value"), dtype=torch.float32, device=self.device))
        if node.op == "inline":  # a fused producer, in a kernel that runs through torch
            return _computed_once(key, self.step(node.args[0]), self._inline_reads)
        if node.group == "layout":
            return self._make_view(node)

        def missing(env):
            if key in env:
                return env[key]
            raise CodegenError(f"{node.op} is read before it is computed")
        return missing

    def _make_view(self, node: Node):
        chain = [node]  # the view, then the views under it, down to the first that is not one
        while chain[-1].group == "layout":
            chain.append(chain[-1].args[0])
        keys = [id(n) for n in chain]
        seen = self.views.setdefault(id(node), {})
        outer = self.getter(node.args[0])
        reference, attrs = ops.get(node.op).reference, node.a

        fixed = []  # (key, view) once a view of a dense tensor has been seen to be one
        copied = ("copied view", id(node))

        def view(env):
            if fixed:
                source = env.get(fixed[0])
                if source is not None:
                    return reinterpret(source, *fixed[1])
            for depth, key in enumerate(keys):  # the nearest computed tensor the chain reads
                source = env.get(key)
                if source is not None:
                    break
            else:  # (a constant's views, taken as torch takes them)
                return reference([outer(env)], attrs)
            if depth == 0:
                return source
            layout = (depth, source.shape, source.stride(), source.storage_offset())
            taken = seen.get(layout)
            if taken:
                return reinterpret(source, *taken)
            if taken is False:  # a copy (k and v repeated per head, read by attention's two calls and
                memo = self.memo  # saved for backward): made once per run
                value = memo.get(copied)
                if value is None:
                    value = memo[copied] = reference([outer(env)], attrs)
                return value
            value = reference([outer(env)], attrs)
            if taken is None:  # the first time with this layout: keep it if it is a view
                viewed = value.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
                seen[layout] = (value.shape, value.stride(),
                                value.storage_offset() - source.storage_offset()) if viewed else False
                if viewed and key in self.dense and source.is_contiguous() and \
                        not self.computed.intersection(keys[:depth]):  # (no nearer one in another run's env)
                    fixed[:] = [key, seen[layout]]
            return value
        return view

    def step(self, node: Node):
        """The callable computing `node` (a library op, an ATen fallback) from an environment."""
        fused = [s for s in map(view_source, node.args) if s.op == "inline"]  # (producers computed here)
        for s in fused:
            self._inline_reads[id(s)] = self._inline_reads.get(id(s), 0) + 1
        reads = []
        for a in node.args:
            if a.op == "const":
                reads.append(_once(lambda a=a: scalar_tensor(a, node, self.device)))
            else:
                reads.append(self.getter(a))
        fn = self._function(node)
        dtype = torch_dtype(node.dtype) if node.dtype != WEAK else None

        known = self._fused_part(node)

        def call(env):
            out = None if known is None else known()  # (attention's sibling result, its call made this run)
            if out is None:
                out = fn([read(env) for read in reads])
            out = plan_shaped(node, out)
            return out if dtype is None or out.dtype == dtype else out.to(dtype)
        if fused:
            return _computed_once(None, call, self._inline_reads)  # (its operands' fused producers, each once)
        return call

    def _function(self, node: Node):
        """The torch function a node runs, on its argument list."""
        if node.op == "extern":
            return node.attr("target").run
        if node.op == "linear":
            return self._linear(node)
        if node.op in ONEDNN_LINEARS:
            fused = self._onednn_epilogue(node)
            if fused is not None:
                return fused
        if node.op in ATTENTION:
            return self._attention(node)
        reference, attrs = ops.get(node.op).reference, node.a
        return lambda args: reference(args, attrs)

    def _linear(self, node: Node):
        """`F.linear`, without a bias where the plan's is a scalar 0 (it would cost an extra kernel).
        (`addmm`/`mm` into a buffer of our own, the input seen as a matrix, measured faster per
        call in isolation on the H200 box's host, made LLaMA's forward 32% slower there: 3.66
        against 2.77 ms, BENCHMARKS.md, eighth session.)"""
        linear = torch.nn.functional.linear
        if self.device == "cpu" and same_dtypes(node) and onednn_linear(node):
            linear = cpu_linear.onednn()
        if no_bias(node):
            return lambda args: linear(args[0], args[1])
        return lambda args: linear(args[0], args[1], args[2])

    def _onednn_epilogue(self, node: Node):
        """A linear with its epilogue (rules/onednn.rules) as oneDNN's one call, on a CPU with
        operands of float32 and no empty dim (oneDNN refuses a product over none); None where it
        runs as written (the op table's reference)."""
        x, w = node.args[0], node.args[1]
        operands = [a for i, a in enumerate(node.args) if i != 2 or not no_bias(node)]
        if (self.device != "cpu" or not math.prod(node.shape) or not w.shape[1]
                or any(a.dtype != "float32" for a in operands + [node]) or len(w.shape) != 2 or x.op == "const"
                or (not no_bias(node) and tuple(node.args[2].shape) != tuple(w.shape[:1]))):
            return None
        return cpu_linear.epilogue(node.op, not no_bias(node))

    def linear_into(self, node: Node):
        """`linear` (an `into` step: wrapper.py) as one `addmm`/`mm` writing a buffer the wrapper
        hands it, the input seen as a matrix: on a CPU a fresh result's pages fault in inside
        MKL's GEMM on every call (BERT's [512, 256] x [256, 1024]: 2181 us against 1586 into a
        touched buffer, BENCHMARKS.md, twenty-second session), where a buffer released earlier
        in the run is already mapped."""
        x, w = self.getter(node.args[0]), self.getter(node.args[1])
        bias = None if no_bias(node) else self.getter(node.args[2])
        k, n = node.args[1].shape[1], node.args[1].shape[0]
        addmm, mm = torch.addmm, torch.mm

        def product(env, matrix, out):
            weight = w(env).t()
            return mm(matrix, weight, out=out) if bias is None else addmm(bias(env), matrix, weight, out=out)

        if len(node.shape) == 2:  # (a matrix already: no views to take per call, ~1 us each)
            return lambda env, out: product(env, x(env), out)

        def into(env, out):
            if out.numel():  # (an empty buffer has nothing to write, and no row count to infer)
                rows = out.numel() // n
                product(env, x(env).reshape(rows, k), out.view(rows, n))
            return out
        return into

    def matmul_into(self, node: Node):
        """A 2-d `matmul` (an `into` step: wrapper.into_buffer) as one `mm` writing the wrapper's
        buffer, its operands read through the environment (`matmul_direct` where the wrapper
        holds them)."""
        x, y, mm = self.getter(node.args[0]), self.getter(node.args[1]), torch.mm
        return lambda env, out: mm(x(env), y(env), out=out)

    @staticmethod
    def matmul_direct():
        """A 2-d `matmul` on operands the wrapper passes (wrapper.view_operand: a buffer it holds
        or a view of one), writing its buffer `out`: a training backward's products, each a
        fresh result through the environment before (7 us of host time a call more than a bare
        `mm` at LLaMA's --size test, and a fresh result's pages faulting in inside the GEMM)."""
        mm = torch.mm
        return lambda x, y, out: mm(x, y, out=out)

    def linear_direct(self, node: Node, transposed: bool = False):
        """`linear_into` for operands the wrapper holds itself (wrapper.direct_operands): x a
        contiguous tensor of its node's shape, the weight and bias any tensors.  The call takes
        them as arguments and the out buffer last, and sees x and out as matrices through
        `reinterpret`: no environment, no getters, no views made by `reshape` (BERT's linear at
        --size test took 10 us a call through linear_into, 6 as a bare `addmm`).  `transposed`:
        the wrapper passes the matrix the weight is the transpose of ([in, out]), addmm's own
        operand."""
        n, k = node.args[1].shape
        rows = math.prod(node.shape) // n if n else 0
        addmm, mm = torch.addmm, torch.mm
        flat = len(node.shape) != 2
        xs, outs = ((rows, k), (k, 1), 0), ((rows, n), (n, 1), 0)
        if not rows or not n:
            return (lambda x, w, out: out) if no_bias(node) else (lambda x, w, b, out: out)
        mat = (lambda w: w) if transposed else (lambda w: w.t())
        if no_bias(node):
            if flat:
                return lambda x, w, out: (mm(reinterpret(x, *xs), mat(w), out=reinterpret(out, *outs)), out)[1]
            return lambda x, w, out: mm(x, mat(w), out=out)
        if flat:
            return lambda x, w, b, out: (addmm(b, reinterpret(x, *xs), mat(w), out=reinterpret(out, *outs)), out)[1]
        return lambda x, w, b, out: addmm(b, x, mat(w), out=out)

    def linear_call(self, node: Node, contiguous: bool, transposed: bool = False):
        """`linear` on operands the wrapper holds itself (wrapper.direct_operands), without the
        environment and getters a step reads through; contiguous where a generated kernel reads
        the result; `transposed`: the weight passed as the matrix it is the transpose of."""
        linear = torch.nn.functional.linear
        if self.device == "cpu" and same_dtypes(node) and onednn_linear(node):  # (its result is contiguous)
            linear, contiguous = cpu_linear.onednn(), False
        if transposed:
            call = (lambda x, w: linear(x, w.t())) if no_bias(node) else (lambda x, w, b: linear(x, w.t(), b))
        else:
            call = linear
        return (lambda *operands: call(*operands).contiguous()) if contiguous else call


def same_dtypes(node: Node) -> bool:
    """A linear whose operands are of its own dtype, the bias (if any) of the weight's rows."""
    x, w, bias = node.args
    return (len(w.shape) == 2 and x.dtype == w.dtype == node.dtype
            and (no_bias(node) or (bias.dtype == node.dtype and bias.shape == w.shape[:1])))


def onednn_linear(node: Node) -> bool:
    """Whether a CPU linear runs through oneDNN's inner product, not torch's GEMM (cpu_linear)."""
    n, k = node.args[1].shape
    rows = math.prod(node.shape) // n if n else 0
    return cpu_linear.choose(rows, k, n, not no_bias(node), node.args[1].op == "transpose",
                             torch_dtype(node.dtype)) == "onednn"


def no_bias(node: Node) -> bool:
    """A linear whose bias is the plan's scalar 0 (called without one: it would cost a kernel)."""
    bias = node.args[2]
    return bias.op == "const" and bias.attr("value") == 0


def _once(make):
    """A read of a tensor made on the first call (never while a CUDA graph records), then kept."""
    made = []

    def read(env):
        if not made:
            made.append(make())
        return made[0]
    return read


def scalar_tensor(const: Node, consumer: Node, device: str = "cpu") -> torch.Tensor:
    """A scalar operand as torch would type the Python number: in the dtype of
    an arithmetic result (capture gives arithmetic operands that dtype), and
    promoted with the other operand for a comparison."""
    value = const.attr("value")
    number = int(value) if value.is_integer() else value
    strong = [a.dtype for a in consumer.args if a.op != "const" and a.dtype != WEAK]
    if consumer.dtype == "bool" and strong:  # a comparison
        dtype = torch.result_type(torch.empty((), dtype=torch_dtype(strong[-1])), number)
    else:
        dtype = torch_dtype(consumer.dtype if consumer.dtype != "bool" else "float32")
    return torch.tensor(number, dtype=dtype, device=device)


INLINE_VALUES = "inline values"  # env's key of the fused producers one ATen kernel's evaluation computed


def _computed_once(key, compute, reads: dict):
    """`compute` (a fused producer's step, `key` its inline node's id; None: a kernel's own step
    over such producers) with each fused producer computed once per evaluation of the kernel
    that reads it: the getters call their operands' getters, so a producer read twice (`t * t`,
    `x ** tanh(x)`) was computed twice, and a deep program's chain of them 2**n times (a soak
    program ran for minutes, seed 33002).  The values live in env for that evaluation only, and
    only those read by more than one step (`reads`) are kept: the others go once read, as before."""
    def once(env):
        values = env.get(INLINE_VALUES)
        if values is None:  # (the outermost: the kernel's evaluation starts and ends here)
            env[INLINE_VALUES] = {}
            try:
                return once(env)
            finally:
                del env[INLINE_VALUES]
        if key is None or reads.get(key, 0) < 2:
            return compute(env)
        value = values.get(key)
        if value is None:
            value = values[key] = compute(env)
        return value
    return once

