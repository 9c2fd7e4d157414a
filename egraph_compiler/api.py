"""Public API: `compile`, `explain`, and the `torch.compile` backend."""
from __future__ import annotations

import difflib
import inspect
import os
import random
import weakref

import torch

from .symbolic import Symbolic, bind_sizes, constants, scalar_slots
from .capture import with_ambient_autocast
from .errors import InputError, OptionError
from .pipeline import REPORT_ENV, Levels, Options, prepare, run_pipeline


class CompiledFunction:
    """A compiled program: call it like the original.  Carries `plan` (the
    chosen kernels), `source` (generated code), `report` (saturation),
    `levels` (every IR level's text) and `sizes` (None, or the values its
    kernels take as arguments where they run on a build shared with programs
    of other sizes: codegen/sizes.py)."""

    def __init__(self, executable, plan, report, levels: Levels, fn=None, options: dict | None = None):
        self._executable = executable
        self._fn = fn
        self._options = options or {}
        self._trainer = None
        self.plan = plan
        self.report = report
        self.levels = levels
        self.source = levels.source
        self.loop_kernels = executable.loops  # the loop IR `source` renders
        self.sizes = executable.sizes

    def __call__(self, *args):
        if torch.is_grad_enabled() and self._needs_grad(args):
            return self._train(args)
        return self._executable(*args)

    def _needs_grad(self, args) -> bool:
        bound = self.plan.graph.bound.values()
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or \
            any(b.get().requires_grad for b in bound)

    def _train(self, args):
        """A call that needs gradients: the program through torch.compile with this
        backend, whose AOTAutograd path compiles a forward and a backward graph
        (on the first such call) with this program's options."""
        if self._fn is None:
            raise InputError("this compiled program has no source function to differentiate: call it under "
                             "torch.no_grad(), or with inputs that do not require grad")
        if self._trainer is None:
            options = self._options

            def backend(gm, example_inputs):
                return dynamo_backend(gm, example_inputs, options=options)
            self._trainer = torch.compile(self._fn, backend=backend, dynamic=False)
        return self._trainer(*args)

    def launch_configs(self) -> dict:
        """The Triton kernels' tuned block sizes and warps, with each candidate's time
        (Executable.launch_configs)."""
        return self._executable.launch_configs()

    @property
    def cuda_graph(self) -> str | None:
        """None without `cuda_graphs=True` on the cuda target; else "recorded",
        "warming up" (before the second call), or "off: <why it could not be recorded>"."""
        graphed = self._executable.graphed
        if graphed is None:
            return None
        return f"off: {graphed.disabled}" if graphed.disabled else "recorded" if graphed.recorded else "warming up"

    def write_report(self, path, measure=None, eclass: str | None = None, title: str = ""):
        """Write the HTML report (htmlreport.py) to `path`; with `measure` (inputs
        to run), each kernel's measured time stands beside its estimate.  Needs a
        program compiled with `report=` (or `keep_egraph=True`) for the captured
        graph and the e-graph views."""
        from .htmlreport import write_report
        measured = self._executable.kernel_times(*measure) if measure is not None else None
        return write_report(path, self, measured, title=title, eclass=eclass)

    @property
    def compiled_now(self) -> bool:
        """False when the generated code came from the on-disk cache."""
        return self._executable.compiled_now


def compile(fn, example_inputs, *, target=None, rules=(), disable=(), unsafe=False,
            iter_limit=30, node_limit=50_000, time_limit=10.0, strict=False, extraction="greedy",
            ilp_time_limit=5.0, profile=None, dot=False, trust_rules=False, cuda_graphs=False,
            alias_inputs=False, progress=None, report=None, keep_egraph=False, cache=None,
            lend_outputs=None, autotune=False, keep_buffers=True) -> CompiledFunction:
    """Compile a function or nn.Module for inputs shaped like `example_inputs`.

    rules: extra rule files (paths) or rule text added to the library.
    disable: rule or group names switched off.  unsafe: True, or names of
    unsafe rules/groups to switch on.  iter_limit / node_limit / time_limit
    (seconds) bound saturation.  strict: an op outside the vocabulary raises
    instead of falling back to ATen.  extraction: "greedy" (DAG-aware), or
    "ilp" to also solve the integer program (HiGHS, `ilp_time_limit` seconds)
    and keep the cheaper plan.  profile: the cost model's device profile
    ("cpu" is calibrated on this machine by default; "cpu-default", "h200").
    dot: keep the saturated e-graph as Graphviz DOT text in `levels.dot`.
    trust_rules: skip the numerical check that user rules get on first use
    (a rule that fails it is refused with a counterexample).
    cuda_graphs: on the cuda target, record the program into a CUDA graph on its
    second call and replay it after that (inputs copied in, outputs copied out;
    see graphs.py); ignored on other targets.
    autotune: time a few block sizes and warps for each Triton kernel at its first
    launch and keep the fastest on disk, so that a later compile of the same kernel
    uses it without timing (codegen/triton_tune.py; the EGC_AUTOTUNE environment
    variable, 1 or 0, overrides it); without it, the renderer's heuristic sizes.
    lend_outputs: with cuda_graphs, the position in the results from which on
    outputs are the graph's own buffers instead of copies; while the caller holds
    any of them, a call runs without the graph (a training forward lends the
    activations it saves for backward).
    alias_inputs: outputs that are inputs or views of inputs are returned as
    views of the caller's tensors, as eager torch returns them, instead of
    copies (training graphs use it for the tensors they hand to backward).
    progress: called after each saturation iteration with (iterations so far,
    e-nodes, seconds elapsed); `egc explain` draws a live line from it.
    report: a path: write the HTML report of this compile there (one
    self-contained page; `egc explain --html` and the EGC_REPORT=DIR environment
    variable, a page per compile plus an index.html, write the same).
    keep_egraph: keep the captured graph and saturated e-graph in `levels`, for
    `write_report` later (implied by `report` and EGC_REPORT).
    cache: the shared compile cache, "redis://HOST:PORT/DB" (default: the
    EGC_REMOTE_CACHE environment variable; False: none): built C++ libraries are
    fetched from it instead of compiled, and stored there after a build (remote.py).
    keep_buffers: a CPU program keeps the buffers it allocates (its results too) for
    its next call, which writes one again only where nothing else holds it by then (no
    result or view the caller keeps, no activation autograd still saves), so their pages
    do not fault in again each call; False gives them back every call (wrapper.KeptBuffers).
    """
    example_inputs = _check_examples(example_inputs)
    if extraction not in ("greedy", "ilp"):
        raise ValueError(f"extraction must be 'greedy' or 'ilp', not {extraction!r}")
    options = Options(target, list(rules), list(disable), unsafe, iter_limit, node_limit, time_limit, strict,
                      profile=profile, extraction=extraction, ilp_time_limit=ilp_time_limit, dot=dot,
                      trust_rules=trust_rules, cuda_graphs=cuda_graphs, alias_inputs=alias_inputs, progress=progress,
                      keep_egraph=bool(keep_egraph or report or os.environ.get(REPORT_ENV)), cache=cache,
                      lend_outputs=lend_outputs, autotune=autotune, keep_buffers=keep_buffers)
    kwargs = dict(target=target, rules=rules, disable=disable, unsafe=unsafe, iter_limit=iter_limit,
                  node_limit=node_limit, time_limit=time_limit, strict=strict, extraction=extraction,
                  ilp_time_limit=ilp_time_limit, profile=profile, trust_rules=trust_rules, cuda_graphs=cuda_graphs,
                  alias_inputs=alias_inputs, cache=cache, autotune=autotune, keep_buffers=keep_buffers)
    compiled = CompiledFunction(*run_pipeline(fn, example_inputs, options), fn=fn, options=kwargs)
    if report:
        compiled.write_report(report)
    if os.environ.get(REPORT_ENV):
        from .htmlreport import report_dir_page
        report_dir_page(os.environ[REPORT_ENV], compiled, _name(fn))
    return compiled


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _check_examples(example_inputs) -> list:
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs]
    if not isinstance(example_inputs, (list, tuple)):
        raise InputError(f"example_inputs must be a list or tuple of tensors, not {type(example_inputs).__name__}")
    for i, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            raise InputError(f"example input {i} is a {type(value).__name__}; compiled programs take tensors "
                             f"(bind other arguments with functools.partial, or pass torch.tensor(value))")
        if value.layout != torch.strided:
            raise InputError(f"example input {i} is a {value.layout} tensor; compiled programs take dense "
                             f"(strided) tensors: pass .to_dense(), or run this part eagerly")
    return _unaliased(example_inputs)


def _unaliased(example_inputs) -> list:
    """The examples, each sharing memory with an earlier one cloned: capture traces by tensor, so
    the same tensor passed as two arguments would become one input of the program, and a later
    call with two different tensors would read only one of them."""
    seen, out = set(), []
    for value in example_inputs:
        try:
            key = (value.device, value.untyped_storage().data_ptr()) if value.numel() else None
        except (RuntimeError, NotImplementedError):  # (no storage: sparse, nested)
            key = None
        if key is not None and key in seen:
            value = value.detach().clone().requires_grad_(value.requires_grad)
        out.append(value)
        seen.add(key)
    return out


def explain(fn, example_inputs, **kwargs) -> Levels:
    """Each level's text: ATen graph, Graph IR, e-graph, plan, loop IR, source
    (and, with dot=True, the saturated e-graph in Graphviz DOT)."""
    return compile(fn, example_inputs, **kwargs).levels


_COMPILED: list = []  # weak references to the programs compiled through backend="egraph", most recent
# last (see last_plans): a program a graph's cache evicted is freed (held here, every size a long
# generation met stayed in memory, CUDA graphs' pools included)


def last_plans(clear: bool = False) -> list:
    """The plans compiled through `torch.compile(..., backend="egraph")` in this
    process, most recent last (one per graph, one per size of a dynamic graph,
    a forward and a backward plan per training graph): what a test inspects.
    Only programs still in use are listed (a size evicted from its graph's
    cache is gone).  `clear=True` empties the record."""
    return [c.plan for c in last_compiled(clear)]


def last_compiled(clear: bool = False) -> list:
    """As `last_plans`, the compiled programs themselves (`.plan`, `.source`, `.levels`)."""
    compiled = [c for c in (ref() for ref in _COMPILED) if c is not None]
    if clear:
        _COMPILED.clear()
    return compiled


def dynamo_backend(gm, example_inputs, **kwargs):
    """`torch.compile(model, backend="egraph")`: compile each captured graph.

    A graph with symbolic sizes (`dynamic=True`, or Dynamo's automatic dynamic
    shapes after a shape change) is compiled once per distinct size it is
    called with: the graph is exported once with its sizes dynamic (symbolic.py), each
    size has its own plan, its kernels share one build with other sizes where only sizes
    differ (codegen/sizes.py), and a size seen before reuses its program.
    `torch.compile(..., options={...})` passes `compile`'s keyword arguments
    (target, rules, disable, ...); `mode="reduce-overhead"` (and "max-autotune")
    turns on CUDA graphs (`cuda_graphs=True`), "max-autotune" also tuned Triton
    launch configurations (`autotune=True`); other modes have no effect.
    A graph that needs gradients goes through AOTAutograd (training.py): its
    forward and backward graphs are compiled the same way."""
    mode = kwargs.get("mode")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("options", "mode")} | dict(kwargs.get("options") or {})
    _check_options(kwargs)
    if mode in ("reduce-overhead", "max-autotune") and "cuda_graphs" not in kwargs:
        kwargs["cuda_graphs"] = True  # as Inductor's modes do: CUDA graphs on the cuda target
    if mode == "max-autotune" and "autotune" not in kwargs:
        kwargs["autotune"] = True
    prepare(kwargs.get("target"), example_inputs)  # (the compile workers start while AOTAutograd traces)
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        from .training import training_backend  # AOTAutograd: forward and backward graphs, each compiled
        return training_backend(gm, example_inputs,
                                lambda graph, guarded=False, **extra: _PerSize(graph, kwargs | {"alias_inputs": True}
                                                                               | extra, guarded=guarded))
    per_size = _PerSize(with_ambient_autocast(gm), kwargs, guarded=True)
    if all(isinstance(x, torch.Tensor) and all(isinstance(d, int) for d in x.shape) for x in example_inputs):
        per_size.compile(list(example_inputs))  # a static graph: compiled now, as Dynamo expects
        if not per_size.scalars:  # Dynamo's guards hold its arguments to these shapes and dtypes (and
            program = per_size.compiled  # the program's own input check stands behind them): no key per call

            def run_static(*args):
                return _as_tuple(program(*args))
            run_static.compiled = program
            return run_static

    def run(*args):
        return per_size(*args)
    run.compiled = per_size.compiled
    return run


def _check_options(kwargs: dict) -> None:
    """Options are `compile`'s keyword arguments; a misspelt one is named, with the likely one."""
    known = [p.name for p in inspect.signature(compile).parameters.values() if p.kind == p.KEYWORD_ONLY]
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=2)
            raise OptionError(f"torch.compile(backend='egraph') has no option {name!r}"
                              + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
                              + f" (options: {', '.join(known)})")


class _PerSize:
    """A Dynamo graph, compiled for each distinct (shape, dtype, device) of its
    tensor arguments and each value of its size arguments (SymInts at capture)
    and of its float arguments (a Python float whose value changed between
    calls, which Dynamo passes as a 0-d tensor read by `.item()`).

    At most LIMIT programs are kept (GRAPHED_LIMIT with CUDA graphs, each of which
    holds its own memory pool); a new one past that evicts one at random (seeded:
    reproducible).  Sizes come in cycles (`generate()` meets each sequence length
    once per call), and a cycle longer than the cache evicts, under least recently
    used, each size just before it comes again: a second 30-token generation
    compiled all 29 lengths again.  Random eviction keeps a share of them."""
    LIMIT, GRAPHED_LIMIT = 64, 16

    def __init__(self, gm, kwargs, guarded: bool = False):
        self.gm, self.kwargs, self.programs, self.compiled = gm, kwargs, {}, None
        self.guarded = guarded  # a graph Dynamo hands over, or AOTAutograd's forward of one (its inputs are
        # Dynamo's graph's, held by its guards), not a backward (saved activations, incoming gradients)
        self.scalars = scalar_slots(gm)
        self.symbolic: dict = {}  # the values bound as constants -> the graph exported for every size
        self.limit = self.GRAPHED_LIMIT if kwargs.get("cuda_graphs") else self.LIMIT
        self._evict = random.Random(0)

    def _key(self, args) -> tuple:
        return tuple(("item", a.item()) if i in self.scalars else
                     (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                     for i, a in enumerate(args))

    def compile(self, args: list):
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self.scalars]
        gm = self.gm if len(slots) == len(args) else bind_sizes(self.gm, args, self.scalars)
        tensors = [args[i] for i in slots]
        values = constants(self.gm, args, self.scalars)
        key = repr(sorted(values.items()))
        if key not in self.symbolic:
            self.symbolic[key] = Symbolic(self.gm, values)
            while len(self.symbolic) > self.limit:
                del self.symbolic[next(iter(self.symbolic))]
        exported = self.symbolic[key].program(tensors)
        gm.egc_exported = exported  # (capture's ATen graph at these sizes; None: it exports them)
        try:
            compiled = compile(gm, tensors, **self.kwargs)
        finally:
            del gm.egc_exported
        # the key below checks each argument's shape, dtype and device, and Dynamo's guards (and
        # AOTAutograd's runtime) hold the calls that skip it to those the graph was traced for
        compiled._executable.checked_by_caller = True
        compiled._executable.strides_by_caller = self.guarded and _static_graph(self.gm)
        if compiled._executable.graphed is not None:  # (strides too: Dynamo guards those of static graphs)
            compiled._executable.graphed.strides_checked = _static_graph(self.gm)
        while len(self.programs) >= self.limit:
            self.programs.pop(self._evict.choice(list(self.programs)), None)  # (pop: threads may race)
        self.programs[self._key(args)] = (compiled, slots)
        _COMPILED[:] = [ref for ref in _COMPILED if ref() is not None] + [weakref.ref(compiled)]
        self.compiled = compiled  # the latest, for tests
        return compiled, slots

    def __call__(self, *args):
        entry = self.programs.get(self._key(args))
        compiled, slots = entry if entry is not None else self.compile(list(args))
        return _as_tuple(compiled(*(args[i] for i in slots)))


def _static_graph(gm) -> bool:
    """Every input of the graph a tensor of fixed sizes (Dynamo guards such tensors' strides)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val", node.meta.get("example_value"))
            if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
                return False
    return True


def _as_tuple(out) -> tuple:
    """A compiled graph's results as Dynamo takes them."""
    return out if isinstance(out, tuple) else (out,)
