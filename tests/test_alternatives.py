"""The plans extraction did not choose (egraph_compiler.alternatives): each is an
equivalent program, so each must match eager torch too; they are distinct kernel
structures that lower to distinct code, cheapest estimate first after the chosen one, which
is compile's."""
import logging
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.alternatives import alternatives, code, signature

from programs import build, compare_results, describe, eager_runs, noisy_runs, programs, reference


@pytest.mark.parametrize("name", workloads.NAMES)
def test_alternatives_of_each_workload(name):
    fn, inputs = workloads.make(name, "test")
    unsafe = name == "algebra"
    plans = alternatives(fn, inputs, count=5, unsafe=unsafe)
    chosen = egc.compile(fn, inputs, unsafe=unsafe).plan
    assert signature(plans[0].plan) == signature(chosen) and plans[0].plan.cost == pytest.approx(chosen.cost)
    assert len({signature(c.plan) for c in plans}) == len(plans)  # distinct kernel structures
    assert len({code(c) for c in plans}) == len(plans)  # ...that lower to distinct code
    costs = [c.plan.cost for c in plans[1:]]
    assert costs == sorted(costs)
    if name in ("softmax", "attention", "ln_relu"):  # unfused and decomposed forms exist in their e-graphs
        assert len(plans) == 6
    expected = fn(*inputs)
    for c in plans:
        torch.testing.assert_close(c(*inputs), expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=12, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(programs())
def test_alternatives_of_random_programs_match_float64_reference(program):
    logging.getLogger("torch.__trace").setLevel(logging.WARNING)
    fn, inputs = build(program)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eagers = eager_runs(fn, inputs) + noisy_runs(program)
        ref, margin = reference(program)
        plans = alternatives(fn, inputs, count=3)
        for i, c in enumerate(plans):
            outcome = compare_results(eagers[0], ref, c(*inputs), near=margin < 1e-4, perturbed=eagers[1:])
            assert outcome.kind in ("ok", "ill"), (f"alternative {i} ({c.plan.cost * 1e6:.1f}us): "
                                                   f"{outcome.kind}: {outcome.detail}\n{c.plan}\n{describe(program)}")
