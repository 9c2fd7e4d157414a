"""Constant folding (egraph_compiler/folding.py): what reads no input is
computed once at compile time (program outputs too, handed out as copies);
randomness, large values and parameters are left alone."""
import torch

import egraph_compiler as egc
from egraph_compiler import folding


def folded_inputs(compiled):
    return [n.attr("name") for n in compiled.plan.graph.inputs if n.attr("name").startswith("folded")]


def causal_packed_mask(x):
    """transformers' mask building: positions from arange, packed-sequence ids
    by diff and cumsum, a causal mask by advanced indexing."""
    length = x.shape[1]
    positions = torch.arange(length, device=x.device)[None, :].expand(x.shape[0], length)
    first = positions[:, :1] - 1
    packed = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    q, kv = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = (q >= kv) & (packed[:, q] == packed[:, kv])
    scores = x @ x.transpose(-1, -2)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ x


def test_attention_mask_building_is_computed_once_at_compile_time():
    x = torch.randn(2, 12, 8)
    compiled = egc.compile(causal_packed_mask, [x])
    assert folded_inputs(compiled), str(compiled.plan)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks  # arange, diff, cumsum, index: none is left
    for _ in range(2):
        x = torch.randn(2, 12, 8)
        torch.testing.assert_close(compiled(x), causal_packed_mask(x))


def test_random_values_are_drawn_on_every_call():
    def noisy(x):
        return x + torch.rand(3)
    x = torch.zeros(3)
    compiled = egc.compile(noisy, [x])
    assert not folded_inputs(compiled)
    assert not torch.equal(compiled(x), compiled(x))


def test_a_constant_output_is_the_callers_own_each_call():
    def with_positions(x):
        return x + 1, torch.arange(4) * 2
    for alias_inputs in (False, True):  # (training graphs alias their outputs to inputs; never to a constant)
        compiled = egc.compile(with_positions, [torch.zeros(4)], alias_inputs=alias_inputs)
        assert folded_inputs(compiled) and not compiled.plan.fallbacks, str(compiled.plan)
        _, first = compiled(torch.zeros(4))
        first.add_(100)  # the caller may write into what it gets
        torch.testing.assert_close(compiled(torch.zeros(4))[1], torch.arange(4) * 2)


def test_values_past_the_limit_are_computed_per_call(monkeypatch):
    monkeypatch.setattr(folding, "FOLD_LIMIT_BYTES", 64)
    def shifted(x):
        return x + torch.arange(100.0).cos()
    x = torch.randn(100)
    compiled = egc.compile(shifted, [x])
    assert not folded_inputs(compiled)
    torch.testing.assert_close(compiled(x), shifted(x))
    monkeypatch.undo()
    compiled = egc.compile(shifted, [x])
    assert folded_inputs(compiled)
    torch.testing.assert_close(compiled(x), shifted(x))


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 8))

    def forward(self, x):
        angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * self.inv_freq
        return x * angles.cos() + x.sin() * angles.sin()


def test_parameters_and_buffers_are_inputs_not_constants():
    """Only the arange folds; a buffer that changes after compiling is seen."""
    model = Rotary()
    x = torch.randn(5, 8)
    compiled = egc.compile(model, [x])
    assert len(folded_inputs(compiled)) == 1
    torch.testing.assert_close(compiled(x), model(x))
    model.inv_freq.mul_(3.0)
    torch.testing.assert_close(compiled(x), model(x))
    model.inv_freq = torch.linspace(1.0, 2.0, 8)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_fill_stays_a_constant_of_the_kernel():
    """`torch.full` needs no ATen call: generated code broadcasts the scalar, reading nothing."""
    def compare(x):
        return x >= torch.full((4,), 2.0, dtype=torch.float16) + torch.zeros(3, 4)
    x = torch.randn(3, 4) * 3
    compiled = egc.compile(compare, [x])
    assert not folded_inputs(compiled) and len(compiled.plan.kernels) == 1, str(compiled.plan)
    torch.testing.assert_close(compiled(x), compare(x))
