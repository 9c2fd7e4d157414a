"""`egc`: a user's mistake is one `error:` line (or a rule's caret block) on
stderr and exit code 2 (bad command line) or 1 (bad file), never a traceback;
`--debug` lets the exception through."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from egraph_compiler.cli import InputFailure, UsageError, app
from egraph_compiler.dsl.library import library_dir

runner = CliRunner()


def fails(args, code, *fragments):
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    assert result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr
    return result.stderr


def test_missing_rules_file(tmp_path):
    missing = tmp_path / "nope.rules"
    message = fails(["rules", "check", str(missing)], 2, str(missing), "no such file")
    assert message.count("\n") == 1  # one line


@pytest.mark.parametrize("command", ["check", "list", "verify"])
def test_every_rules_command_reports_a_missing_path(command, tmp_path):
    fails(["rules", command, str(tmp_path / "gone")], 2, str(tmp_path / "gone"))


def test_directory_without_rules(tmp_path):
    (tmp_path / "notes.txt").write_text("not rules")
    fails(["rules", "list", str(tmp_path)], 2, str(tmp_path), "without *.rules")


def test_directory_means_its_rules_files_sorted(tmp_path):
    (tmp_path / "b.rules").write_text("rule second: neg(neg(x)) => x\n")
    (tmp_path / "a.rules").write_text("rule first: mul(x, 1) => x\n")
    (tmp_path / "skip.txt").write_text("rule ignored: frob(x) => x\n")
    result = runner.invoke(app, ["rules", "list", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.index("first") < result.stdout.index("second") and "ignored" not in result.stdout
    assert "a:" in result.stdout and "b:" in result.stdout  # each file is its own group


def test_syntax_error_shows_the_caret_block(tmp_path):
    bad = tmp_path / "bad.rules"
    bad.write_text("rule fine: neg(neg(x)) => x\nrule r: mul(x, => x\n")
    message = fails(["rules", "check", str(bad)], 1, f"{bad}:2:16: unexpected '=>'")
    assert message.splitlines()[1:] == ["    rule r: mul(x, => x", "                   ^"]


def test_duplicate_names_across_files(tmp_path):
    (tmp_path / "a.rules").write_text("rule same: neg(neg(x)) => x\n")
    (tmp_path / "b.rules").write_text("rule same: mul(x, 1) => x\n")
    fails(["rules", "check", str(tmp_path)], 1, "duplicate rule name 'same'", "a.rules:1")


def test_unreadable_rules_file(tmp_path):
    binary = tmp_path / "binary.rules"
    binary.write_bytes(b"\xff\xfe\x00rule")
    fails(["rules", "check", str(binary)], 1, str(binary), "cannot read it")


def test_library_directory_verifies():
    result = runner.invoke(app, ["rules", "verify", str(library_dir())])
    assert result.exit_code == 0, result.output
    assert " 0 failed" in result.stdout and "FAIL" not in result.stdout


def test_unknown_workload_or_file():
    fails(["explain", "no_such_workload"], 2, "no_such_workload", "neither a workload")


@pytest.mark.parametrize("source, fragments", [
    ("x = 1\n", ["defines no program and no example_inputs"]),
    ("def program(x):\n    return x\n", ["defines no example_inputs"]),
    ("import math\n\nmath.sqrt(-1)\n", [":3: importing it failed: ValueError: math domain error"]),
    ("def program(:\n", [":1: importing it failed: SyntaxError"]),
    ("def program(x):\n    return x\n\ndef example_inputs():\n    return 1 / 0\n",
     [":5: example_inputs() failed: ZeroDivisionError"]),
])
def test_program_file_that_cannot_be_loaded(tmp_path, source, fragments):
    path = tmp_path / "prog.py"
    path.write_text(source)
    fails(["explain", str(path)], 1, str(path), *fragments)


@pytest.mark.parametrize("args", [["explain", "softmax", "--level", "bogus"],
                                  ["explain", "softmax", "--size", "huge"]])
def test_bad_options_of_explain(args):
    fails(args, 2, args[-1])


@pytest.mark.parametrize("args, error", [
    (["rules", "check", "/no/such/path.rules"], UsageError),
    (["explain", "/no/such/program.py"], UsageError),
])
def test_debug_lets_the_exception_through(args, error):
    result = runner.invoke(app, ["--debug"] + args)
    assert isinstance(result.exception, error)
    assert not result.stderr.startswith("error: ")


def test_debug_keeps_the_cause_of_a_failed_import(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text("raise KeyError('k')\n")
    result = runner.invoke(app, ["--debug", "explain", str(path)])
    assert isinstance(result.exception, InputFailure) and isinstance(result.exception.__cause__, KeyError)


def test_profile_show_calibrate_reset(monkeypatch):
    from egraph_compiler import calibrate
    from egraph_compiler.cost import DeviceProfile
    measured = DeviceProfile("cpu", 25e9, 30e9, 200e9, 2e-6)
    monkeypatch.setattr(calibrate, "measure_cpu", lambda: measured)
    assert runner.invoke(app, ["profile", "reset"]).exit_code == 0
    shown = runner.invoke(app, ["profile", "show"])
    assert shown.exit_code == 0 and "cpu: not calibrated yet" in shown.stdout and "h200: bandwidth 4200.0" in shown.stdout
    done = runner.invoke(app, ["profile", "calibrate"])
    assert done.exit_code == 0 and "cpu: bandwidth 25.0 GB/s" in done.stdout
    assert calibrate.cached_cpu_profile() == measured
    assert "cpu: bandwidth 25.0 GB/s" in runner.invoke(app, ["profile", "show"]).stdout
    assert runner.invoke(app, ["profile", "reset"]).stdout.strip() == "removed 1 cached profile(s)"
    assert calibrate.cached_cpu_profile() is None


def test_profile_calibrate_on_a_busy_machine(monkeypatch):
    from egraph_compiler import calibrate
    monkeypatch.setattr(calibrate, "measure_cpu", lambda: None)
    fails(["profile", "calibrate"], 1, "too busy to measure")


EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_every_examples_explain_lines_work(example, monkeypatch):
    """Each example's docstring shows `egc explain` lines; each runs and exits 0."""
    import ast
    monkeypatch.chdir(EXAMPLES.parent)
    lines = [ln.split("egc ", 1)[1].split() for ln in ast.get_docstring(ast.parse(example.read_text())).splitlines()
             if ln.strip().startswith("egc explain")]
    assert lines, f"{example.name}'s docstring has no `egc explain` line"
    for args in lines:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
        assert "plan:" in result.stdout or "@triton.jit" in result.stdout or "extern \"C\"" in result.stdout


def test_explain_a_function_of_a_file_on_a_target(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text("import torch\n\ndef scaled(x):\n    return torch.softmax(x * 2, -1)\n\n"
                    "def scaled_example_inputs():\n    return [torch.randn(4, 8)]\n")
    result = runner.invoke(app, ["explain", f"{path}:scaled", "--target", "triton", "--level", "source"])
    assert result.exit_code == 0 and "@triton.jit" in result.stdout, result.output
    plan = runner.invoke(app, ["explain", f"{path}:scaled", "--level", "plan"])
    assert plan.exit_code == 0 and "softmax" in plan.stdout
    fails(["explain", f"{path}:missing"], 1, "defines no missing")
    fails(["explain", "softmax", "--target", "gpu"], 2, "unknown target 'gpu'")


def test_progress_reaches_the_caller_and_the_line_is_silent_when_piped(monkeypatch):
    import egraph_compiler as egc
    from egraph_compiler import cli, workloads
    seen = []
    fn, inputs = workloads.make("gpt_block", "test")
    egc.compile(fn, inputs, progress=lambda *a: seen.append(a))
    assert [s[0] for s in seen] == list(range(1, len(seen) + 1)) and len(seen) >= 2
    assert all(n > 0 and t >= 0 for _, n, t in seen) and seen[-1][2] >= seen[0][2]
    result = runner.invoke(app, ["explain", "gpt_block", "--level", "plan"])  # not a terminal: no live line
    assert result.exit_code == 0 and "saturating" not in result.output
    lines = []  # on a terminal: the line appears once saturation has run `after` seconds

    class Status:
        def __init__(self, text):
            lines.append(text)

        def start(self):
            pass

        def update(self, text):
            lines.append(text)

        def stop(self):
            lines.append("stopped")
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("rich.console.Console.status", lambda self, text: Status(text))
    report, done = cli.progress_line(after=0.5)
    report(1, 10, 0.1)
    report(2, 40, 0.7)
    done()
    assert lines == ["saturating: iteration 2, 40 e-nodes, 0.7 s"] * 2 + ["stopped"]
