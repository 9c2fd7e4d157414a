"""The seven anchor workloads, compiled end to end and checked against eager."""
import pytest
import torch

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.plan import verify_plan


@pytest.mark.parametrize("name", workloads.NAMES)
def test_workload_matches_eager(name):
    fn, inputs = workloads.make(name, "test")
    compiled = egc.compile(fn, inputs, unsafe=(name == "algebra"))
    verify_plan(compiled.plan)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)
    assert compiled.report.stop_reason == "saturated"
    assert not compiled.plan.fallbacks


def test_algebra_plan_leaves_nothing_to_simplify():
    fn, inputs = workloads.make("algebra", "test")
    plan = egc.compile(fn, inputs, unsafe=True).plan
    for op in ("exp", "log", "transpose", "mul", "add"):
        assert plan.count(op) == 0, str(plan)
    assert plan.kernels == []
    assert plan.rules_fired["exp_log"] >= 1 and plan.rules_fired["transpose_transpose"] >= 1


def test_algebra_keeps_exp_log_without_unsafe_rules():
    fn, inputs = workloads.make("algebra", "test")
    compiled = egc.compile(fn, inputs)
    assert compiled.plan.count("exp") == 1 and compiled.plan.count("log") == 1
    assert compiled.plan.count("transpose") == 0 and compiled.plan.count("mul") == 0
    assert "exp_log" not in compiled.plan.rules_fired
    torch.testing.assert_close(compiled(*inputs), fn(*inputs))


def test_gpt_block_plan_uses_library_kernels():
    fn, inputs = workloads.make("gpt_block", "test")
    plan = egc.compile(fn, inputs).plan
    ops = plan.ops()
    # each layer norm is one row kernel (as layer_norm, or as rms_norm of the centred input)
    assert ops["sdpa"] == 1 and ops["layer_norm"] + ops["rms_norm"] == 2 and ops["gelu_tanh"] == 1, str(plan)
    assert ops["linear"] + ops["matmul"] == 4 and ops["softmax"] == 0 and ops["exp"] == 0
    assert all(k.seconds > 0 and k.bytes > 0 for k in plan.kernels)


@pytest.mark.parametrize("name", workloads.NAMES)
def test_fusions_installed_only_for_reachable_ops_give_the_same_plan(name, monkeypatch):
    """Only the fusions whose ops the program can come to hold are given to egglog
    (saturate.reachable_ops): a reachability that missed an op a rewrite brings in would
    lose a fusion, and the plan would differ from the one with every fusion installed."""
    from egraph_compiler.egraph import saturate
    fn, inputs = workloads.make(name, size="test")
    filtered = egc.compile(fn, inputs, unsafe=name == "algebra")
    everything = saturate.install_rules
    monkeypatch.setattr(saturate, "install_rules", lambda session, rules, present=None: everything(session, rules))
    full = egc.compile(fn, inputs, unsafe=name == "algebra")
    assert str(filtered.plan) == str(full.plan)
    assert filtered.report.matches == full.report.matches


def test_reachable_ops_follow_rewrites_from_the_program():
    """gelu's program can come to hold erf (gelu_unfold) and its arithmetic; never softmax's."""
    from egraph_compiler.dsl.library import library_rules
    from egraph_compiler.egraph.saturate import reachable_ops
    reach = reachable_ops(library_rules(), {"input", "gelu"})
    assert {"gelu", "erf", "mul", "add", "const"} <= reach
    assert "softmax" not in reach and "sdpa" not in reach
