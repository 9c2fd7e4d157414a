"""Kernel boundaries chosen in the e-graph: the plans issue 4 expects."""
import re

import torch
from torch._inductor.utils import run_and_get_code

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.plan import verify_plan


def compiled_workload(name):
    fn, inputs = workloads.make(name, "test")
    compiled = egc.compile(fn, inputs)
    verify_plan(compiled.plan)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)
    return compiled


def kernel_ops(kernel):
    return [n.op for n in kernel.ops if n.group != "boundary"]


def test_ln_relu_is_one_kernel():
    plan = compiled_workload("ln_relu").plan
    assert len(plan.kernels) == 1 and kernel_ops(plan.kernels[0]) == ["layer_norm", "relu"], str(plan)


def test_hand_written_softmax_is_one_row_kernel():
    plan = compiled_workload("softmax").plan
    assert len(plan.kernels) == 1 and plan.kernels[0].kind == "generated", str(plan)


def test_softmax_stays_one_kernel_without_the_composite():
    """With softmax recomposition off, fusion alone still makes one row kernel."""
    fn, inputs = workloads.make("softmax", "test")
    compiled = egc.compile(fn, inputs, disable=["softmax"])
    assert len(compiled.plan.kernels) == 1, str(compiled.plan)
    assert sorted(kernel_ops(compiled.plan.kernels[0])) == ["amax", "div", "exp", "sub", "sum"]
    torch.testing.assert_close(compiled(*inputs), fn(*inputs))


def test_rmsnorm_swiglu_fuses_norm_and_gate():
    plan = compiled_workload("rmsnorm_swiglu").plan
    generated = [kernel_ops(k) for k in plan.kernels if k.kind == "generated"]
    assert any("rms_norm" in ops for ops in generated) and ["silu", "mul"] in generated, str(plan)
    assert len(generated) == 2


def test_str_plan_shows_fusion_groups_and_kernel_estimates():
    plan = compiled_workload("mlp_gelu").plan
    text = str(plan)
    assert "gelu_tanh" in text and "flops=" in text and "bytes=" in text and "est=" in text
    assert any(" -> " in str(k) for k in plan.kernels) or len(plan.kernels) == 3
    kernel = next(k for k in plan.kernels if k.kind == "generated")
    assert kernel.flops > 0 and kernel.bytes > 0 and kernel.seconds > 0


def inductor_kernel_count(fn, inputs) -> int:
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn), *inputs)
    code = "\n".join(codes)
    generated = len(set(re.findall(r"(cpp_fused_\w+) = async_compile", code)))
    library = len(re.findall(r"extern_kernels\.\w+\(", code)) + len(re.findall(r"torch\.ops\.aten\.\w+\.\w+\(", code))
    return generated + library


def test_gpt_block_needs_no_more_kernels_than_inductor():
    fn, inputs = workloads.make("gpt_block", "test")
    ours = compiled_workload("gpt_block").plan
    theirs = inductor_kernel_count(fn, inputs)
    assert 0 < len(ours.kernels) <= theirs, f"ours {len(ours.kernels)} vs inductor {theirs}\n{ours}"


def test_fusion_can_be_switched_off():
    fn, inputs = workloads.make("ln_relu", "test")
    compiled = egc.compile(fn, inputs, disable=["fusion"])
    assert len(compiled.plan.kernels) == 2
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)


def three_reads_of_x(x):
    return torch.exp(x).sum(-1), torch.tanh(x).amax(-1), x * 2.0


def test_horizontal_fusion_runs_siblings_in_one_loop_nest():
    x = torch.randn(64, 128)
    compiled = egc.compile(three_reads_of_x, [x])
    # the row sums are per-row values beside x * 2's rows: that kernel stores them (sharing.share_row_values)
    (kernel,) = compiled.plan.kernels
    assert sorted(n.op for n in kernel.extra_outputs) == ["amax", "sum"], str(compiled.plan)
    assert compiled.source.count('extern "C" void') == 1  # one pass over x writes all three outputs
    for got, want in zip(compiled(x), three_reads_of_x(x)):
        torch.testing.assert_close(got, want)
    compiled = egc.compile(lambda x: three_reads_of_x(x)[:2], [x])  # two reductions: siblings (siblings.py)
    first, *siblings = compiled.plan.kernels
    assert len(compiled.plan.kernels) == 2 and all(k.loop_nest == first.name for k in siblings), str(compiled.plan)
    assert compiled.source.count('extern "C" void') == 1
    for got, want in zip(compiled(x), three_reads_of_x(x)):
        torch.testing.assert_close(got, want)
    separate = egc.compile(three_reads_of_x, [x], disable=["siblings"])
    assert not any(k.loop_nest for k in separate.plan.kernels)
    assert separate.source.count('extern "C" void') == 3


def test_a_kernel_that_reads_its_sibling_is_not_fused_with_it():
    def dependent(x):
        s = torch.exp(x).sum(-1)
        return s, torch.relu(x) + s.mean()
    x = torch.randn(32, 64)
    compiled = egc.compile(dependent, [x])
    by_output = {id(k.output): k for k in compiled.plan.kernels}
    for kernel in compiled.plan.kernels:
        if kernel.loop_nest:
            leader = next(k for k in compiled.plan.kernels if k.name == kernel.loop_nest)
            assert id(leader.output) not in {id(i) for i in kernel.inputs}
            assert all(id(i) not in by_output or compiled.plan.kernels.index(by_output[id(i)])
                       < compiled.plan.kernels.index(leader) for i in kernel.inputs)
    for got, want in zip(compiled(x), dependent(x)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _rotary(q, positions, inv_freq):  # LLaMA's rotary embedding, as transformers writes it
    freqs = positions[:, :, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    half = q.shape[-1] // 2
    return q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin


def test_a_value_every_head_reads_is_computed_once_not_per_head():
    """cos and sin of [1, S, D] positions, read by each of q's [B, H] heads: fused into q's kernel
    they were computed B * H times over (16 here), which the cost model did not charge (llama_gqa's
    rotary kernels ran 10x their estimate, the gap to Inductor on that model); now charged
    (cost.repeats), they get a kernel of their own, and the estimate of a kernel counts them."""
    q, positions, inv_freq = torch.randn(4, 4, 128, 64), torch.arange(128.0).reshape(1, 128), torch.rand(32)
    compiled = egc.compile(_rotary, [q, positions, inv_freq])
    torch.testing.assert_close(compiled(q, positions, inv_freq), _rotary(q, positions, inv_freq))
    per_head = [k for k in compiled.plan.kernels if k.output.numel == q.numel()]
    assert per_head and not any({"cos", "sin"} & set(kernel_ops(k)) for k in per_head), str(compiled.plan)
    assert any("cos" in kernel_ops(k) and k.output.numel == 128 * 64 for k in compiled.plan.kernels)



def test_a_silu_backward_reads_its_input_once_in_one_loop_nest(monkeypatch):
    """SwiGLU's backward as AOTAutograd writes it (d_up = dh * silu(g), d_gate = dh * u * s * (1 +
    g * (1 - s)) for s = sigmoid(g)): one loop nest.  While extraction charged a fused kernel a
    tensor's bytes once per op that read it, g's three reads made the factor (1 + g * (1 - s)) a
    kernel of its own, a round trip through memory and a second pass (835 against 476 us on 2
    cores, BENCHMARKS.md)."""
    def fn(g, u, dh):
        s = torch.sigmoid(g)
        return dh * torch.nn.functional.silu(g), dh * u * (s * (1 + g * (1 - s)))
    import dataclasses
    from egraph_compiler import calibrate
    measured = dataclasses.replace(calibrate.PROFILES["cpu"], bandwidth=21.7e9, flops=41.8e9, exp_cost=4.4,
                                   tanh_cost=4.5, launch=1.5e-6)  # (a 2-core machine's calibration)
    monkeypatch.setattr(calibrate, "cpu_profile", lambda: measured)
    g, u, dh = torch.randn(256, 512), torch.randn(256, 512), torch.randn(256, 512)
    compiled = egc.compile(fn, [g, u, dh], profile="cpu")
    verify_plan(compiled.plan)
    assert [k.loop_nest for k in compiled.plan.kernels] == ["", "k0"], str(compiled.plan)
    produced = {id(k.output) for k in compiled.plan.kernels}
    assert not any(id(i) in produced for k in compiled.plan.kernels for i in k.inputs), str(compiled.plan)
    for got, want in zip(compiled(g, u, dh), fn(g, u, dh)):
        torch.testing.assert_close(got, want)
