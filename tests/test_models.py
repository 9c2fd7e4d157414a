"""Real torch.nn models, compiled whole and checked against eager."""
import pytest
import torch

import egraph_compiler as egc


def test_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True,
                                             dropout=0.0).eval()
    x = torch.randn(2, 10, 64)
    compiled = egc.compile(layer, [x])
    assert compiled.plan.count("sdpa") == 1 and compiled.plan.count("layer_norm") == 2, str(compiled.plan)
    assert not compiled.plan.fallbacks
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)


def test_model_with_an_unsupported_layer_lists_its_fallback():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 8, 3), torch.nn.GELU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6, 10), torch.nn.LogSoftmax(-1)).eval()
    x = torch.randn(3, 4, 8)
    with pytest.warns(UserWarning, match="conv1d"):
        compiled = egc.compile(model, [x])
    assert any("conv1d" in f for f in compiled.plan.fallbacks)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
