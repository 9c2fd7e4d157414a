"""Ops that real models write which the op table holds in another form (forms.py and
indexing.py, torch's core decompositions: decompose.py): each compiles with no ATen fallback and matches eager, on the C++ target and
under the Triton interpreter, for floats with NaN, integers and bfloat16.  And bilinear
resampling to a size, a library call (BEiT)."""
import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc

torch.manual_seed(0)
X = torch.randn(3, 5, 4)
X[0, 0, 0] = float("nan")
X[1, 2, 3] = float("-inf")
I = torch.randint(-10, 10, (3, 5, 4))
E = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, -0.5, 1e-8, -1e-8, 1e-30, 0.5, 3.0,
                  20.0, -20.0, 88.0, 89.0, -100.0, 100.0, 1e-4, -1e-4])

def _assigned(a):
    y = a.clone()
    y[:, 1:3] = y[:, 1:3] * 0.5  # a KV cache's `cache[:, :, pos] = k` in its functional form
    y[:, 0] = 1.0
    y[-1] += 2
    y[..., 2:] = -y[..., :2]
    return y


CASES = {  # name: (program, inputs)
    "minimum": (lambda a, b: torch.minimum(a, b), [X, torch.randn(5, 4)]),
    "minimum_integers": (lambda a, b: torch.minimum(a, b), [I, torch.randint(-5, 5, (5, 4))]),
    "maximum_integers": (lambda a, b: torch.maximum(a, b) + 1, [I, torch.randint(-5, 5, (5, 4))]),
    "clamp": (lambda a: torch.clamp(a, -0.5, 0.5), [X]),
    "clamp_integers": (lambda a: torch.clamp(a, -3, 4) * 2, [I]),
    "clamp_bounds_crossed": (lambda a: torch.clamp(a, 0.5, -0.5), [X]),
    "clamp_max": (lambda a: a.clamp(max=0.3), [X]),
    "clamp_min_integers": (lambda a: a.clamp(min=-2), [I]),
    "clamp_by_tensors": (lambda a, lo, hi: torch.clamp(a, lo, hi), [X, torch.randn(4) - 1, torch.randn(4) + 1]),
    "ceil": (lambda a: torch.ceil(a * 3), [X]),
    "ceil_integers": (lambda a: torch.ceil(a) - 1, [I]),
    "square": (lambda a: torch.square(a) - a, [X]),
    "stack_last": (lambda a: torch.stack((a, -a), -1).flatten(-2), [X]),  # GPT-J's rotate_every_two
    "stack_first": (lambda a, b: torch.stack([a, b]), [X, X * 2]),
    "comparison_aliases": (lambda a: torch.greater(a, 0).float() + torch.less_equal(a, 0.5).float()
                           - torch.not_equal(a, 1.0).float(), [X]),
    "index_after_a_slice": (lambda a: a[:, [-2]] * 2, [X]),  # Falcon's qkv[..., [-2], :]
    "index_after_two_slices": (lambda a: a[:, :, [3, 0, 1]] * 2, [X]),
    "index_by_a_matrix_after_a_slice": (lambda a, i: a[:, i] + 1, [X, torch.tensor([[1, -1], [0, 4]])]),
    "l2_normalise": (lambda a: a / a.norm(dim=-1, keepdim=True), [X]),  # CLIP's embeddings
    "vector_norms": (lambda a: torch.linalg.vector_norm(a, ord=1, dim=(0, 2)) + a.norm(), [X]),
    "f_normalize": (lambda a: F.normalize(a, dim=1), [X]),
    # activations and tests by torch's kernels' own forms; log1p and expm1 where rounding shows
    "log1p_expm1": (lambda a: torch.log1p(a) + torch.expm1(a) * 2, [E]),
    "log1p_of_integers": (lambda a: torch.log1p(a + 10), [I]),
    "softplus": (lambda a: F.softplus(a) + F.softplus(a, beta=2.0, threshold=3.0), [E]),  # (core decomposition)
    "elu_selu_celu": (lambda a: F.elu(a) + F.selu(a) + F.celu(a, 2.0), [E]),
    "relu6_hardtanh": (lambda a: F.relu6(a) + F.hardtanh(a, -2.0, 3.0), [X]),
    "leaky_relu": (lambda a: F.leaky_relu(a, 0.2) - F.leaky_relu(a), [X]),
    "nan_to_num": (lambda a: torch.nan_to_num(a, nan=0.5, posinf=2.0) + torch.isfinite(a).float(), [E]),
    "amin": (lambda a: a.amin(-1), [X]),
    "amin_of_two_dims": (lambda a: a.amin((0, 2), keepdim=True) + a, [X]),
    "xor_of_masks": (lambda a: (a > 0) ^ torch.logical_xor(a < 1, a > -1), [X]),
    "sum_of_integers_in_float32": (lambda a: a.sum(-1, dtype=torch.float32) / 3, [I]),
    "slice_and_select_assignments": (_assigned, [X]),  # slice_scatter / select_scatter
    "argmax_argmin": (lambda a: a.argmax(-1) * 10 + a.argmin(0).sum() + a.argmax(), [X]),  # (NaN and -inf in X)
    "argmax_of_ties": (lambda a: a.argmax(0) * 10 + a.argmin(-1, keepdim=True), [torch.tensor(
        [[1.0, 3.0, 3.0, -0.0], [3.0, 0.0, 3.0, 0.0], [float("inf"), 3.0, -1.0, 0.0]])]),
    "max_min_with_indices": (lambda a: torch.max(a, 1).values + torch.min(a, 1).indices, [X]),
    "any_all_and_truth": (lambda a: a.any(-1) ^ a.all(-1) | torch.logical_not(a).any(-1) | torch.logical_and(a, 1 - a).any(),
                          [torch.tensor([[[0.0, float("nan"), -0.0], [0.0, 0.0, 0.0]], [[1.0, 2.0, -3.0], [0.0, 1.0, 0.0]]])]),
    "any_all_of_integers": (lambda a: a.any(-1) | a.all(-1) & torch.logical_or(a, a - 1).all(-1), [I]),
    "avg_pool2d_tiling": (lambda a: F.avg_pool2d(a, 2) + F.avg_pool2d(a, (4, 3)).mean(), [torch.randn(2, 3, 8, 6)]),
    "nearest_upsampling_by_whole_factors": (lambda a: F.interpolate(a, scale_factor=2) + F.interpolate(
        a, size=(8, 15)).mean() + F.interpolate(a[:1], scale_factor=(3, 1)).sum(), [torch.randn(2, 3, 4, 5)]),
    # torch's core decompositions (decompose.py) into the op table's ops
    "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), [X.nan_to_num(), torch.randn(3, 4, 2)]),
    "logsumexp": (lambda a: a.logsumexp(-1), [X]),
    "cross_entropy": (lambda a, t: F.cross_entropy(a, t, label_smoothing=0.1), [torch.randn(6, 5), torch.arange(6) % 5]),
    "unbind_tril": (lambda a: sum(t.tril() * k for k, t in enumerate(a.unbind(0))), [X.nan_to_num()]),
}


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_written_forms_compile_without_fallback(name, target):
    fn, inputs = CASES[name]
    compiled = egc.compile(fn, inputs, target=target)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks
    got, want = compiled(*inputs), fn(*inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_clamp_and_ceil_in_bfloat16(target):
    fn = lambda a: torch.clamp(a, -0.5, 0.5) * 2 + torch.ceil(a)  # noqa: E731
    x = X.bfloat16()
    compiled = egc.compile(fn, [x], target=target)
    assert not compiled.plan.fallbacks
    want = fn(x.double())  # (eager's bf16 rounds each step; ours once: both within bf16's step of this)
    torch.testing.assert_close(compiled(x).double(), want, equal_nan=True, rtol=8e-3, atol=8e-3)


def test_an_index_out_of_range_after_a_slice_raises():
    fn = lambda a, i: a[:, i]  # noqa: E731
    compiled = egc.compile(fn, [X, torch.tensor([1, 2])])
    with pytest.raises(IndexError):
        compiled(X, torch.tensor([1, 5]))


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [(9, 11), (3, 4)])
def test_bilinear_resampling_to_a_size_is_a_library_call(size, align_corners, target):
    """BEiT resamples its relative position bias table with F.interpolate in every layer."""
    fn = lambda a: F.interpolate(a, size=size, mode="bilinear", align_corners=align_corners) * 2  # noqa: E731
    x = torch.randn(2, 3, 5, 7)
    compiled = egc.compile(fn, [x], target=target)
    assert not compiled.plan.fallbacks
    assert any(k.output.op == "upsample_bilinear2d" for k in compiled.plan.kernels)
    torch.testing.assert_close(compiled(x), fn(x))


def test_bilinear_resampling_by_a_scale_stays_in_aten_and_says_so():
    """torch maps coordinates with a given scale itself, not with the size it makes: ATen, warned."""
    fn = lambda a: F.interpolate(a, scale_factor=1.5, mode="bilinear")  # noqa: E731
    x = torch.randn(1, 3, 5, 7)
    with pytest.warns(UserWarning, match="upsample_bilinear2d"):
        compiled = egc.compile(fn, [x])
    torch.testing.assert_close(compiled(x), fn(x))
