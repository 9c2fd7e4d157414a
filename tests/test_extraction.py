"""Extraction: the ILP is optimal (checked against enumeration on small
e-graphs), greedy is never better than it, and the cost model ranks plans the
way this CPU's clock does."""
import math
import time

import pytest
import torch

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.calibrate import profile_for
from egraph_compiler.egraph import ilp
from egraph_compiler.egraph.greedy import KernelExtractor
from egraph_compiler.pipeline import Options, build_egraph

PROFILE = profile_for("cpu-default")


def enumerate_optimum(eg, profile) -> float:
    """Every extraction reachable from the roots, by brute force: the minimum
    of the ILP objective over all acyclic choices."""
    ex = KernelExtractor(eg, profile)
    best = math.inf

    def options(class_id, use):
        for en in eg.classes[class_id]:
            cost = ilp.node_cost(ex, class_id, en, use)
            if cost is not None:
                yield en, cost

    def search(pending, chosen, path_cost, stack_order):
        nonlocal best
        if path_cost >= best:
            return
        if not pending:
            best = path_cost
            return
        (class_id, use), rest = pending[0], pending[1:]
        if (class_id, use) in chosen:
            return search(rest, chosen, path_cost, stack_order)
        for en, cost in options(class_id, use):
            kids = [(ex.inline_of[c], ilp.INL) if c in ex.inline_of else (c, ilp.MAT) for c in en.children]
            if any(k in stack_order.get((class_id, use), set()) or k == (class_id, use) for k in kids):
                continue  # would close a cycle
            above = stack_order.get((class_id, use), set()) | {(class_id, use)}
            order = dict(stack_order)
            for k in kids:
                order[k] = order.get(k, set()) | above
            search(kids + rest, {**chosen, (class_id, use): en}, path_cost + cost, order)

    search([(r, ilp.MAT) for r in eg.roots], {}, 0.0, {})
    return best


SMALL_PROGRAMS = [
    ("pointwise", lambda x: torch.relu(x * 1.0 + 0.0) * 2.0, lambda: (torch.randn(8, 16),)),
    ("softmax", workloads.softmax_by_hand, lambda: (torch.randn(8, 16),)),
    ("exp_chain", lambda x: torch.exp(-x) + torch.tanh(x), lambda: (torch.randn(4, 32),)),
]


@pytest.mark.parametrize("name, fn, make", SMALL_PROGRAMS, ids=[p[0] for p in SMALL_PROGRAMS])
def test_ilp_equals_enumeration_and_beats_greedy(name, fn, make):
    graph, eg, _, _ = build_egraph(fn, make(), Options())
    result = ilp.solve(eg, PROFILE, time_limit=20)
    assert result.proved_optimal
    optimum = enumerate_optimum(eg, PROFILE)
    assert result.objective == pytest.approx(optimum, rel=1e-6)
    greedy = KernelExtractor(eg, PROFILE)
    greedy.run()
    assert ilp.additive_cost(greedy, eg.roots) >= result.objective * (1 - 1e-9)


def test_compile_with_ilp_reports_both_costs():
    fn, inputs = workloads.make("gpt_block", "test")
    compiled = egc.compile(fn, inputs, extraction="ilp")
    text = compiled.plan.extraction
    assert "greedy (DAG cost" in text and "ilp: optimal" in text and "chose" in text
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=1e-4, rtol=1e-4)


def _faster(first, second, args, rounds=25) -> bool:
    """Whether `first` beats `second`: calls interleaved, best run of each
    (the least disturbed one: robust to a busy machine)."""
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn(*args)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] < best[1]


def test_cost_model_ranks_fused_below_unfused_like_the_clock():
    # arithmetic the memory traffic dominates (with exp and tanh, computed at their measured cost,
    # one kernel and five were within noise of each other on a 2-core machine)
    fn = lambda x: ((x * 2.0 + 1.0).relu() * 0.5 - x).abs()  # noqa: E731
    inputs = (torch.randn(2048, 1024),)
    fused = egc.compile(fn, inputs, profile="cpu")
    unfused = egc.compile(fn, inputs, disable=["fusion"], profile="cpu")
    assert len(fused.plan.kernels) == 1 and len(unfused.plan.kernels) > 2
    assert fused.plan.cost < unfused.plan.cost
    # the kernels' steady-state time (a whole call also pays for faulting in a fresh 8 MB output,
    # which varied by milliseconds between calls here and swamped the difference)
    # (a median of 5 blocks once read 8.0 ms against 0.68 on a VM whose clock stalled for
    # milliseconds: the least disturbed of three interleaved medians is what is compared)
    kernels = [min(ks) for ks in zip(*(
        [sum(c._executable.kernel_times(*inputs, reps=5).values()) for c in (fused, unfused)]
        for _ in range(3)))]
    assert kernels[0] < kernels[1], kernels
    ln_relu, ln_inputs = workloads.make("ln_relu", "cpu")
    assert (egc.compile(ln_relu, ln_inputs, profile="cpu").plan.cost
            < egc.compile(ln_relu, ln_inputs, disable=["fusion"], profile="cpu").plan.cost)


def test_cost_model_ranks_sdpa_below_naive_attention_like_the_clock():
    # the anchor's math at sequence 2048: at its own 256, and at 512 and 1024, the two plans
    # measured within 4-8% of each other on this 2-core machine, in either order from run to run
    # and machine to machine, a margin no ranking test can hold; at 2048 the scores (32 MB) leave
    # the caches and fused attention takes 10.8 ms against 27.5 for bmm + softmax + bmm
    fn, _ = workloads.make("attention", "cpu")
    inputs = tuple(torch.randn(1, 2, 2048, 64) for _ in range(3))
    sdpa = egc.compile(fn, inputs, profile="cpu")
    naive = egc.compile(fn, inputs, disable=["attention"], profile="cpu")
    assert sdpa.plan.count("sdpa") == 1 and naive.plan.count("sdpa") == 0
    assert sdpa.plan.cost < naive.plan.cost
    assert _faster(sdpa, naive, inputs)


def test_associativity_picks_the_chain_the_clock_prefers():
    a, b, c = torch.randn(256, 1024), torch.randn(1024, 1024), torch.randn(1024, 4)
    fn = lambda a, b, c: (a @ b) @ c  # noqa: E731
    chosen = egc.compile(fn, [a, b, c], profile="cpu")
    written = egc.compile(fn, [a, b, c], disable=["matmul_assoc"], profile="cpu")
    assert chosen.plan.cost < written.plan.cost
    assert _faster(chosen, written, (a, b, c))


def _gelu_and_saved_tanh(x):  # GPT-2's gelu as written, and the tanh a training forward saves
    t = torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3)))
    return 0.5 * x * (1 + t), t


@pytest.mark.parametrize("shape", [(64, 256), (7, 7), (1, 1)])
def test_greedy_stores_an_output_that_another_kernel_computes_inline(shape):
    """Each output priced alone takes gelu_tanh for the first and a tanh kernel for the second,
    computing tanh twice; the kernel that computes the tanh inline and stores it costs less."""
    x = torch.randn(*shape)
    compiled = egc.compile(_gelu_and_saved_tanh, [x], profile="cpu-default")
    assert compiled.plan.count("tanh") == 1 and len(compiled.plan.kernels) == 1, compiled.plan
    assert compiled.plan.cost <= egc.compile(_gelu_and_saved_tanh, [x], profile="cpu-default",
                                             extraction="ilp").plan.cost * (1 + 1e-9)
    for got, want in zip(compiled(x), _gelu_and_saved_tanh(x)):
        torch.testing.assert_close(got, want)
