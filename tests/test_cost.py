"""The cost model's measurements: per-kernel times, the fidelity statistics, and
calibration that refuses readings taken on a busy machine."""
import time

import pytest
import torch

import egraph_compiler as egc
from benchmarks.cost_fidelity import fidelity
from egraph_compiler import calibrate


def test_kernel_times_cover_every_step_of_the_plan():
    def fn(x, w):  # (the transposed operand: a view the wrapper takes, not a step of its own)
        return torch.relu(x.t() @ w).softmax(-1) * 2
    args = [torch.randn(32, 64), torch.randn(32, 48)]
    compiled = egc.compile(fn, args)
    times = compiled._executable.kernel_times(*args, reps=3)
    steps = {k.loop_nest or k.name for k in compiled.plan.kernels}
    assert set(times) == steps and all(t > 0 for t in times.values())
    torch.testing.assert_close(compiled(*args), fn(*args))  # timing left the program as it was


def test_fidelity_statistics():
    rows = [{"estimated_us": e, "measured_us": m} for e, m in [(1, 2), (2, 4), (3, 6), (10, 20)]]
    summary = fidelity(rows)
    assert summary["spearman"] == pytest.approx(1.0) and summary["median_abs_log_error"] == pytest.approx(1.0)
    reversed_rows = [{"estimated_us": e, "measured_us": m} for e, m in [(1, 4), (2, 3), (3, 2), (4, 1)]]
    assert fidelity(reversed_rows)["spearman"] == pytest.approx(-1.0)


def test_calibration_refuses_a_busy_machines_reading(monkeypatch):
    calls = iter(range(100))

    def disturbed():  # three quick runs, then a machine that got busy
        time.sleep(0.001 if next(calls) < 4 else 0.01)
    with pytest.raises(calibrate._Busy):
        calibrate._best_seconds(disturbed)
    readings = []

    def busy():
        readings.append(1)
        raise calibrate._Busy()
    monkeypatch.setattr(calibrate, "_measure_cpu", busy)
    monkeypatch.setattr(calibrate.time, "sleep", lambda s: None)
    assert calibrate.measure_cpu() is None and len(readings) == calibrate.ATTEMPTS  # tried again, then refused
    outcomes = iter([calibrate._Busy(), calibrate.PROFILES["cpu"]])

    def once_disturbed():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    monkeypatch.setattr(calibrate, "_measure_cpu", once_disturbed)
    assert calibrate.measure_cpu() == calibrate.PROFILES["cpu"]  # the second reading is kept
    # every run alike slow (both cores taken): a matmul's fixed cost of 11 ms passed the
    # readings' spread check; plausibility refuses it
    from dataclasses import replace
    slow = replace(calibrate.PROFILES["cpu"], library_flops=59e9, library_launch=11.4e-3)
    assert not calibrate.plausible(slow)
    assert calibrate.plausible(replace(slow, library_launch=35e-6))
    assert not calibrate.plausible(replace(slow, library_launch=35e-6, attention_launch=5e-3))


def test_library_calls_are_charged_by_class():
    from egraph_compiler.cost import PROFILES, extra_passes, kernel_cost
    h200 = PROFILES["h200"]
    matmul = kernel_cost(1e12, 0.0, h200, library=True, op="matmul")
    attention = kernel_cost(1e12, 0.0, h200, library=True, op="sdpa")
    assert attention > matmul > kernel_cost(1e9, 0.0, h200, library=True)  # flash attention: its own, lower rate
    # addmm fills its output with the bias, then accumulates into it: two more passes, not overlapped
    assert extra_passes("linear", [(8, 64), (32, 64), (32,)]) == 2
    assert extra_passes("linear", [(8, 64), (32, 64), ()]) == 0  # no bias: a plain matmul
    assert extra_passes("matmul", [(8, 64), (64, 32)]) == 0
    busy = kernel_cost(1e12, 1e6, h200, library=True, op="linear", serial_bytes=2e9)
    assert busy == pytest.approx(matmul + 2e9 / h200.bandwidth)


def test_transcendental_calls_are_weighted_by_the_profile():
    from dataclasses import replace
    from egraph_compiler.cost import PROFILES, op_flops
    profile = replace(PROFILES["cpu"], exp_cost=3.0, tanh_cost=2.0, trig_cost=20.0)
    assert op_flops("exp", (10,), [(10,)]) == 40  # the op table's 4 FLOPs per exp
    assert op_flops("exp", (10,), [(10,)], profile) == 120
    assert op_flops("cos", (10,), [(10,)], profile) == 10 * 6 * 20  # cos and sin by their own measured factor
    assert op_flops("gelu_tanh", (10,), [(10,)], profile) == 10 * (12 + 6)  # its tanh's 6 FLOPs count twice
    assert op_flops("softmax", (4, 8), [(4, 8)], profile) == 32 * (7 + 8)  # its exp's 4 count three times
    assert op_flops("add", (10,), [(10,), (10,)], profile) == 10
    assert op_flops("exp", (10,), [(10,)], PROFILES["h200"]) == 40  # fixed tables: the table's FLOPs


def test_library_calls_pay_their_fitted_fixed_cost(monkeypatch):
    """On 16 cores a matmul of 34 MFLOP took twice its FLOPs at the 512-cube's rate, and fused
    attention over 128 queries 3.8x its estimate (BENCHMARKS.md): calibration fits a fixed
    cost per call beside each library rate, and where attention's is large the plan takes it
    as two matmuls around a generated softmax instead."""
    from dataclasses import replace

    from egraph_compiler import calibrate, workloads
    from egraph_compiler.cost import PROFILES, kernel_cost
    cpu = replace(PROFILES["cpu"], library_launch=30e-6, attention_launch=100e-6)
    assert kernel_cost(1e6, 0.0, cpu, library=True, op="matmul") == pytest.approx(1e-5 + 30e-6 + cpu.launch)
    assert kernel_cost(1e6, 0.0, cpu, library=True, op="sdpa") == pytest.approx(1e-5 + 100e-6 + cpu.launch)
    assert kernel_cost(1e6, 0.0, cpu) == pytest.approx(1e6 / cpu.flops + cpu.launch)  # generated: no library cost
    # the fit: time = fixed + FLOPs / rate, from two sizes
    monkeypatch.setattr(calibrate, "_best_seconds", lambda call: call())
    rate, fixed = calibrate._fitted([(1e9, lambda: 20e-6 + 1e9 / 1e12), (8e9, lambda: 20e-6 + 8e9 / 1e12)])
    assert rate == pytest.approx(1e12) and fixed == pytest.approx(20e-6)
    assert calibrate._fitted([(1e9, lambda: 2e-3), (8e9, lambda: 1e-3)]) == (8e12, 0.0)  # (noise: no slope)
    monkeypatch.setitem(PROFILES, "cpu-cheap-attention", replace(PROFILES["cpu"], attention_launch=0.0))
    monkeypatch.setitem(PROFILES, "cpu-dear-attention", replace(PROFILES["cpu"], attention_launch=1e-3))
    q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
    ops_of = {}
    for profile in ("cpu-cheap-attention", "cpu-dear-attention"):
        compiled = egc.compile(workloads.attention_by_hand, [q, k, v], profile=profile)
        torch.testing.assert_close(compiled(q, k, v), workloads.attention_by_hand(q, k, v), atol=1e-5, rtol=1e-5)
        ops_of[profile] = [kernel.output.op for kernel in compiled.plan.kernels]
    assert ops_of["cpu-cheap-attention"] == ["sdpa"]
    assert "sdpa" not in ops_of["cpu-dear-attention"] and ops_of["cpu-dear-attention"].count("matmul") == 2


def test_an_elementwise_producer_is_charged_once_per_element_of_the_consumer_that_broadcasts_it():
    from egraph_compiler.cost import repeats
    assert repeats("pointwise", 16 * 8192, 8192) == 16  # cos [S, D] read by 16 heads of q
    assert repeats("layout", 16 * 8192, 8192) == 16  # an expand
    assert repeats("pointwise", 8192, 8192) == 1
    assert repeats("reduction", 1, 8192) == 1 and repeats("row", 8192, 8192) == 1  # read once per element


def test_a_transposing_store_is_charged_one_more_pass():
    from egraph_compiler.cost import extra_passes
    assert extra_passes("transpose", [(64, 48)], {"dim0": -2, "dim1": -1}) == 1
    assert extra_passes("permute", [(2, 64, 48)], {"dims": (0, 2, 1)}) == 1
    assert extra_passes("permute", [(2, 64, 48)], {"dims": (1, 0, 2)}) == 0  # the inner dim stays inner
    assert extra_passes("transpose", [(2, 64, 48)], {"dim0": 0, "dim1": 1}) == 0
    assert extra_passes("transpose", [(64, 1)], {"dim0": 0, "dim1": 1}) == 0  # a reshape in effect
    assert extra_passes("transpose", [(1, 64)], {"dim0": 0, "dim1": 1}) == 0
    assert extra_passes("linear", [(8, 4), (6, 4), (6,)]) == 2 and extra_passes("matmul", [(8, 4), (4, 6)]) == 0


def test_a_short_call_is_read_in_blocks_so_its_jitter_does_not_refuse_the_machine(monkeypatch):
    """A call of tens of microseconds whose every other run is slower (a 256-cube matmul on 16 cores,
    its threads waking or not): one call per reading gave a median three times the best, and the
    calibration was refused; a reading of back-to-back calls (calibrate.READING) averages them.
    (On a clock the calls advance themselves: real sleeps on a busy CI machine overshoot.)"""
    import types
    clock, calls = [0.0], iter(range(100000))
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def jittery():
        clock[0] += 0.0002 if next(calls) % 2 else 0.0008
    seconds = calibrate._best_seconds(jittery)
    assert seconds == pytest.approx(0.0005), seconds  # (0.8 ms first: readings of 2 calls, one of each)
    monkeypatch.setattr(calibrate, "READING", 0.0)  # one call a reading: refused as busy, as before
    calls = iter(range(1, 100000))  # (a fast call first, then readings of 0.8, 0.2, ... ms: the median 0.8)
    with pytest.raises(calibrate._Busy):
        calibrate._best_seconds(jittery)


def test_a_refused_calibration_is_said_once_and_prices_by_the_fixed_table(monkeypatch):
    """A machine too busy to calibrate prices its plans by the fixed table, and says so once per
    process (CalibrationWarning): a 16-core box's LLaMA plans were the fixed table's, unseen
    (its rotary kernels computed cos and sin per element: BENCHMARKS.md, forty-second session)."""
    import warnings

    from egraph_compiler import CalibrationWarning
    monkeypatch.setattr(calibrate, "_refused", False)
    monkeypatch.setattr(calibrate, "cached_cpu_profile", lambda: None)
    monkeypatch.setattr(calibrate, "measure_cpu", lambda: None)
    with pytest.warns(CalibrationWarning, match="egc profile calibrate"):
        assert calibrate.cpu_profile() == calibrate.PROFILES["cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calibrate.cpu_profile() == calibrate.PROFILES["cpu"]  # (said once; not measured again)


def test_calibration_benchmark_tells_when_calibrations_plan_differently(monkeypatch, capsys):
    """benchmarks/calibration.py compiles each workload under each calibration's profile and says
    whether the plans agree: two equal profiles agree; a second whose generated code is 10^4
    times slower (so recomputing looks dearer than a round trip) splits rmsnorm_swiglu's kernels."""
    import dataclasses

    from benchmarks import calibration
    base = calibrate.PROFILES["cpu"]
    for second, verdict in ((base, "yes"), (dataclasses.replace(base, flops=base.flops / 1e4), "NO")):
        measured = iter([base, second])
        current = {}

        def measure():
            current["profile"] = next(measured)
            return current["profile"]
        monkeypatch.setattr(calibrate, "calibrate_cpu", measure)
        monkeypatch.setattr(calibrate, "cpu_profile", lambda: current["profile"])
        assert calibration.main(["--runs", "2", "--size", "test", "--workloads", "rmsnorm_swiglu"]) == 0
        out = capsys.readouterr().out
        assert f"| rmsnorm_swiglu | {verdict} |" in out, out


def test_the_steps_benchmark_times_every_step_of_a_training_steps_programs(capsys):
    """benchmarks/steps.py: a real model's forward and backward programs, every step timed alone
    and in sequence beside its estimate, and the whole call (which holds the steps in sequence)."""
    from benchmarks import steps
    # (every step listed: which three are slowest is the machine's to say; with --top 3 a loaded
    # machine put three others above the backward's sdpa)
    assert steps.main(["--models", "llama_gqa", "--size", "test", "--train", "--reps", "1", "--top", "100"]) == 0
    out = capsys.readouterr().out
    assert "llama_gqa, program 0" in out and "llama_gqa, program 1" in out and "sdpa_grad_mask" in out, out
    programs = steps.bench_model("llama_gqa", steps.parser().parse_args(["--size", "test", "--train", "--reps", "1"]))
    assert [p["program"] for p in programs] == [0, 1]
    for p in programs:
        assert len(p["steps"]) >= 20, p  # (a 2-layer LLaMA's forward and backward: dozens of steps each)
        assert all(s["alone_us"] > 0 and s["in_sequence_us"] > 0 for s in p["steps"].values()), p
        assert p["call_us"] > 0 and p["estimated_us"] > 0
        assert {s["kind"] for s in p["steps"].values()} == {"generated", "library"}


def test_the_steps_benchmark_times_an_anchor_workloads_steps_beside_inductors_call(capsys):
    """`benchmarks.steps --workloads`: gpt_block's one program step by step (four GEMMs, sdpa,
    the norms and GELU generated), with Inductor's whole call timed beside it."""
    from benchmarks import steps
    assert steps.main(["--workloads", "gpt_block", "--size", "test", "--reps", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "gpt_block, program 0" in out and "Inductor's whole call" in out, out
    [p] = steps.bench_workload("gpt_block", steps.parser().parse_args(["--size", "test", "--reps", "1"]))
    assert p["inductor_call_us"] > 0 and p["call_us"] > 0
    kinds = [s["kind"] for s in p["steps"].values()]
    assert kinds.count("library") >= 4 and "generated" in kinds, p
    with pytest.raises(SystemExit, match="unknown workload"):
        steps.main(["--workloads", "gpt_blok"])
