"""Runtime: the target-neutral executor of a plan's kernels on torch buffers.

The target's loader (C++: build and ctypes; Triton: import and launch) turns
the rendered source into one callable per generated kernel, taking torch
tensors (inputs, then outputs).  Library calls and ATen fallbacks run through
torch on views of the same buffers.  Buffers live on the target's device.
"""
from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree

from . import timing
from .codegen.sizes import TEMPLATES
from .errors import InputError
from .graph import Graph, Literal, Node, view_source
from .graphs import GraphedRunner, recorder_for
from .outputs import COPY, Assembly, flat_sequence, whole_buffer
from .plan import Plan, release_schedule, verify_plan
from .steps import TorchSteps, torch_dtype
from .wrapper import KeptBuffers, exec_wrapper, straight_line


class Executable:
    """Runs a plan: generated kernels through the target's loader, the rest through torch."""

    def __init__(self, plan: Plan, source: str, loops, buffer_names: dict[int, str], target,
                 cuda_graphs: bool = False, aliases: dict[str, str] | None = None, lend_outputs=None,
                 autotune: bool = False, keep_buffers: bool = True):
        """`loops`: every generated kernel's loop IR; `aliases`: kernel name -> the kernel
        whose compiled code runs it (codegen.walker.unique_kernels), not in `source`;
        `lend_outputs`: with CUDA graphs, the result positions from which on outputs are
        handed out as the graph's own buffers (graphs.py: a training forward's saved
        activations); `autotune`: a target that tunes its kernels' launches does;
        `keep_buffers`: a CPU program keeps its buffers for its next call, which writes
        those nothing else holds by then (wrapper.KeptBuffers)."""
        self.plan = plan
        self.graph: Graph = plan.graph
        self.target = target
        self.compiled_now = False
        self.loops = loops  # the generated kernels' loop IR
        self._calls = {}
        self.source, self.sizes = source, None  # what is built, and this program's sizes in it (sizes.py)
        aliases = aliases or {}
        if loops:
            tuning = {"autotune": autotune} if target.tunes else {}
            if target.sized is not None:
                self.source, self.sizes = TEMPLATES.source(target.name, source, target.sized)
            if self.sizes is not None:
                tuning["sizes"] = self.sizes
            self._calls, self.compiled_now = target.load(self.source, [lk for lk in loops if lk.name not in aliases],
                                                         **tuning)
            self._calls.update((name, self._calls[same]) for name, same in aliases.items())
        nodes = {name: node for node in _all_nodes(plan) for name in [buffer_names.get(id(node))] if name}
        release = release_schedule(plan)
        verify_plan(plan, release)
        generated_reads = {id(view_source(n)) for k in plan.kernels if k.kind == "generated" for n in k.inputs}
        # inputs that only torch's calls read (a training backward's saved q, k, v, views of the forward's
        # qkv buffer): taken with the caller's strides, never copied to contiguous first
        self._any_strides = frozenset(id(n) for n in self.graph.inputs if id(n) not in generated_reads)
        ordered = {id(k.output) for k in plan.kernels if k.order}  # (stored in another order: orders.py)
        dense = frozenset([id(n) for n in self.graph.inputs if id(n) not in self._any_strides]
                          + [id(n) for n in nodes.values() if id(n) not in ordered])
        computed = frozenset(id(n) for k in plan.kernels for n in k.outputs)
        self.steps = TorchSteps(target.device, dense, computed)  # library calls, fallbacks and views (steps.py)
        self.kept = KeptBuffers() if keep_buffers and target.device == "cpu" and not cuda_graphs and KeptBuffers._uses \
            else None
        self.wrapper = straight_line(self, {lk.name: lk for lk in loops}, nodes, release)
        self._run = self._runner(self.wrapper.names)
        bound = self.graph.bound
        orders = self.graph.orders  # (an input in its storage's order: the caller's tensor permuted)
        self._specs = [(n, id(n), orders.get(n.attr("name"), (None, n.shape))[1], torch_dtype(n.dtype),
                        orders.get(n.attr("name"), (None,))[0]) for n in self.graph.inputs  # per user input
                       if n.attr("name") not in bound]
        self._bound_specs = [(n, id(n), bound[n.attr("name")]) for n in self.graph.inputs if n.attr("name") in bound]
        self._keys = [key for _, key, *_ in self._specs]
        self._constants = self._folded()
        self._permuted = [(i, key, dims) for i, (_, key, _, _, dims) in enumerate(self._specs) if dims is not None]
        self.graphed = None
        self._graph_lock = threading.Lock()  # one call at a time through a graph's buffers and state
        self._assembly: tuple = (None, None)  # (the graph's state it serves, outputs.Assembly) after a replay
        self.checked_by_caller = False  # api._PerSize: each argument's shape, dtype, device (and strides)
        self.strides_by_caller = False  # ...and strides too (a static Dynamo graph): `_bind`'s work is known
        self._made_dense: list | None = None  # after the first call: the arguments it made contiguous
        self._kinds = [self._output_kind(o) for o in self.graph.outputs]
        self._reads = [(id(o), self.steps.getter(o)) for o in self.graph.outputs]  # (each output from the env)
        self._flat = flat_sequence(self.graph.results, Literal)
        self._lent = self._lendable(lend_outputs)
        # a training forward's saved activations: without a graph, handed over as they are (a view
        # of a buffer of this call's with eager's strides, as q, k and v of a qkv buffer), never cloned
        # (and the caller's own tensors it saves, parameters mostly, as they are: AOTAutograd detaches
        # a saved view itself, as it does Inductor's)
        self._saved = self._lent | {i for i in range(lend_outputs or 0, len(self._kinds)) if self._kinds[i][0] == "alias"} \
            if lend_outputs else frozenset()
        self._takers = [self._taker(i, i in self._saved) for i in range(len(self._kinds))]
        recorder = recorder_for(target.device) if cuda_graphs else None
        if recorder is not None:
            user = [id(n) for n in self.graph.inputs if n.attr("name") not in self.graph.bound]
            computed = [i for i in self._lent if self.graph.outputs[i].op != "const"
                        and not self._constant(self.graph.outputs[i])]  # (constants are never rewritten)
            lend = (lambda env: [self._tensor(self.graph.outputs[i], env) for i in computed]) if self._lent else None
            # a backward's incoming gradients (AOTAutograd's `tangents_*`) are fresh tensors per step:
            # copied in per replay from the start, never bet on to stay put
            fresh = frozenset(id(n) for n in self.graph.inputs if n.attr("name").startswith("tangents_"))
            self.graphed = GraphedRunner(self._recorded_run(), user, lend=lend, recorder=recorder,
                                         any_strides=self._any_strides, fresh=fresh)
            if any(k.output.group == "collective" for k in plan.kernels):
                self.graphed.disabled = "the program has collectives, which are not recorded into CUDA graphs"

    def __call__(self, *args):
        if torch.is_grad_enabled():  # compiled programs are inference-only: no autograd graph is recorded
            with torch.no_grad():
                return self._call(args)
        return self._call(args)

    def _call(self, args):
        if self.graphed:
            with self._graph_lock:  # (another thread's call between this one's copies in, replay and
                results = self._results(*self.graphed(self._bind(args)))  # copies out: its results)
        else:
            results = self._results(self._run(self._bind(args)), False)
        if self.graph.mutations:
            self._write_back(args, results)
        return self._structure(results)

    def _results(self, env, owned: bool) -> tuple:
        if owned:
            return self._replayed(env)
        return tuple([take(env) for take in self._takers])

    def _taker(self, i: int, lend: bool):
        """Output `i` of a run without a CUDA graph as a function of the run's values: `_result`,
        or for a saved activation a value of the run or the caller's as it is (a training
        forward's 57 outputs for LLaMA's 2 layers: 115 us a call through `_result`)."""
        key, read = self._reads[i]
        if not (lend and self._kinds[i][0] in ("computed", "alias")):
            return lambda env: self._result(i, env, lend)
        get = dict.get

        def take(env):
            value = get(env, key)
            return read(env) if value is None else value
        return take

    def kernel_times(self, *args, reps: int = 5, inner: int = 5) -> dict[str, float]:
        """Median seconds of each wrapper step over `reps` runs (timing.kernel_times)."""
        return timing.kernel_times(self, args, reps=reps, inner=inner)

    def launch_configs(self) -> dict[str, dict | None]:
        """Each Triton kernel's launch configuration where it was tuned (codegen/triton_tune.py):
        {kernel: {"config": "x<XBLOCK>_r<RBLOCK>_w<warps>", "times_ms": per candidate}}, None
        before its first launch or where it was not tuned."""
        return {name: None if getattr(call, "tuned", None) is None else call.tuned.describe()
                for name, call in self._calls.items()}

    def _runner(self, names: dict):
        """The wrapper over these step callables, each run starting a fresh memo."""
        wrapper = exec_wrapper(self.wrapper.source, names)

        steps = self.steps

        def run(env):
            steps.memo = {}
            return wrapper(env)
        return run

    def _recorded_run(self):
        """The run a CUDA graph records: the wrapper, then the outputs that are views torch
        can only give as copies (a `repeat_interleave`, a reshape of a transpose), so those
        copies are the graph's own buffers too.  Evaluated after a replay instead, each would
        be a launch outside the graph and a fresh tensor per call, at a new address whenever
        other work ran in between: a training forward's saved [B, H, S, D] keys repeated per
        head made the backward's graph record again."""
        layouts = list({id(n): n for n in self.graph.outputs if n.group == "layout"}.values())
        if not layouts:
            return self._run
        run, steps = self._run, self.steps

        def recorded(env):
            env = run(env)
            for node in layouts:
                value = steps.tensor(node, env)
                origin = view_source(node)
                source = env.get(id(origin))
                if source is None or origin.op != "input" or \
                        value.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
                    env[id(node)] = value  # (a view of a caller's tensor stays a view, made again per call;
            return env  # one of the graph's own buffers is kept: a replay hands it out as it is)
        return recorded

    def torch_step(self, kernel, contiguous: bool = True):
        """A library call or ATen fallback as a function of the kernel's inputs.
        Its result is made contiguous where a generated kernel reads it (they
        index buffers as contiguous); torch's own ops take any strides (sdpa's
        output, in the layout the next matmul reads, is not copied twice)."""
        ids = [id(i) for i in kernel.inputs]
        call = self.steps.step(kernel.output)

        def run(*tensors):
            return call(dict(zip(ids, tensors))).contiguous()

        def run_strided(*tensors):
            return call(dict(zip(ids, tensors)))
        return run if contiguous else run_strided

    def torch_step_into(self, kernel):
        """An `into` step (wrapper.into_buffer) as a function of the kernel's inputs, then the
        buffer it writes."""
        ids = [id(i) for i in kernel.inputs]
        into = (self.steps.linear_into if kernel.output.op == "linear" else self.steps.matmul_into)(kernel.output)

        def run(*tensors):
            return into(dict(zip(ids, tensors[:-1])), tensors[-1])
        return run

    def _structure(self, results):
        """The user's result structure: dicts, lists, nested tuples, non-tensors passed through."""
        if self.graph.results is None:
            results = results[:self.graph.user_outputs]
            return results[0] if len(results) == 1 else results
        if self._flat is not None:  # (a flat tuple or list of results: AOTAutograd's graphs, most programs)
            sequence, items = self._flat
            return sequence(items(results))
        spec, leaves = self.graph.results
        return pytree.tree_unflatten([leaf.value if isinstance(leaf, Literal) else results[leaf]
                                      for leaf in leaves], spec)

    def _write_back(self, args, results) -> None:
        """In-place updates the program made to its inputs or buffers."""
        if not self.graph.mutations:
            return
        user = [n.attr("name") for n in self.graph.inputs if n.attr("name") not in self.graph.bound]
        for name, index in self.graph.mutations:
            target = self.graph.bound[name].get() if name in self.graph.bound else args[user.index(name)]
            target.copy_(results[index])

    def _bind(self, args) -> dict[int, torch.Tensor]:
        """The call's tensors by input node. Per call and per input (a model's
        parameters are inputs under Dynamo), so the common case is a few
        attribute reads; `_check` says what is wrong otherwise."""
        cuda, graphed = self.target.device == "cuda", self.graphed is not None and not self.graphed.disabled
        if len(args) != len(self._specs):
            raise InputError(f"expected {len(self._specs)} tensor argument(s) "
                             f"({', '.join(n.attr('name') for n, *_ in self._specs)}), got {len(args)}")
        if self.checked_by_caller and self._constants is not None and (graphed or self._made_dense is not None):
            env = dict(zip(self._keys, args))  # (a replay's host path; a static Dynamo graph's after its first call)
            for i, key, dims in self._permuted:
                env[key] = args[i].permute(dims)
            for key in () if graphed else self._made_dense:  # (strides as the first call's: Dynamo's guards)
                env[key] = env[key].contiguous()
            env.update(self._constants)
            return env
        env = {}
        try:
            for (node, key, shape, dtype, dims), value in zip(self._specs, args):
                if not (isinstance(value, torch.Tensor) and value.dtype == dtype and value.shape == shape
                        and (value.is_cuda if cuda else value.is_cpu)):
                    value = self._check(node, value, shape)
                if dims is not None:
                    value = value.permute(dims)  # (dense where the caller's strides are the captured ones)
                env[key] = value if graphed or key in self._any_strides or value.is_contiguous() else \
                    value.contiguous()  # (graphs.py: inside the graph)
        except RuntimeError:  # (a sparse tensor has no strides to ask about)
            for (node, *_), value in zip(self._specs, args):
                if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                    raise InputError(f"argument {node.attr('name')!r} is a {value.layout} tensor; compiled "
                                     f"programs take dense (strided) tensors (pass .to_dense())") from None
            raise
        for node, key, bound in self._bound_specs:
            env[key] = self._check(node, bound.get())
        if self.strides_by_caller and not graphed and self._made_dense is None:  # (a permuted one is a view)
            self._made_dense = [k for k, v in zip(self._keys, args) if env[k] is not v and env[k].is_contiguous()
                                and k not in {p[1] for p in self._permuted}]
        return env

    def _folded(self) -> dict | None:
        """The bound inputs checked once where all are the program's own constants (folded values,
        which never change); None where one is a module's tensor, or a constant `_check` refuses
        (then every call checks it, and the call, not the compile, reports it)."""
        if any(b.module is not None for _, _, b in self._bound_specs):
            return None
        try:
            return {key: self._check(node, b.get()) for node, key, b in self._bound_specs}
        except InputError:
            return None

    def _check(self, node: Node, value, shape=None) -> torch.Tensor:
        name, shape = node.attr("name"), node.shape if shape is None else shape
        if not isinstance(value, torch.Tensor):
            raise InputError(f"argument {name!r} must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != shape or value.dtype != torch_dtype(node.dtype):
            raise InputError(f"argument {name!r}: compiled for {node.dtype}{list(shape)}, "
                             f"got {str(value.dtype).removeprefix('torch.')}{list(value.shape)}; compile again "
                             f"for the new shape")
        if value.device.type != self.target.device:
            raise InputError(f"argument {name!r} is on {value.device}; target {self.target.name!r} runs on "
                             f"{self.target.device} (compile with inputs on the device it should run on)")
        return value.contiguous()

    def _tensor(self, node: Node, env) -> torch.Tensor:
        return self.steps.tensor(node, env)

    def _constant(self, node: Node) -> bool:
        """A view of one of the program's own constants (a folded value), not the caller's tensor."""
        source = view_source(node)
        bound = self.graph.bound.get(source.attr("name")) if source.op == "input" else None
        return bound is not None and bound.module is None

    def _lendable(self, start) -> frozenset:
        """The outputs at result positions `start`... that kernels compute or that are the program's
        constants (not a view of the caller's input): those a CUDA graph may hand out as its own
        buffers (a training forward's saved activations, which nobody writes to)."""
        if start is None:
            return frozenset()
        leaves = self.graph.results[1] if self.graph.results is not None else range(self.graph.user_outputs)
        picked = {leaf for leaf in list(leaves)[start:] if isinstance(leaf, int)}
        return frozenset(i for i in picked if self.graph.outputs[i].op == "const" or self._constant(self.graph.outputs[i])
                         or view_source(self.graph.outputs[i]).op != "input")

    def _output_kind(self, node: Node) -> tuple[str, int]:
        """("const" | "alias": a view of the caller's input returned as one | "input": a view of an
        input or constant, copied | "computed", the input node's key for "alias")."""
        source = view_source(node)
        if node.op == "const":
            return "const", 0
        if source.op == "input" and self.plan.alias_inputs and not self._constant(node):
            return "alias", id(source)
        return ("input" if source.op == "input" else "computed"), 0

    def _result(self, i: int, env, lend: bool = False) -> torch.Tensor:
        """Output `i` as the caller gets it from a run without a CUDA graph (a replay's: `_replayed`);
        `lend`: a training forward's saved activation, handed over as it is."""
        key, read = self._reads[i]
        value = env.get(key)
        if value is None:
            value = read(env)
        kind, _ = self._kinds[i]
        if lend:  # (a strided view of the graph's buffer too: backward reads it in place)
            return value if kind in ("computed", "alias") else value.detach()
        if kind == "const":
            return value.clone()
        if kind == "alias":
            return value.detach()  # a view of the caller's tensor, as torch returns it
        if kind != "computed" or not (value.is_contiguous() or self._as_eager(i, value)):
            return value.clone(memory_format=torch.contiguous_format)  # never alias the caller's tensors
        return value  # (a transpose of a buffer of ours as it is, with eager's strides: a training
        # forward's saved activation, which backward reads in place)

    def _replayed(self, env) -> tuple:
        """The outputs of a CUDA graph's replay (env's tensors are the graph's own): lent ones the
        graph's buffers, detached; an alias of an input the graph reads in place, detached; the rest
        copied.  By an assembly made once per recording and lending state (outputs.py): the host
        path of a graphed training step, ~40-80 outputs a call."""
        state = (self.graphed.lending, self.graphed.recordings)
        served, assembly = self._assembly
        if served != state:
            actions = [self._replay_action(i, state[0]) for i in range(len(self.graph.outputs))]
            assembly = Assembly(actions, env.keys())
            self._assembly = state, assembly
        return assembly(env)

    def _replay_action(self, i: int, lending: bool) -> tuple:
        key, read = self._reads[i]
        kind, source = self._kinds[i]
        if lending and i in self._lent:
            return key, read, torch.Tensor.detach
        if kind == "const":
            return key, read, torch.Tensor.clone
        if kind == "alias":  # a view of the caller's input: itself while the graph reads it in place
            return key, read, torch.Tensor.detach if self.graphed.in_place(source) else COPY
        return key, read, COPY

    def _as_eager(self, i: int, value: torch.Tensor) -> bool:
        """Output `i` is a whole buffer of ours seen through a permutation of its dims, with
        the strides eager gives it (eager's contiguous results stay contiguous: `.view` works)."""
        strides = self.graph.output_strides.get(i)
        return strides is not None and value.stride() == strides and whole_buffer(value)


def _all_nodes(plan: Plan):
    for node in plan.graph.inputs:
        yield node
    for kernel in plan.kernels:
        yield from kernel.outputs
