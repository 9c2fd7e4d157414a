"""The pipeline: the one place that knows the order of the stages.

capture -> encode (+rules) -> saturate -> extract -> plan -> lower -> render -> load.
Each stage's output prints; `Levels` keeps those texts for `explain` and for
the EGC_DEBUG environment variable.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field

from .codegen import get_target
from .codegen.walker import unique_kernels
from . import capture as capture_mod
from . import cpu_linear, remote
from .calibrate import profile_for
from .dsl.library import LOWERING, check_unique, library_phases, library_rules, load_user_items, schedule, select
from .dsl.parser import Phase
from .dsl.trust import check_user_rules
from .egraph import encode, extract, saturate
from .egraph.egg import EgglogSession
from .egraph.facts import FactFeeder, needs_facts
from .egraph import ilp
from .egraph.greedy import build, extract_kernels
from .errors import EgraphCompilerError, UnsupportedOpError
from .graph import Graph
from .lower import lower_kernel
from .orders import storage_orders
from .plan import Plan, make_plan
from .runtime import Executable
from .folding import fold_constants
from .siblings import fuse_siblings

DEBUG_ENV = "EGC_DEBUG"
REPORT_ENV = "EGC_REPORT"  # a directory: every compile writes an HTML report page there (htmlreport.py)
PROFILE_ENV = "EGC_PROFILE"  # the default device profile (tests pin "cpu-default" for stable plans)
_warned: set[str] = set()


@dataclass
class Options:
    target: str | None = None  # cpu | cuda | triton; None: cuda when the inputs are on a GPU
    rules: list = field(default_factory=list)
    disable: list = field(default_factory=list)
    unsafe: object = False
    iter_limit: int = 30
    node_limit: int = 50_000
    time_limit: float = 10.0
    strict: bool = False
    profile: str | None = None
    extraction: str = "greedy"  # greedy | ilp
    ilp_time_limit: float = 5.0
    dot: bool = False  # keep the saturated e-graph as Graphviz DOT text (levels.dot)
    trust_rules: bool = False  # skip the numerical check of user rules
    cuda_graphs: bool = False  # replay the program as one CUDA graph (cuda target; graphs.py)
    autotune: bool = False  # time launch configurations of Triton kernels (codegen/triton_tune.py)
    alias_inputs: bool = False  # outputs that view an input are returned as views, not copies
    lend_outputs: int | None = None  # with cuda_graphs: outputs from this position on are the graph's own (graphs.py)
    progress: object = None  # progress(iterations, e-nodes, seconds) after each saturation iteration
    keep_egraph: bool = False  # keep the captured graph, e-classes and rules in Levels (for reports)
    cache: object = None  # the shared compile cache: a redis:// URL, False (none), None (EGC_REMOTE_CACHE)
    keep_buffers: bool = True  # a CPU program keeps its buffers for its next call (wrapper.KeptBuffers)


@dataclass
class Levels:
    aten: str = ""
    graph: str = ""
    egraph: str = ""
    plan: str = ""
    loops: str = ""
    source: str = ""
    wrapper: str = ""  # the straight-line Python each call runs
    dot: str = ""  # the saturated e-graph (Graphviz), when asked for
    timings: dict = field(default_factory=dict)
    # with Options.keep_egraph (reports): the captured Graph, the saturated e-classes, the rules
    captured: object = None
    eclasses: object = None
    rules: list = field(default_factory=list)

    def __str__(self) -> str:
        parts = [("ATen graph", self.aten), ("Graph IR", self.graph), ("e-graph", self.egraph),
                 ("plan", self.plan), ("loop IR", self.loops), ("source", self.source), ("wrapper", self.wrapper)]
        return "\n\n".join(f"=== {title} ===\n{text}" for title, text in parts)


def run_pipeline(fn, example_inputs, options: Options):
    """Returns (executable, plan, report, levels)."""
    target = _target(options.target, example_inputs)
    prepare(target)
    levels = Levels()
    graph, eclasses, report, rules = build_egraph(fn, example_inputs, options, levels, target)

    profile = profile_of(options, target)
    clock = time.perf_counter()
    plan = _extract(eclasses, graph, profile, options, target, rules)
    plan.rules_fired = dict(report.matches)
    levels.timings["extract"] = time.perf_counter() - clock
    _warn_fallbacks(plan)

    executable = lower_and_load(plan, rules, target, options, levels)
    if os.environ.get(DEBUG_ENV):
        print(levels, file=sys.stderr)
    return executable, plan, report, levels


def lower_and_load(plan: Plan, rules, target, options: Options, levels: Levels) -> Executable:
    """plan -> loop IR -> source -> a loaded Executable (levels get the texts)."""
    buffer_names = _buffer_names(plan.graph, plan)
    storage_orders(plan)  # (elementwise outputs that attention reads, kept in their input's order)
    loops = [lower_kernel(k, buffer_names, target.exact_mean) for k in plan.kernels if k.kind == "generated"]
    loops, followers = fuse_siblings(plan, loops, rules)
    for kernel in plan.kernels:
        kernel.loop_nest = followers.get(kernel.name, "")
    levels.plan = str(plan) + "\n\n" + str(plan.graph)
    levels.loops = "\n\n".join(str(k) for k in loops)
    rendered, aliases = unique_kernels(loops, target.kernel_source)  # a repeated layer's kernels: compiled once
    levels.source = target.render(rendered)
    clock = time.perf_counter()
    with remote.using(options.cache):
        executable = Executable(plan, levels.source, loops, buffer_names, target, cuda_graphs=options.cuda_graphs,
                                aliases=aliases, lend_outputs=options.lend_outputs,
                                autotune=options.autotune, keep_buffers=options.keep_buffers)
    if executable.sizes is not None:  # a template's build, serving programs of other sizes (codegen/sizes.py)
        levels.source = target.sized.note(executable.sizes) + executable.source
    levels.wrapper = executable.wrapper.source
    levels.timings["load"] = time.perf_counter() - clock
    return executable


def profile_of(options: Options, target):
    """The cost model's device profile: the option, else EGC_PROFILE, else the target's."""
    return profile_for(options.profile or os.environ.get(PROFILE_ENV) or
                       ("h200" if target.device == "cuda" else "cpu"))


def build_egraph(fn, example_inputs, options: Options, levels: Levels | None = None, target=None):
    """capture -> encode -> rules -> saturate; returns (graph, typed e-classes, report, rules).
    `target`: the compile's target object (derived from the options and inputs where None)."""
    levels = levels or Levels()
    clock = time.perf_counter()
    graph, levels.aten = capture_mod.capture(fn, example_inputs)
    graph = fold_constants(graph, next((x.device for x in example_inputs if hasattr(x, "device")), "cpu"))
    levels.graph = str(graph)
    _check_externs(graph, options.strict)
    user = load_user_items(options.rules)
    rules = [r for r in library_rules() if r.group != LOWERING] + [r for r in user if not isinstance(r, Phase)]
    check_unique(rules)
    if not options.trust_rules:
        check_user_rules(user)  # each user rule verified on tensors once (cached by its text)
    rules = select(rules, options.disable, options.unsafe)
    if not _onednn_target(target, options.target, example_inputs):  # (after select: disabling them is never an error)
        rules = [r for r in rules if r.group != cpu_linear.RULES]
    phases = library_phases() + [p for p in user if isinstance(p, Phase)]
    levels.timings["capture"] = time.perf_counter() - clock

    session = _new_session(rules, {n.op for n in graph.topo()} | {n.op for n in graph.inputs})
    text, names = encode.encode_graph(graph)
    session.run(text)
    limits = saturate.Limits(options.iter_limit, options.node_limit, options.time_limit)
    feeder = FactFeeder(session, graph) if needs_facts(rules) else None
    report = saturate.saturate(session, schedule(rules, phases), limits, feeder, options.progress)
    levels.egraph = str(report)
    eclasses = extract.load(session.serialized(), graph, names)
    if options.dot:
        levels.dot = session.dot()
    extract.infer_types(eclasses, graph)
    if options.keep_egraph:
        levels.captured, levels.eclasses, levels.rules = graph, eclasses, rules
    return graph, eclasses, report, rules


def _new_session(rules, present: set[str]) -> EgglogSession:
    """A fresh egglog session with these rules installed, one per compile.
    Sessions were once reused across compiles inside push/pop scopes: a program
    compiled after others could then be rewritten with an equality that held
    only for an earlier program (`0.5 - t` became `t - t`; found by the soak),
    so installing the rules again (~0.3 s) is the price of never sharing state."""
    session = EgglogSession()
    session.run(encode.declarations())
    saturate.install_rules(session, rules, present)  # (fusions only for ops the program can come to hold)
    return session


def prepare(target, example_inputs=()) -> None:
    """Start what loading for the target will need (Triton on a GPU: its compile workers),
    as early as the caller knows it (a target's name is read with the example inputs; one
    that names no target, or names it wrongly, prepares nothing: the compile reports it)."""
    if isinstance(target, str) or target is None:
        tensors = [x for x in example_inputs if hasattr(x, "device")]  # (not a SymInt)
        try:
            target = _target(target, tensors)
        except EgraphCompilerError:
            return
    if target.prepare is not None:
        target.prepare()


def _onednn_target(target, name: str | None, example_inputs) -> bool:
    """Whether oneDNN's linears with their epilogues (rules/onednn.rules) are installed: the C++
    target (not Triton's on CPU tensors, which tests its renderer), where they are asked for and
    this torch has them (cpu_linear.epilogues)."""
    if target is None:
        try:
            target = _target(name, [x for x in example_inputs if hasattr(x, "device")])
        except EgraphCompilerError:
            return False  # (the compile reports it)
    return target.name == "cpu" and cpu_linear.epilogues()


def _target(name: str | None, example_inputs):
    if name is None:
        name = "cuda" if any(x.device.type == "cuda" for x in example_inputs) else "cpu"
    try:
        target = get_target(name)
    except ValueError as exc:
        raise EgraphCompilerError(str(exc)) from None
    devices = {x.device.type for x in example_inputs}
    if devices - {target.device}:
        raise EgraphCompilerError(f"target {name!r} runs on {target.device}, but example inputs are on "
                                  f"{', '.join(sorted(devices))}")
    return target


def _extract(eclasses, graph: Graph, profile, options: Options, target, rules=()) -> Plan:
    """Greedy by default; with extraction='ilp' also the integer program, and
    the plan with the lower estimated cost wins.  Both costs are reported."""
    best, dag_cost = extract_kernels(eclasses, graph, profile)
    plan = make_plan(best, profile, target, options.alias_inputs, rules)
    plan.extraction = (f"extraction: greedy (DAG cost {dag_cost * 1e6:.1f}us, plan {plan.cost * 1e6:.1f}us) "
                       f"over {eclasses.enode_count} e-nodes")
    if options.extraction != "ilp":
        return plan
    result = ilp.solve(eclasses, profile, options.ilp_time_limit)
    if result.choice is None:
        plan.extraction += f"; ilp: {result.status}, kept greedy"
        return plan
    ilp_plan = make_plan(build(eclasses, ilp.as_extractor(eclasses, profile, result.choice), graph), profile, target,
                         options.alias_inputs, rules)
    winner = ilp_plan if ilp_plan.cost < plan.cost else plan
    winner.extraction = (plan.extraction + f"; ilp: {result.status}, objective {result.objective * 1e6:.1f}us, "
                         f"plan {ilp_plan.cost * 1e6:.1f}us; chose {'ilp' if winner is ilp_plan else 'greedy'}")
    return winner


def _buffer_names(graph: Graph, plan: Plan) -> dict[int, str]:
    names = {id(n): f"in{i}" for i, n in enumerate(graph.inputs)}
    for k in plan.kernels:
        names[id(k.output)] = f"buf{k.name[1:]}"
        names.update((id(n), f"buf{k.name[1:]}_{j}") for j, n in enumerate(k.extra_outputs, 1))
    return names


def _check_externs(graph: Graph, strict: bool) -> None:
    for node in graph.topo():
        if node.op == "extern" and strict:
            call = node.attr("target")
            raise UnsupportedOpError(f"unsupported op {str(call).split('#')[0]} at {call.where} "
                                     f"(strict=True turns ATen fallbacks into errors)")


def _warn_fallbacks(plan: Plan) -> None:
    """Each fallback once per process for each op, reason and source line: a model's layers share a
    line (one warning), a second model or function reaching the op elsewhere is warned again."""
    for entry in plan.fallbacks:
        if entry not in _warned:
            _warned.add(entry)
            warnings.warn(f"egraph-compiler: {entry} runs through ATen (listed in plan.fallbacks)", stacklevel=4)
