"""`egc`: the command line (typer).  Explain a program level by level, and
check or list rules."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import typer

from . import workloads
from .dsl.library import check_unique, library_rules, load_user_rules
from .errors import EgraphCompilerError

app = typer.Typer(help="egraph-compiler: a rule-driven optimising compiler for PyTorch.", no_args_is_help=True)
rules_app = typer.Typer(help="Check and list rules.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


def load_program(target: str, size: str):
    """A workload name, or PATH.py exposing `program` and `example_inputs()`."""
    if target in workloads.NAMES:
        return workloads.make(target, size)
    path = Path(target)
    if not path.exists():
        raise typer.BadParameter(f"{target!r} is neither a workload ({', '.join(workloads.NAMES)}) nor a file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.program, module.example_inputs()


@app.command()
def explain(target: str = typer.Argument(..., help="workload name or PATH.py with program/example_inputs()"),
            size: str = typer.Option("test", help="workload size: test, cpu or gpu"),
            unsafe: bool = typer.Option(False, help="enable unsafe rules"),
            level: str = typer.Option("all", help="one of aten, graph, egraph, plan, loops, source, all"),
            dot: Path = typer.Option(None, help="also write the saturated e-graph here (Graphviz DOT)")):
    """Print each IR level of a compiled program."""
    from .api import explain as explain_program
    fn, inputs = load_program(target, size)
    try:
        levels = explain_program(fn, inputs, unsafe=unsafe, dot=dot is not None)
    except EgraphCompilerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    if dot is not None:
        dot.write_text(levels.dot)
    typer.echo(str(levels) if level == "all" else getattr(levels, level))


def _load(paths: list[Path]):
    try:
        rules = library_rules() if not paths else load_user_rules(paths)
        check_unique(rules)
        return rules
    except EgraphCompilerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)


@rules_app.command("check")
def rules_check(paths: list[Path] = typer.Argument(None, help="rules files (default: the library)")):
    """Parse and type-check rules files."""
    rules = _load(paths or [])
    typer.echo(f"ok: {len(rules)} rule(s) in {len({r.path for r in rules})} file(s)")


@rules_app.command("list")
def rules_list(paths: list[Path] = typer.Argument(None, help="rules files (default: the library)")):
    """Print rules by group."""
    rules = _load(paths or [])
    for group in dict.fromkeys(r.group for r in rules):
        typer.echo(f"{group}:")
        for r in rules:
            if r.group == group:
                flag = " [unsafe]" if r.unsafe else ""
                typer.echo(f"  {r.name}{flag}  ({r.location})")


@rules_app.command("verify")
def rules_verify(paths: list[Path] = typer.Argument(None, help="rules files (default: the library)"),
                 trials: int = typer.Option(24, help="random instances per rule"),
                 seed: int = typer.Option(0, help="random seed")):
    """Check rules numerically: both sides on random inputs that meet the rule's conditions."""
    from .dsl.verify import verify_rules
    rules = _load(paths or [])
    results = verify_rules(rules, trials=trials, seed=seed)
    for result in results:
        typer.echo(result.line())
    failed, skipped = sum(not r.passed for r in results), len(rules) - len(results)
    summary = f"{len(results) - failed} passed, {failed} failed"
    typer.echo(summary + (f", {skipped} fuse statement(s) skipped" if skipped else ""))
    if failed:
        raise typer.Exit(1)
