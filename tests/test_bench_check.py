"""The benchmarks' correctness check below float32 (benchmarks/run.py `check`): another rounding
order passes, a wrong answer or a less precise program does not; and the page-fault line under the
benchmark's table."""
import torch

from benchmarks import run
from benchmarks.run import check


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref32 = torch.randn(2000, 1000, generator=gen)
    eager = ref32.bfloat16()  # eager's error: bf16's rounding
    other = (ref32 + torch.randn(ref32.shape, generator=gen) * 5e-4).bfloat16()  # another rounding order
    return ref32, eager, other


def test_another_rounding_order_passes_even_where_eager_landed_exactly(monkeypatch):
    ref32, eager, other = _case()
    small = ref32.abs().view(-1).argsort()[:5]  # where eager's rounding is nearly exact
    other.view(-1)[small] = (ref32.view(-1)[small] + 0.022).bfloat16()  # strays, within eager's largest error
    assert check(other, eager, 2e-2, ref32) is None
    monkeypatch.setattr(run, "STRAY", 0.0)  # (they are past their own allowance)
    assert "5 element(s) beyond" in check(other, eager, 2e-2, ref32)


def test_a_wrong_element_fails():
    ref32, eager, other = _case()
    other.view(-1)[123] += 1.0
    assert "beyond twice eager's error" in check(other, eager, 2e-2, ref32)


def test_many_strays_fail_even_when_small():
    ref32, eager, other = _case()
    other.view(-1)[:1000] = (ref32.view(-1)[:1000] + 0.05).bfloat16()  # 1000 of 2M: past STRAY
    assert check(other, eager, 2e-2, ref32) is not None


def test_a_less_precise_program_fails():
    ref32, eager, _ = _case()
    coarse = (ref32 * 64).round() / 64  # 6 bits after the point: errors of up to 1/128 everywhere
    assert check(coarse.bfloat16(), eager, 1e-4, ref32) is not None


def test_page_faults_are_listed_under_the_table_where_a_variant_faults():
    """benchmarks.run counts each variant's minor page faults per call; the table lists them
    where any variant faulted (eager's heap made Inductor's CPU softmax fault: BENCHMARKS.md)."""
    from benchmarks.report import markdown_table

    def row(name, faults):
        return {"workload": name, "status": {}, "compile_s": {"inductor": 1.0, "ours": 0.5},
                "ms": {"eager": 3.0, "inductor": 2.0, "ours": 1.0}, "speedup_vs_inductor": 2.0,
                "speedup_vs_eager": 3.0, "faults_per_call": faults}
    quiet = markdown_table([row("softmax", {"eager": 0, "inductor": 0, "ours": 0})])
    assert "Page faults" not in quiet
    loud = markdown_table([row("softmax", {"eager": 8160, "inductor": 203, "ours": 0}),
                           row("ln_relu", {"eager": 0, "inductor": 0, "ours": 0})])
    assert "softmax (eager 8160, inductor 203, ours 0)" in loud and "ln_relu (" not in loud
    assert run.minor_faults() > 0  # (a process has faulted its pages in by now)
