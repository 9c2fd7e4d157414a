"""The public API: caching, explain, debug output, limits, input errors,
modules, the torch.compile backend, the CLI and the examples."""
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.cli import app

ROOT = Path(__file__).resolve().parents[1]


def pointwise(x, y):
    return torch.tanh(x * y + 1.5) - y


def test_second_compile_hits_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(16, 8), torch.randn(8)
    first = egc.compile(pointwise, [x, y])
    second = egc.compile(pointwise, [x, y])
    assert first.compiled_now and not second.compiled_now
    assert first.source == second.source
    assert len(list(tmp_path.glob("*.so"))) == 1
    torch.testing.assert_close(second(x, y), pointwise(x, y))


def test_explain_returns_every_level():
    fn, inputs = workloads.make("softmax", "test")
    levels = egc.explain(fn, inputs)
    assert "aten.amax" in levels.aten
    assert "amax(x, dims=[-1], keepdim=True)" in levels.graph
    assert "saturation: saturated" in levels.egraph
    assert "plan:" in levels.plan
    assert "kernel k0" in levels.loops and "#pragma omp" in levels.source
    assert "=== loop IR ===" in str(levels)


def test_debug_env_prints_levels(monkeypatch, capsys):
    monkeypatch.setenv("EGC_DEBUG", "1")
    egc.compile(pointwise, [torch.randn(4, 4), torch.randn(4)])
    err = capsys.readouterr().err
    assert "=== Graph IR ===" in err and "=== source ===" in err


@pytest.mark.parametrize("limits, reason", [
    (dict(iter_limit=1), "iteration limit"),
    (dict(node_limit=3), "node limit"),
    (dict(time_limit=0.0), "time limit"),
])
def test_saturation_limits_give_a_stop_reason_and_a_correct_plan(limits, reason):
    fn, inputs = workloads.make("algebra", "test")
    compiled = egc.compile(fn, inputs, unsafe=True, **limits)
    assert compiled.report.stop_reason == reason
    torch.testing.assert_close(compiled(*inputs), fn(*inputs))


def test_report_counts_rule_matches():
    fn, inputs = workloads.make("algebra", "test")
    report = egc.compile(fn, inputs, unsafe=True).report
    assert report.matches["mul_one"] >= 1 and report.enodes > 0 and report.iterations >= 1
    assert "rules fired:" in str(report)


@pytest.mark.parametrize("args, message", [
    ((torch.randn(4, 4),), "expected 2 tensor argument"),
    ((torch.randn(4, 4), 3.0), "must be a torch.Tensor"),
    ((torch.randn(5, 4), torch.randn(4)), "compiled for float32[4, 4], got float32[5, 4]"),
    ((torch.randn(4, 4, dtype=torch.float64), torch.randn(4)), "got float64[4, 4]"),
])
def test_mismatched_inputs_raise_a_clear_error(args, message):
    compiled = egc.compile(pointwise, [torch.randn(4, 4), torch.randn(4)])
    with pytest.raises(egc.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compiled(*args)


def test_outputs_never_alias_inputs():
    fn, inputs = workloads.make("algebra", "test")
    out = egc.compile(fn, inputs, unsafe=True)(*inputs)
    assert out.data_ptr() != inputs[0].data_ptr()


def test_a_transposed_output_is_a_view_of_the_buffer_computed_once():
    """h and h.t() both returned: one gelu kernel, and h.t() with eager's strides (a training
    forward's saved transpose of the activation the next matmul reads)."""
    def fn(x, w):
        h = F.gelu(x @ w, approximate="tanh")
        return h @ w.t(), h.t(), h.t() * 1.0, (h + 1.0).t().contiguous(), h.t().reshape(-1)
    x, w = torch.randn(48, 16), torch.randn(16, 16)
    compiled = egc.compile(fn, [x, w])
    assert compiled.plan.count("gelu_tanh") == 1, str(compiled.plan)
    got, want = compiled(x, w), fn(x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
        assert g.stride() == e.stride()  # (eager keeps a transposed operand's layout in pointwise ops)
    assert got[1].stride() == (1, 16) and got[3].is_contiguous()
    got[3].view(-1)  # (a result eager gives contiguous is contiguous: .view works on it)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_matmuls_read_a_fused_value_and_its_transpose_from_one_buffer(target):
    """A weight gradient's pattern (LLaMA's backward): silu(a) * b feeds one matmul and, transposed,
    another; both read the buffer stored in order (a transposed store costs a pass more)."""
    def fn(a, b, w, g):
        h = F.silu(a) * b
        return h @ w, h.t() @ g
    a, b, w, g = torch.randn(64, 48), torch.randn(64, 48), torch.randn(48, 16), torch.randn(64, 8)
    compiled = egc.compile(fn, [a, b, w, g], target=target)
    generated = [k for k in compiled.plan.kernels if k.kind == "generated"]
    assert len(generated) == 1 and generated[0].output.op not in ("transpose", "permute"), str(compiled.plan)
    for got, want in zip(compiled(a, b, w, g), fn(a, b, w, g)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [lambda: torch.randn(24, 16).t(), lambda: torch.randn(2, 5, 3).permute(2, 0, 1),
                                  lambda: torch.randn(6, 1, 4).transpose(0, 2)])
def test_an_input_with_permuted_strides_is_read_in_its_storage_order(make):
    """Captured as the dense tensor it permutes, read back through a permute (no copy per call);
    a later call with other strides (contiguous, or a slice with gaps) is copied and still right."""
    def fn(x, b):
        return (x * 2.0 + b).sum(-1), x.exp()
    x = make()
    b = torch.randn(x.shape[-1])
    compiled = egc.compile(fn, [x, b])
    assert "x" in compiled.plan.graph.orders, compiled.plan.graph.orders
    for arg in (x, x.contiguous(), torch.randn(*x.shape, 2)[..., 0]):
        for g, e in zip(compiled(arg, b), fn(arg, b)):
            torch.testing.assert_close(g, e)


def test_module_with_parameters_uses_live_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    compiled = egc.compile(model, [x])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.mul_(2.0)
        torch.testing.assert_close(compiled(x), model(x))


def test_torch_compile_backend():
    def block(x, w):
        return torch.relu(F.layer_norm(x, (8,), w, None)) * 2.0
    x, w = torch.randn(4, 8), torch.randn(8)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="egraph")
    torch.testing.assert_close(compiled(x, w), block(x, w))


FIRST_USE = """
import torch, torch.nn.functional as F
import egraph_compiler  # noqa: F401  (registers backend="egraph")
from egraph_compiler import calibrate
calibrate.UNSTABLE = float("inf")  # a busy machine must not skip the calibration under test
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
    def forward(self, x):
        return torch.relu(F.layer_norm(self.lin(x), (16,))) * 2.0
model, x = Block().eval(), torch.randn(4, 8, 16)
with torch.no_grad():
    torch.testing.assert_close(torch.compile(model, backend="egraph")(x), model(x))
print("ok")
"""


def test_first_torch_compile_on_a_fresh_machine_calibrates_inside_dynamo(tmp_path):
    """A user's first compile calibrates the CPU profile while Dynamo is compiling;
    that calibration's own capture once re-entered Dynamo and crashed the process
    (segfault).  A fresh process with an empty cache and the calibrated profile."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "EGC_PROFILE"} | {"EGC_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FIRST_USE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert (tmp_path / "profiles.json").exists()  # it did calibrate, inside Dynamo's compile


def test_example_runs_and_matches_eager():
    spec = importlib.util.spec_from_file_location("mlp_example", ROOT / "examples" / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0


def test_cli_rules_and_explain(tmp_path):
    runner = CliRunner()
    listed = runner.invoke(app, ["rules", "list"])
    assert listed.exit_code == 0 and "exp_log [unsafe]" in listed.output
    assert runner.invoke(app, ["rules", "check"]).exit_code == 0
    bad = tmp_path / "bad.rules"
    bad.write_text("rule broken: mul(x, => x\n")
    result = runner.invoke(app, ["rules", "check", str(bad)])
    assert result.exit_code == 1 and "bad.rules:1:21" in result.output
    explained = runner.invoke(app, ["explain", "algebra", "--unsafe", "--level", "plan"])
    assert explained.exit_code == 0 and "0 kernel(s)" in explained.output


def test_unknown_target_is_refused():
    with pytest.raises(egc.EgraphCompilerError, match="target 'tpu'"):
        egc.compile(pointwise, [torch.randn(2, 2), torch.randn(2)], target="tpu")


def test_in_place_updates_of_inputs_and_buffers_are_written_back():
    def bump_then_scale(x, y):
        x.add_(1.0)
        return x * y
    x, y = torch.randn(5), torch.randn(5)
    compiled = egc.compile(bump_then_scale, [x.clone(), y])
    mine, theirs = x.clone(), x.clone()
    torch.testing.assert_close(compiled(mine, y), bump_then_scale(theirs, y))
    torch.testing.assert_close(mine, theirs)

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            self.total.add_(x)
            return x * 2.0
    counter = Counter()
    run = egc.compile(counter, [torch.ones(3)])
    run(torch.ones(3))
    run(torch.ones(3))
    torch.testing.assert_close(counter.total, torch.full((3,), 2.0))


def test_a_static_dynamo_graph_binds_its_arguments_as_its_first_call_did():
    """Under Dynamo's guards (shapes, dtypes and strides of a static graph) `_bind` checks the
    arguments on the first call only, and later calls make contiguous the arguments the first
    call did.  An argument of other strides is another graph (Dynamo recompiles), never read
    with the first one's layout."""
    def fn(a, b):
        return torch.softmax(a @ b, -1) + torch.exp(b).sum(-1, keepdim=True)
    torch._dynamo.reset()
    egc.last_compiled(clear=True)
    compiled = torch.compile(fn, backend="egraph", dynamic=False)
    g = torch.Generator().manual_seed(0)
    strided = lambda: torch.randn(6, 6, generator=g).t()  # (read in its storage order: a permute)
    sliced = lambda: torch.randn(6, 12, generator=g)[:, ::2]  # (no dense order: made contiguous)
    for _ in range(3):
        a, b = strided(), sliced()
        torch.testing.assert_close(compiled(a, b), fn(a, b))
    first = egc.last_compiled()[-1]._executable
    assert first.strides_by_caller and first._made_dense is not None and len(first._made_dense) == 1
    a, b = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)  # contiguous both: new guards
    torch.testing.assert_close(compiled(a, b), fn(a, b))
    a, b = strided(), sliced()
    torch.testing.assert_close(compiled(a, b), fn(a, b))


def test_torch_compile_backend_across_shapes():
    def scaled_relu(x):
        return torch.relu(x) * 2.0
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    fixed = torch.compile(scaled_relu, backend="egraph", dynamic=False)
    automatic = torch.compile(scaled_relu, backend="egraph")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback, no warning
        for rows in (4, 5, 6):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(fixed(x), scaled_relu(x))
            torch.testing.assert_close(automatic(x), scaled_relu(x))
    plans = egc.last_plans()
    # fixed: one graph per size (3); automatic: 4 static, then one dynamic graph compiled for 5 and 6
    assert sorted(p.graph.inputs[0].shape for p in plans) == [(4, 8), (4, 8), (5, 8), (5, 8), (6, 8), (6, 8)]
    assert all(k.kind == "generated" for p in plans for k in p.kernels)


def test_a_float_argument_that_changes_between_calls():
    """After a second value Dynamo passes a Python float as a 0-d tensor read by `.item()`
    (here through dropout's `p`, which re-traced crashed on a guard, and a scale):
    each value compiles once and gives eager's result."""
    def fn(x, p, scale):
        return torch.nn.functional.dropout(x, p, training=False) * scale
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(fn, backend="egraph")
    x = torch.randn(4, 8)
    for p, scale in ((0.1, 2.0), (0.0, 3.0), (0.3, 2.0), (0.0, 3.0)):
        torch.testing.assert_close(compiled(x, p, scale), fn(x, p, scale))
    assert len(egc.last_plans()) == 3  # the first static graph, then one per new (p, scale)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_dynamic_graphs_compile_per_size_and_reuse_each_size(target):
    """`dynamic=True` hands over sizes as SymInt arguments (here the reshape's row count):
    each distinct size compiles once, a size seen before reuses its program."""
    def fn(x, y):
        return torch.softmax(x.reshape(-1, y.shape[-1]) + y, dim=-1).sum(0)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(fn, backend="egraph", dynamic=True, options={"target": target})
    sizes = [(2, 3), (1, 7), (2, 3), (4, 1), (0, 5)]
    with torch.no_grad():
        for b, n in sizes:
            x, y = torch.randn(b, 4, n), torch.randn(n)
            torch.testing.assert_close(compiled(x, y), fn(x, y))
    plans = egc.last_plans()
    assert len(plans) == len(set(sizes))
    assert [p.graph.inputs[0].shape for p in plans if len(p.graph.inputs[0].shape) == 3][:2] == [(2, 4, 3), (1, 4, 7)]


def test_dtypes_the_cpp_target_does_not_generate_run_through_aten_and_are_listed():
    fn, inputs = workloads.make("ln_relu", "test", dtype=torch.float64)
    with pytest.warns(UserWarning, match="runs through ATen"):
        compiled = egc.compile(fn, inputs)
    assert compiled.plan.fallbacks and all("float64" in f for f in compiled.plan.fallbacks)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs))


def test_bf16_workload_is_generated_cpp():
    fn, inputs = workloads.make("ln_relu", "test", dtype=torch.bfloat16)
    compiled = egc.compile(fn, inputs, target="cpu")
    assert not compiled.plan.fallbacks and any(k.kind == "generated" for k in compiled.plan.kernels)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=2e-2, rtol=2e-2)


def test_non_tensor_example_inputs_get_a_clear_error():
    with pytest.raises(egc.InputError, match="example input 1 is a float"):
        egc.compile(lambda x, s: x * s, [torch.randn(3), 2.0])
    with pytest.raises(egc.InputError, match="list or tuple of tensors"):
        egc.compile(lambda x: x, {"x": torch.randn(3)})
    single = egc.compile(lambda x: x * 2.0, torch.ones(3))  # one tensor is taken as the only input
    torch.testing.assert_close(single(torch.ones(3)), torch.full((3,), 2.0))


def _branches_on_a_value(x):
    return x * 2 if x.sum() > 0 else x - 1


def test_a_branch_on_a_tensors_value_names_the_users_line():
    """egc.compile captures one straight-line program: a Python `if` on a tensor's value cannot be
    captured, and the error says where in the user's code (torch's own message names only a symbol)."""
    with pytest.raises(egc.CaptureError) as info:
        egc.compile(_branches_on_a_value, [torch.randn(4, 4)])
    assert f'File "{__file__}"' in str(info.value) and "if x.sum() > 0" in str(info.value)


def test_sparse_tensors_are_refused_by_name_at_compile_and_at_call():
    """A sparse example compiled, and calling with one crashed inside torch ("unsupported memory
    format option Contiguous")."""
    dense = torch.randn(4, 4)
    with pytest.raises(egc.InputError, match="example input 0 is a torch.sparse_coo tensor.*to_dense"):
        egc.compile(lambda a: a * 2, [dense.to_sparse()])
    compiled = egc.compile(lambda a: a * 2, [dense])
    with pytest.raises(egc.InputError, match="argument 'a' is a torch.sparse_coo tensor"):
        compiled(dense.to_sparse())
    torch.testing.assert_close(compiled(dense), dense * 2)


def test_explain_can_keep_the_saturated_egraph_as_dot(tmp_path):
    fn, inputs = workloads.make("softmax", "test")
    levels = egc.explain(fn, inputs, dot=True)
    assert levels.dot.lstrip().startswith("digraph") and "Softmax" in levels.dot
    out = tmp_path / "softmax.dot"
    result = CliRunner().invoke(app, ["explain", "softmax", "--level", "plan", "--dot", str(out)])
    assert result.exit_code == 0 and out.read_text().lstrip().startswith("digraph")


def test_each_call_runs_a_straight_line_wrapper():
    fn, inputs = workloads.make("gpt_block", "test")
    compiled = egc.compile(fn, inputs)
    wrapper = compiled.levels.wrapper
    assert wrapper.startswith("def run(env):") and "for " not in wrapper
    assert wrapper.count("# library") == sum(k.kind == "library" for k in compiled.plan.kernels)
    assert "del " in wrapper  # intermediates are released at their last reader
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)
