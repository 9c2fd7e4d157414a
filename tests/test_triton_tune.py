"""Tuned launch configurations of Triton kernels (codegen/triton_tune.py), under the
interpreter: every candidate of every kernel kind computes what eager does, the
fastest is kept on disk and a second compile launches it without timing again, and a
record on disk is trusted only where it names one of the kernel's candidates."""
import json

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc

pytest.importorskip("triton")

from egraph_compiler.codegen import triton as tr  # noqa: E402
from egraph_compiler.codegen import triton_tune  # noqa: E402

# one of each kernel kind, with rows and sizes that no block divides
KINDS = {
    "pointwise": (lambda x: torch.relu(x * 2 + 1) - x.sigmoid(), [(37, 70)]),
    "pointwise_flat": (lambda x: x.exp() * 3, [(3000,)]),
    "persistent_rows": (lambda x, w, b: F.layer_norm(x, (48,), w, b).relu(), [(9, 48), (48,), (48,)]),
    "softmax_persistent": (lambda x: torch.softmax(x, -1), [(5, 100)]),
    "looped_rows": (lambda x: torch.softmax(x, -1) * 2, [(2, 33000)]),
    "column_sum": (lambda x: x.sum(0), [(7, 5)]),
    "gather": (lambda w, i: F.embedding(i, w) * 2, None),
}


@pytest.fixture(autouse=True)
def _small_kernels_tuned(monkeypatch):
    """Interpreter-sized kernels are below the size from which kernels are tuned on a GPU."""
    monkeypatch.setattr(triton_tune, "MIN_ELEMENTS", 0)


def _inputs(name):
    fn, shapes = KINDS[name]
    torch.manual_seed(0)
    if shapes is None:
        return fn, [torch.randn(11, 24), torch.randint(0, 11, (3, 5))]
    return fn, [torch.randn(s) for s in shapes]


def _loop_kernels(compiled):
    kernels = compiled.loop_kernels
    assert kernels, str(compiled.plan)
    return kernels


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_candidate_matches_eager(name, monkeypatch):
    """Each configuration of the search space, forced in turn, gives eager's values."""
    fn, inputs = _inputs(name)
    expected = fn(*inputs)
    compiled = egc.compile(fn, inputs, target="triton")
    counts = [len(triton_tune.candidates(tr._Kernel(k))) for k in _loop_kernels(compiled)]
    assert max(counts) >= 2 or name == "column_sum", counts  # (a tiny column sum has one sensible shape)
    picked = set()
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "1")
    for index in range(max(counts)):
        def pick(key, options, i=index):
            picked.add((len(options), options[min(i, len(options) - 1)]))
            return options[min(i, len(options) - 1)]
        monkeypatch.setattr(triton_tune, "recorded", pick)
        forced = egc.compile(fn, inputs, target="triton")
        torch.testing.assert_close(forced(*inputs), expected, atol=1e-5, rtol=1e-5)
    assert len(picked) == sum(counts) or max(counts) == 1 and not picked  # (every candidate of every kernel)


def test_the_fastest_is_kept_and_a_second_compile_does_not_time(monkeypatch, tmp_path):
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "1")
    fn, inputs = _inputs("persistent_rows")
    timed = []
    real_time = triton_tune._time
    monkeypatch.setattr(triton_tune, "_time", lambda *a: timed.append(1) or real_time(*a))
    first = egc.compile(fn, inputs, target="triton")
    torch.testing.assert_close(first(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    (kernel,) = _loop_kernels(first)
    options = triton_tune.candidates(tr._Kernel(kernel))
    assert len(timed) == len(options) >= 3
    records = list((tmp_path / "triton_tuning").glob("*.json"))
    assert len(records) == 1
    kept = json.loads(records[0].read_text())
    assert triton_tune.Config(kept["xblock"], kept["rblock"], kept["warps"]) in options
    assert len(kept["times_ms"]) == len(options)
    timed.clear()
    second = egc.compile(fn, inputs, target="triton")
    torch.testing.assert_close(second(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    assert timed == []


def test_a_record_outside_the_candidates_is_not_trusted(monkeypatch, tmp_path):
    """A persistent row kernel launched with a block shorter than its row would skip most of
    the row: a record naming one (damaged, or from another search space) is ignored."""
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "1")
    fn, inputs = _inputs("softmax_persistent")
    compiled = egc.compile(fn, inputs, target="triton")
    compiled(*inputs)
    (record,) = (tmp_path / "triton_tuning").glob("*.json")
    record.write_text(json.dumps({"xblock": 1, "rblock": 16, "warps": 4, "times_ms": {}}))
    again = egc.compile(fn, inputs, target="triton")
    torch.testing.assert_close(again(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    record.write_text("not json")
    torch.testing.assert_close(egc.compile(fn, inputs, target="triton")(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)


def test_candidates_keep_a_persistent_row_in_one_block():
    fn, inputs = _inputs("softmax_persistent")
    (kernel,) = _loop_kernels(egc.compile(fn, inputs, target="triton"))
    shape = tr._Kernel(kernel)
    assert not shape.looped and not shape.pointwise
    options = triton_tune.candidates(shape)
    assert options[0] == triton_tune.default(shape)
    assert all(c.rblock >= kernel.inner for c in options)
    assert len(set(options)) == len(options)


def test_tuning_is_asked_for_and_the_environment_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv(triton_tune.AUTOTUNE_ENV, raising=False)
    assert not triton_tune.enabled() and triton_tune.enabled(True)
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "0")
    assert not triton_tune.enabled(True)
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "1")
    assert triton_tune.enabled(False)
    monkeypatch.delenv(triton_tune.AUTOTUNE_ENV)
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    fn, inputs = _inputs("pointwise")
    plain = egc.compile(fn, inputs, target="triton")
    plain(*inputs)
    assert set(plain.launch_configs().values()) == {None}
    tuned = egc.compile(fn, inputs, target="triton", autotune=True)
    torch.testing.assert_close(tuned(*inputs), fn(*inputs), atol=1e-5, rtol=1e-5)
    assert all(c is not None for c in tuned.launch_configs().values())
    assert list((tmp_path / "triton_tuning").glob("*.json"))


def test_max_autotune_mode_tunes(monkeypatch, tmp_path):
    monkeypatch.delenv(triton_tune.AUTOTUNE_ENV, raising=False)
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    fn, inputs = _inputs("persistent_rows")
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    # (torch.compile takes a mode or options, not both: the backend as torch calls it for each)
    backend = lambda gm, examples: egc.dynamo_backend(gm, examples, mode="max-autotune",  # noqa: E731
                                                      options={"target": "triton"})
    out = torch.compile(fn, backend=backend)(*inputs)
    torch.testing.assert_close(out, fn(*inputs), atol=1e-5, rtol=1e-5)
    (compiled,) = egc.last_compiled()
    assert all(c is not None for c in compiled.launch_configs().values())


def test_every_candidate_compiles_for_an_h200_without_a_gpu():
    """What the interpreter runs with any block sizes, sm_90's compiler must accept with them too
    (a block over Triton's element limit, a constant it refuses)."""
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    modules = []
    for name in sorted(KINDS):
        fn, inputs = _inputs(name)
        compiled = egc.compile(fn, inputs, target="triton")
        modules.append((compiled.source, compiled.loop_kernels))
    compile_for_gpu(modules, candidates=True)  # raises CodegenError with triton's message


def test_the_configuration_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(triton_tune.AUTOTUNE_ENV, "1")
    fn, inputs = _inputs("looped_rows")
    compiled = egc.compile(fn, inputs, target="triton")
    (kernel,) = _loop_kernels(compiled)
    assert compiled.launch_configs() == {kernel.name: None}  # (before the first launch)
    compiled(*inputs)
    (report,) = compiled.launch_configs().values()
    assert report["config"] in report["times_ms"] and len(report["times_ms"]) >= 2


def test_a_call_whose_output_shares_memory_is_not_timed(monkeypatch, tmp_path):
    """Timing launches a kernel several times on the call's tensors: where an output is
    also read (a buffer handed in twice), the heuristic's configuration runs once."""
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    fn, inputs = _inputs("pointwise")
    compiled = egc.compile(fn, inputs, target="triton", autotune=True)
    (kernel,) = _loop_kernels(compiled)
    (name,) = compiled.launch_configs()
    timed = []
    monkeypatch.setattr(triton_tune, "_time", lambda *a: timed.append(1) or 0.0)
    x = inputs[0].clone()
    expected = fn(x)
    compiled._executable._calls[name](x, x)  # (in place: the output is the input)
    assert timed == [] and compiled.launch_configs()[name]["config"] == triton_tune._label(
        triton_tune.default(tr._Kernel(kernel)))
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)
    assert triton_tune._aliased([x[:2], x[2:]], [1]) and not triton_tune._aliased([x, x, x.clone()], [2])
