"""`torch.autocast` around a compiled model, as users write mixed precision: Dynamo hands the graph
over without the region (the state is one of its guards), so the backend writes the region back into
the graph (capture.with_ambient_autocast) and the casts are captured; AOTAutograd's training graphs trace
them themselves.  Outputs and gradients are judged against the float32 model: ours may be off it by
at most twice eager's own bf16 error (plus a little), with no ATen fallback.  (Under the Triton
interpreter, eight times: it truncates float32 to bf16 where a GPU rounds to nearest, TESTING.md, and a
gradient passes several such stores; a wrong answer is off by its own size.)"""
import copy

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                               torch.nn.Linear(256, 64))


def _error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return ((got.float() - truth.float()).abs().max() / truth.float().abs().max()).item()


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("train", [False, True])
def test_autocast_around_a_compiled_model_matches_eager_without_fallbacks(target, train):
    if target == "triton":
        pytest.importorskip("triton")
    model = _model()
    eager, truth = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(32, 64)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph", options={"target": target})
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), eager(x)
    expected = truth(x)
    slack = 8 if target == "triton" else 2
    assert got.dtype == want.dtype == torch.bfloat16
    assert _error(got, expected) <= slack * _error(want, expected) + 1e-3
    if train:
        for out, net in ((got, model), (want, eager), (expected, truth)):
            out.float().square().sum().backward()
        for mine, theirs, exact in zip(model.parameters(), eager.parameters(), truth.parameters()):
            assert _error(mine.grad, exact.grad) <= slack * _error(theirs.grad, exact.grad) + 1e-3
    plans = egc.last_plans()
    assert plans and not [f for p in plans for f in p.fallbacks], [p.fallbacks for p in plans]


def test_layer_norm_of_bf16_with_float32_parameters_is_generated():
    """torch's mixed kernel (bf16 activation, float32 weight and bias) computes in float32 and returns
    bf16; it was an ATen fallback ("torch's result type differs")."""
    x, w, b = torch.randn(8, 64).bfloat16(), torch.randn(64), torch.randn(64)
    compiled = egc.compile(lambda x, w, b: F.layer_norm(x, (64,), w, b), [x, w, b])
    torch.testing.assert_close(compiled(x, w, b), F.layer_norm(x, (64,), w, b))
    assert not compiled.plan.fallbacks and compiled(x, w, b).dtype == torch.bfloat16


class _OutsideTheVocabulary(torch.nn.Module):
    def forward(self, x):
        return torch.special.i0(x) * 2


def test_a_fallback_inside_autocast_names_the_users_line():
    """The autocast region is a higher-order op that capture decomposes by tracing again, whose nodes'
    stack traces point at FX's generated code: the fallback must still name the model's own line."""
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(_OutsideTheVocabulary(), backend="egraph")(torch.randn(4, 4))
    (fallback,) = [f for p in egc.last_plans() for f in p.fallbacks]
    assert f'File "{__file__}"' in fallback and "torch.special.i0(x)" in fallback, fallback
