"""Row means and the layer norms built on them, on long rows of drawn values (constant rows,
infinities, NaN, signed zeros, a far-off term), against eager torch.  Means in float lanes within
blocks (as sums run) failed here: a layer norm over a row of 6.7e5 but one 0 amplified their error
to 1.5e-3 of its outputs.  C++ now sums a layer norm's mean in float lanes and takes the residue
out in its variance's pass (codegen/cpp.py `_centred`); other means keep double lanes."""
import functools

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import egraph_compiler as egc

LENGTHS = [256, 300, 1024, 4099]
PROGRAMS = {
    "mean": lambda x: x.mean(-1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "rms": lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6),
}
# (a far-off term whose square stays finite: at 1e30 a layer norm's float variance overflows, torch's
# to NaN and ours to inf, both far from the double result, a regime the soak calls ill-conditioned)
SPECIAL = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e15, -1e-30]


@functools.cache
def compiled(name: str, n: int):
    return egc.compile(PROGRAMS[name], [torch.zeros(3, n)])


@st.composite
def rows(draw):
    n = draw(st.sampled_from(LENGTHS))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e4]))
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed)) * scale
    if draw(st.booleans()):  # a constant row
        x[draw(st.integers(0, 2))] = draw(st.floats(-1e6, 1e6, allow_nan=False, width=32))
    for _ in range(draw(st.integers(0, 3))):  # special values anywhere, the first term among them
        x[draw(st.integers(0, 2)), draw(st.sampled_from([0, 1, n // 2, n - 1]))] = draw(st.sampled_from(SPECIAL))
    return x


@settings(max_examples=60, deadline=None)
@given(x=rows(), name=st.sampled_from(sorted(PROGRAMS)))
def test_long_row_means_match_eager(x, name):
    got, want = compiled(name, x.shape[-1])(x), PROGRAMS[name](x)
    # a mean of terms of 1e4 that cancel to ~1 is off the exact one by 1e-4 in torch's float sums
    # and in ours alike (both measured against float64): its tolerance is relative to the terms
    terms = x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().mean().item() if name == "mean" else 1.0
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-5, atol=2e-5 * max(1.0, terms))


def test_a_constant_row_normalises_to_exactly_zero():
    for n in LENGTHS:
        x = torch.full((3, n), 0.1).mul(torch.tensor([[1.0], [-7.3], [1e5]]))
        assert torch.equal(compiled("layer_norm", n)(x), torch.zeros(3, n))


def test_a_nearly_constant_row_normalises_within_torchs_rounding():
    """The draw that float-lane means failed (a row of one value but one 0, or one far-off term):
    the layer norm's mean, summed in float lanes, is corrected by its residues."""
    g = torch.Generator().manual_seed(5)
    for n in LENGTHS:
        compiled_norm = compiled("layer_norm", n)
        assert "acc0_r" in compiled_norm.source  # (the residue-corrected form, not double lanes)
        x = (torch.rand(3, 1, generator=g) * 2e6 - 1e6).repeat(1, n)
        x[0, n // 2] = 0.0
        x[1, 0] *= 1.5
        torch.testing.assert_close(compiled_norm(x), F.layer_norm(x, (n,)), rtol=2e-5, atol=2e-5)


def test_a_constant_rows_variance_is_exactly_zero():
    """sum((x - m)^2) less n times the residue's square: 0 for a constant row, never below it."""
    x = torch.full((4, 300), 0.1) * torch.tensor([[1.0], [-7.3], [1e5], [3.3e-3]])
    for fn in (lambda x: x.var(-1, unbiased=False), lambda x: ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)):
        assert torch.equal(egc.compile(fn, [x])(x), torch.zeros(4))
