"""`egc`: the command line (typer).  Explain a program level by level, and
check, list or verify rules.

A user's mistake (a missing path, a rule that does not parse, a program file
that fails to import) ends in one `error: ...` line on stderr, or a RuleError's
caret block, and exit code 2 (the command line itself is wrong) or 1 (what it
names is); `egc --debug ...` shows the traceback instead.  Anything else is a
bug in the compiler and keeps its traceback."""
from __future__ import annotations

import functools
import importlib.util
import sys
import traceback
from pathlib import Path

import typer

from . import workloads
from .dsl.library import check_unique, library_rules
from .dsl.parser import Phase, parse_rules
from .errors import EgraphCompilerError

app = typer.Typer(help="egraph-compiler: a rule-driven optimising compiler for PyTorch.", no_args_is_help=True)
rules_app = typer.Typer(help="Check, list and verify rules.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")
profile_app = typer.Typer(help="Show, calibrate or reset the cost model's device profiles.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")

LEVELS = ("aten", "graph", "egraph", "plan", "loops", "source", "wrapper", "all")
SIZES = ("test", "cpu", "gpu")
_debug = False  # set by the --debug option of the app's callback


class UsageError(Exception):
    """The command line is wrong (a path or name that does not exist): exit code 2."""


class InputFailure(Exception):
    """What the command line names is wrong (unreadable, or a program that cannot be loaded): exit code 1."""


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="show the traceback of an error")):
    global _debug
    _debug = debug


def reports_errors(command):
    """Turn a user's mistake into one `error:` line and an exit code, unless --debug."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (UsageError, InputFailure, EgraphCompilerError) as exc:
            if _debug:
                raise
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2 if isinstance(exc, UsageError) else 1) from None
    return run


# ---- loading what the command line names ----

def rule_files(paths: list[Path]) -> list[Path]:
    """Each path as given, a directory as its `*.rules` files (sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.rules"))
            if not found:
                raise UsageError(f"{path}: a directory without *.rules files")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such file or directory")
    return files


def load_rules(paths: list[Path]) -> list:
    """The rules (and fuse statements, not phases) of these paths, or of the library when none."""
    rules = library_rules() if not paths else [r for f in rule_files(paths) for r in parse_rules(_read(f), str(f))
                                               if not isinstance(r, Phase)]
    check_unique(rules)
    return rules


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFailure(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from exc


def load_program(target: str, size: str):
    """A workload name, or PATH.py[:FUNCTION]: the file's `program` (or FUNCTION)
    with inputs from its `example_inputs()` (or `FUNCTION_example_inputs()`)."""
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
    if target in workloads.NAMES:
        return workloads.make(target, size)
    file, _, name = target.partition(".py:")
    path = Path(file + ".py" if name else target)
    if not path.is_file():
        raise UsageError(f"{path}: neither a workload ({', '.join(workloads.NAMES)}) nor a file")
    module = _guarded(path, "importing it", lambda: _import(path))
    program_name = name or "program"
    factory = f"{name}_example_inputs" if name and hasattr(module, f"{name}_example_inputs") else "example_inputs"
    missing = [n for n in (program_name, factory) if not hasattr(module, n)]
    if missing:
        raise InputFailure(f"{path}: defines no {' and no '.join(missing)} (a program file exposes `program` and "
                           "`example_inputs()`, or FUNCTION and `FUNCTION_example_inputs()` for PATH.py:FUNCTION)")
    return getattr(module, program_name), _guarded(path, f"{factory}()", getattr(module, factory))


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError("not a Python source file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _guarded(path: Path, what: str, action):
    """Run the user's code; an exception it raises is their mistake, named with its line in their file."""
    try:
        return action()
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = f"{path}:{exc.lineno}"
        text = str(exc).strip().splitlines()
        raise InputFailure(f"{where}: {what} failed: {type(exc).__name__}: {text[0] if text else ''}") from exc


# ---- commands ----

@app.command()
@reports_errors
def explain(target: str = typer.Argument(..., help="workload name, PATH.py (program, example_inputs()) or "
                                                   "PATH.py:FUNCTION"),
            size: str = typer.Option("test", help="workload size: test, cpu or gpu"),
            compile_for: str = typer.Option(None, "--target", help="cpu (C++), triton or cuda (default: the "
                                                                   "inputs' device)"),
            unsafe: bool = typer.Option(False, help="enable unsafe rules"),
            level: str = typer.Option("all", help="one of aten, graph, egraph, plan, loops, source, wrapper, all"),
            dot: Path = typer.Option(None, help="also write the saturated e-graph here (Graphviz DOT)"),
            html: Path = typer.Option(None, "--html", help="also write the HTML report here (one page)"),
            svg: Path = typer.Option(None, "--svg", help="also write the pictures (SVG) into this directory"),
            measure: bool = typer.Option(False, help="time each kernel for the report (--html)"),
            eclass: str = typer.Option(None, help="the e-class the report's e-graph view centres on")):
    """Print each IR level of a compiled program (and write its HTML report or pictures)."""
    from .api import compile as compile_program
    if level not in LEVELS:
        raise UsageError(f"unknown level {level!r}; one of {', '.join(LEVELS)}")
    fn, inputs = load_program(target, size)
    if compile_for not in (None, "cpu", "triton", "cuda"):
        raise UsageError(f"unknown target {compile_for!r}; one of cpu, triton, cuda")
    progress, done = progress_line()
    try:
        compiled = compile_program(fn, inputs, unsafe=unsafe, dot=dot is not None, target=compile_for,
                                   progress=progress, keep_egraph=html is not None or svg is not None)
    finally:
        done()
    levels = compiled.levels
    if eclass is not None and (html is None or eclass not in levels.eclasses.classes):
        raise UsageError(f"--eclass {eclass}: " + ("it goes with --html" if html is None else
                                                   "no such e-class in this e-graph (the report names them)"))
    _write(dot, lambda: dot.write_text(levels.dot))
    _write(html, lambda: compiled.write_report(html, measure=inputs if measure else None, eclass=eclass,
                                               title=target))
    if svg is not None:
        from .htmlreport import write_svgs
        _write(svg, lambda: write_svgs(svg, compiled))
    if sys.stdout.isatty():
        _show(compiled, level)
    else:
        typer.echo(str(levels) if level == "all" else getattr(levels, level))


def _show(compiled, level: str) -> None:
    """On a terminal: the plan as a table and the code syntax-highlighted (rich)."""
    from rich.console import Console
    from rich.rule import Rule
    from rich.syntax import Syntax
    from rich.table import Table
    console, levels = Console(), compiled.levels
    language = "cpp" if compiled._executable.target.name == "cpu" else "python"
    titles = {"aten": "ATen graph", "graph": "Graph IR", "egraph": "e-graph", "plan": "plan", "loops": "loop IR",
              "source": "source", "wrapper": "wrapper"}
    for name, title in titles.items():
        if level not in ("all", name):
            continue
        console.print(Rule(title))
        if name == "plan":
            table = Table(title=f"{len(compiled.plan.kernels)} kernel(s), estimated {compiled.plan.cost * 1e6:.1f} us")
            for column in ("kernel", "kind", "ops", "output", "bytes", "estimate"):
                table.add_column(column)
            colours = {"generated": "green", "library": "blue", "aten": "red"}
            for k in compiled.plan.kernels:
                ops = " -> ".join(n.op for n in k.ops if n.group != "boundary")
                table.add_row(k.name, f"[{colours[k.kind]}]{k.kind}[/]", ops, str(k.output.shape),
                              f"{k.bytes:,.0f}", f"{k.seconds * 1e6:.1f} us")
            console.print(table)
            console.print(getattr(levels, name), markup=False, highlight=False, soft_wrap=True)
        elif name in ("source", "wrapper"):
            console.print(Syntax(getattr(levels, name), language if name == "source" else "python"))
        else:
            console.print(getattr(levels, name), markup=False, highlight=False, soft_wrap=True)


def _write(path: Path | None, action) -> None:
    if path is None:
        return
    try:
        action()
    except OSError as exc:
        raise InputFailure(f"{path}: cannot write it: {exc.strerror or exc}") from exc


def progress_line(after: float = 1.0):
    """(progress callback, done): a live line on stderr (iteration, e-nodes, elapsed)
    once saturation has run `after` seconds, on a terminal only; silent when piped."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from rich.console import Console
    console, status = Console(stderr=True), []

    def report(iterations: int, enodes: int, seconds: float) -> None:
        if seconds < after:
            return
        text = f"saturating: iteration {iterations}, {enodes} e-nodes, {seconds:.1f} s"
        if not status:
            status.append(console.status(text))
            status[0].start()
        status[0].update(text)

    def done() -> None:
        if status:
            status[0].stop()
    return report, done


PATHS = typer.Argument(None, help="rules files or directories of them (default: the library)")


@rules_app.command("check")
@reports_errors
def rules_check(paths: list[Path] = PATHS):
    """Parse and type-check rules files."""
    rules = load_rules(paths or [])
    typer.echo(f"ok: {len(rules)} rule(s) in {len({r.path for r in rules})} file(s)")


@rules_app.command("list")
@reports_errors
def rules_list(paths: list[Path] = PATHS):
    """Print rules by group."""
    rules = load_rules(paths or [])
    for group in dict.fromkeys(r.group for r in rules):
        typer.echo(f"{group}:")
        for r in rules:
            if r.group == group:
                flag = " [unsafe]" if r.unsafe else ""
                typer.echo(f"  {r.name}{flag}  ({r.location})")


@rules_app.command("verify")
@reports_errors
def rules_verify(paths: list[Path] = PATHS,
                 trials: int = typer.Option(24, help="random instances per rule"),
                 seed: int = typer.Option(0, help="random seed")):
    """Check rules numerically: both sides on random inputs that meet the rule's conditions."""
    from .dsl.verify import verify_rules
    rules = load_rules(paths or [])
    results = verify_rules(rules, trials=trials, seed=seed)
    for result in results:
        typer.echo(result.line())
    failed, skipped = sum(not r.passed for r in results), len(rules) - len(results)
    summary = f"{len(results) - failed} passed, {failed} failed"
    typer.echo(summary + (f", {skipped} fuse statement(s) skipped" if skipped else ""))
    if failed:
        raise typer.Exit(1)


def _profile_line(name: str, p) -> str:
    attention = f" (attention {p.attention_flops / 1e9:.0f} + {p.attention_launch * 1e6:.0f} us per call)" \
        if p.attention_flops else ""
    attention = f" + {p.library_launch * 1e6:.0f} us per call" + attention if p.library_launch else attention
    return (f"{name}: bandwidth {p.bandwidth / 1e9:.1f} GB/s, generated code {p.flops / 1e9:.1f} GFLOP/s "
            f"(a FLOP of exp {p.exp_cost:.1f}x, of tanh {p.tanh_cost:.1f}x, of cos/sin {p.trig_cost:.1f}x), library {p.library_flops / 1e9:.1f} "
            f"GFLOP/s{attention}, launch {p.launch * 1e6:.2f} us")


@profile_app.command("show")
@reports_errors
def profile_show():
    """The profiles extraction can use; `cpu` is this machine's calibration."""
    from . import calibrate
    from .cost import PROFILES
    mine = calibrate.cached_cpu_profile()
    typer.echo(_profile_line("cpu", mine) if mine else "cpu: not calibrated yet (measured on first use)")
    typer.echo(_profile_line("cpu-default", PROFILES["cpu"]))
    for name, p in PROFILES.items():
        if name != "cpu":
            typer.echo(_profile_line(name, p))


@profile_app.command("calibrate")
@reports_errors
def profile_calibrate():
    """Measure this machine now (refused while it is busy) and cache the result."""
    from . import calibrate
    measured = calibrate.calibrate_cpu()
    if measured is None:
        typer.echo("error: the machine is too busy to measure (runs disagree by more than "
                   f"{calibrate.UNSTABLE}x); nothing cached, try again when it is quiet", err=True)
        raise typer.Exit(1)
    typer.echo(_profile_line("cpu", measured))


@profile_app.command("reset")
@reports_errors
def profile_reset():
    """Forget this machine's cached calibrations (the next compile measures again)."""
    from . import calibrate
    typer.echo(f"removed {calibrate.reset()} cached profile(s)")


BENCHES = ("run", "models", "kernels", "steps", "overhead", "compile_time", "cost_fidelity", "coldstart", "training",
           "bandwidth", "remote_cache", "distributed", "regret", "calibration")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
@reports_errors
def bench(ctx: typer.Context,
          harness: str = typer.Argument("run", help=f"which benchmark: {', '.join(BENCHES)}")):
    """Run a benchmark of the source checkout's benchmarks/ (from the repository
    root); the other arguments go to it (`egc bench run --help`)."""
    if harness in ("--help", "-h"):
        typer.echo(f"usage: egc bench [{'|'.join(BENCHES)}] [ARGS...]  (from the repository root; "
                   "`egc bench HARNESS --help` for its arguments)")
        raise typer.Exit(0)
    if harness not in BENCHES:
        raise UsageError(f"unknown benchmark {harness!r}; one of {', '.join(BENCHES)}")
    root = Path.cwd()
    if not (root / "benchmarks" / f"{harness}.py").is_file():
        raise UsageError(f"no benchmarks/{harness}.py here: egc bench runs the benchmark harness of a source "
                         "checkout, from its root directory")
    sys.path.insert(0, str(root))
    module = importlib.import_module(f"benchmarks.{harness}")
    code = module.main(list(ctx.args))
    raise typer.Exit(code or 0)
