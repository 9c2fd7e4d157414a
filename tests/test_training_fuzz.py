"""Gradients of random programs (tests/programs.py) through torch.compile(backend="egraph"):
AOTAutograd's forward and backward graphs compiled, the inputs' gradients compared with eager's
and with float64's, with a tolerance that grows with eager's own error (programs.compare_results).
EGC_FUZZ_TRAIN_EXAMPLES sets the number of programs (24)."""
import os
import warnings

import torch
from hypothesis import event, given

import egraph_compiler as egc
from programs import NEAR, _jitter, build, compare_results, describe, failure_message, fn_source, make_inputs, programs, \
    reference
from test_differential import fuzz_settings
from torch.utils import _pytree as pytree


def _gradients(fn, inputs, weights):
    """d(sum of w * output)/d(float inputs), or None when the program has no such gradient."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = [o for o in pytree.tree_leaves(fn(*xs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return None
    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, weights))
    wrt = [x for x in xs if x.requires_grad]
    return tuple(g if g is not None else torch.zeros_like(x)
                 for g, x in zip(torch.autograd.grad(loss, wrt, allow_unused=True), wrt))


def _weights(fn, inputs):
    with torch.no_grad():
        outs = [o for o in pytree.tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    gen = torch.Generator().manual_seed(5)
    return [torch.rand(o.shape, generator=gen, dtype=torch.float64) * 2 - 1 for o in outs]


EXAMPLES = int(os.environ.get("EGC_FUZZ_TRAIN_EXAMPLES", "24"))


@fuzz_settings(EXAMPLES)
@given(programs())
def test_random_programs_gradients(program):
    fn, inputs = build(program)
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(fn_source(program, reference=True), namespace)
    inputs64 = [t.double() if t.is_floating_point() else t for t in make_inputs(program.inputs, program.seed)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weights = _weights(fn, inputs)
            eager = _gradients(fn, inputs, weights)
            noisy = [_gradients(fn, [_jitter(t, torch.Generator().manual_seed(k)) for t in inputs], weights)
                     for k in range(2)]
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                ref = _gradients(namespace["fn"], inputs64, weights)
            finally:
                torch.set_default_dtype(old)
    except Exception:  # noqa: BLE001 - eager cannot differentiate it (or run it): nothing to compare
        event("eager has no gradient")
        return
    if eager is None:
        event("no float output depends on a float input")
        return
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = _gradients(torch.compile(fn, backend="egraph"), inputs, weights)
    _, margin = reference(program)
    outcome = compare_results(eager, ref, compiled, margin < NEAR, perturbed=noisy)
    event(outcome.kind)
    if outcome.failed:
        raise AssertionError("gradients: " + failure_message(program, outcome))
    assert egc.last_plans() or not program.live_steps(), "nothing was compiled:\n" + describe(program)
