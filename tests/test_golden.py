"""Golden text: every IR level of the seven workloads (ATen graph, Graph IR,
saturation report, plan, loop IR, generated source) for each target, compared
with tests/golden/<workload>.<target>.txt, so that a change of plan or code
shows in review as a diff.  After an intended change:

    .venv/bin/python -m pytest tests/test_golden.py --update-golden

(rewrites the files; review `git diff tests/golden`).  Times are masked; plans
use the fixed `cpu-default` profile (conftest), so the text is the same on
every machine.  The wrapper level is left out: it names tensors by id."""
import difflib
import re
from collections import OrderedDict
from pathlib import Path

import pytest

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.codegen.sizes import TEMPLATES

GOLDEN = Path(__file__).parent / "golden"
LEVELS = [("ATen graph", "aten"), ("Graph IR", "graph"), ("e-graph", "egraph"), ("plan", "plan"),
          ("loop IR", "loops"), ("source", "source")]


def golden_text(name: str, target: str) -> str:
    """The levels of a literal build: the workload compiled with no earlier program of its form in
    the process (another test's compile at other sizes would make this one a template)."""
    fn, inputs = workloads.make(name, size="test")
    saved, TEMPLATES.forms = TEMPLATES.forms, OrderedDict()
    try:
        levels = egc.compile(fn, inputs, target=target, unsafe=name == "algebra").levels
    finally:
        TEMPLATES.forms = saved
    text = "\n\n".join(f"=== {title} ===\n{getattr(levels, attr).rstrip()}" for title, attr in LEVELS) + "\n"
    return re.sub(r"\b\d+\.\d+s\b", "<time>", text)


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("name", workloads.NAMES)
def test_levels_match_golden_text(name, target, request):
    if target == "triton":  # the source as for a GPU (the interpreter's row sums stay apart: codegen/triton.py)
        request.getfixturevalue("as_on_a_gpu")
    path = GOLDEN / f"{name}.{target}.txt"
    text = golden_text(name, target)
    if request.config.getoption("--update-golden"):
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run pytest {__file__} --update-golden"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "now", n=2))
        pytest.fail(f"{name} on {target} differs from its golden text (intended? --update-golden):\n{diff[:6000]}")
