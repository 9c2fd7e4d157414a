"""CPU linears through torch's GEMM or oneDNN's inner product (egraph_compiler/cpu_linear.py):
each routine gives eager's answer on the shapes steps hand it, the pick is timed once per shape
and kept on disk, a linear oneDNN runs gets no buffer from the wrapper, and oneDNN's epilogues
(rules/onednn.rules) are installed only where asked for, and give eager's answer."""
import platform

import pytest
import torch

import egraph_compiler as egc
from egraph_compiler import cpu_linear
from egraph_compiler.cost import ONEDNN_LINEARS

needs_onednn = pytest.mark.skipif(cpu_linear.onednn() is None, reason="this torch has no oneDNN linear")


def mlp(x, w1, b1, w2):  # a biased linear, a relu, a linear without bias
    return torch.relu(x @ w1.t() + b1) @ w2.t()


def conv1d(x, w, b):  # GPT-2's Conv1D: the weight stored [in, out]
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def affine(x, w, b):  # a biased linear the program returns: the bias stays in the library call
    return torch.nn.functional.linear(x, w, b)


def broadcast(x, w, s):  # a bias and an input expanded from one value: stride 0 (soak 34001)
    top = (-s.amax()).expand(w.shape[0])
    return torch.nn.functional.linear(top, w, top), torch.nn.functional.linear(x, w, top)


def head(x, w):  # a linear of a transposed view: the step reads it through the environment
    return x.transpose(0, 1) @ w.t()


@pytest.mark.skipif(platform.machine() != "x86_64" or not torch.backends.mkldnn.is_available(),
                    reason="oneDNN's linear is looked for on x86-64 builds with oneDNN")
def test_onednn_is_found_where_torch_has_it():  # (else every test below skips, and CI tests one routine)
    assert cpu_linear.onednn() is not None


CASES = [
    (mlp, lambda r: (r(2, 24, 32), r(48, 32), r(48), r(16, 48))),
    (mlp, lambda r: (r(3, 3, 3), r(3, 3), r(3), r(3, 3))),  # square everywhere
    (mlp, lambda r: (r(1, 1, 8), r(8, 8), r(8), r(1, 8))),  # one row, one output
    (mlp, lambda r: (r(0, 5, 8), r(4, 8), r(4), r(2, 4))),  # no rows
    (conv1d, lambda r: (r(2, 12, 16), r(16, 40), r(40))),
    (affine, lambda r: (r(2, 12, 16), r(40, 16), r(40))),
    (head, lambda r: (r(6, 4, 16), r(24, 16))),
    (broadcast, lambda r: (r(5, 3), r(3, 3), r(3, 7))),
]


@needs_onednn
@pytest.mark.parametrize("routine", ["torch", "onednn"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_routine_gives_eagers_answer(case, routine, monkeypatch):
    monkeypatch.setenv(cpu_linear.ROUTINE_ENV, routine)
    fn, make = CASES[case]
    gen = torch.Generator().manual_seed(case)
    args = make(lambda *shape: torch.randn(*shape, generator=gen))
    compiled = egc.compile(fn, args)
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-5)
    library = [k for k in compiled.plan.kernels if k.output.op == "linear"]
    assert library, compiled.plan  # (the linears are library calls, not generated loops)


@needs_onednn
def test_a_linear_onednn_runs_gets_no_buffer_from_the_wrapper(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen) for s in ((64, 32), (48, 32), (48,), (16, 48))]
    sources = {}
    for routine in ("torch", "onednn"):
        monkeypatch.setenv(cpu_linear.ROUTINE_ENV, routine)
        compiled = egc.compile(mlp, args)
        sources[routine] = compiled._executable.wrapper.source
        torch.testing.assert_close(compiled(*args), mlp(*args), rtol=1e-5, atol=1e-5)
    assert "into t" in sources["torch"] and "_empty_t" in sources["torch"]
    assert "into t" not in sources["onednn"] and "_empty_t" not in sources["onednn"]


def test_a_routine_that_is_not_one_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_linear.ROUTINE_ENV, "mkl")
    with pytest.raises(ValueError, match="EGC_CPU_LINEAR='mkl': expected one of torch, timed, onednn"):
        cpu_linear.choose(512, 256, 1024, True, False, torch.float32)


@needs_onednn
def test_the_pick_is_timed_once_per_shape_and_kept_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_linear.ROUTINE_ENV, "timed")
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_kept", {})
    timed = []
    real = cpu_linear._timed

    def counted(runs):
        timed.append(sorted(runs))
        return real(runs)
    monkeypatch.setattr(cpu_linear, "_timed", counted)
    shape = (256, 128, 512)  # 2 * 256 * 128 * 512 = 32 MFLOP, above MIN_FLOPS
    first = cpu_linear.choose(*shape, True, False, torch.float32)
    assert first in cpu_linear.ROUTINES and timed == [["onednn", "torch"]]
    assert len(list((tmp_path / "cpu_linear").glob("*.json"))) == 1
    monkeypatch.setattr(cpu_linear, "_kept", {})  # (a new process: only the disk remembers)
    assert cpu_linear.choose(*shape, True, False, torch.float32) == first and len(timed) == 1
    # below MIN_FLOPS, another dtype, no rows: torch's GEMM, never timed
    assert cpu_linear.choose(32, 64, 64, True, False, torch.float32) == "torch"
    assert cpu_linear.choose(*shape, True, False, torch.bfloat16) == "torch"
    assert cpu_linear.choose(0, 128, 512, True, False, torch.float32) == "torch"
    assert cpu_linear.choose(1 << 12, 1 << 12, 1 << 12, True, False, torch.float32) == "torch"  # 137 GFLOP
    assert len(timed) == 1


@needs_onednn
def test_a_large_model_linear_matches_eager_whichever_routine_is_picked(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_linear.ROUTINE_ENV, "timed")
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_kept", {})
    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(*s, generator=gen) for s in ((2, 128, 128), (512, 128), (512,), (128, 512))]
    compiled = egc.compile(mlp, args)
    torch.testing.assert_close(compiled(*args), mlp(*args), rtol=1e-4, atol=1e-4)
    assert len(cpu_linear._kept) == 2  # (both linears are above MIN_FLOPS: each timed, each kept)


def test_torchs_gemm_by_default_untimed(monkeypatch):
    monkeypatch.delenv(cpu_linear.ROUTINE_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "_timed", None)  # (a call would raise)
    assert cpu_linear.choose(512, 256, 1024, True, False, torch.float32) == "torch"
    assert not cpu_linear.epilogues()
    args = [torch.randn(4, 8), torch.randn(6, 8)]
    compiled = egc.compile(lambda x, w: torch.nn.functional.silu(x @ w.t()), args, disable=["onednn"])
    torch.testing.assert_close(compiled(*args), torch.nn.functional.silu(args[0] @ args[1].t()))


def swiglu(x, wg, wu, wd):  # LLaMA's MLP: silu(gate) * up, then down
    return torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()), wd)


def gelu_new(x, w1, b1, w2):  # GPT-2's MLP, gelu's tanh form written out with pow
    h = x @ w1.t() + b1
    return (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))) @ w2.t()


EPILOGUES = [
    (swiglu, lambda r: (r(2, 8, 16), r(24, 16), r(24, 16), r(16, 24)), {"linear_silu", "linear_mul"}),
    (swiglu, lambda r: (r(5, 16), r(24, 16), r(24, 16), r(16, 24)), {"linear_silu", "linear_mul"}),
    (gelu_new, lambda r: (r(2, 8, 16), r(32, 16), r(32), r(16, 32)), {"linear_gelu_tanh"}),
    # no rows: oneDNN refuses an empty product, so the step runs the plan's op as written
    (gelu_new, lambda r: (r(0, 16), r(32, 16), r(32), r(16, 32)), {"linear_gelu_tanh"}),
]


@needs_onednn
@pytest.mark.parametrize("case", range(len(EPILOGUES)))
def test_onednns_epilogues_where_asked_for_give_eagers_answer(case, monkeypatch):
    fn, make, fused = EPILOGUES[case]
    gen = torch.Generator().manual_seed(case)
    args = make(lambda *shape: torch.randn(*shape, generator=gen))
    for asked in ("torch", "onednn"):
        monkeypatch.setenv(cpu_linear.ROUTINE_ENV, asked)
        compiled = egc.compile(fn, args)
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-5)
        ops = {k.output.op for k in compiled.plan.kernels}
        assert ops & set(ONEDNN_LINEARS) == (set() if asked == "torch" else fused), compiled.plan
        if fused and asked == "onednn":
            assert not any(k.kind == "generated" for k in compiled.plan.kernels), compiled.plan


@needs_onednn
def test_onednns_epilogues_are_not_installed_for_triton(monkeypatch):
    monkeypatch.setenv(cpu_linear.ROUTINE_ENV, "onednn")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(*s, generator=gen) for s in ((2, 8, 16), (32, 16), (32,), (16, 32))]
    compiled = egc.compile(gelu_new, args, target="triton")
    assert not {k.output.op for k in compiled.plan.kernels} & set(ONEDNN_LINEARS), compiled.plan
    torch.testing.assert_close(compiled(*args), gelu_new(*args), rtol=1e-5, atol=1e-5)
