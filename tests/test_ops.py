"""Per-op correctness: every op of the op table, compiled alone, against eager torch.

A plain module-level table of cases in the OpInfo style (lightning-thunder):
each `OpCase` names the op-table entry it exercises, a function that uses only
that op (plus the views torch needs to express it), and a factory for its
inputs.  The one parametrised test compiles the function with
`egraph_compiler.compile`, checks the plan (the op is there, nothing fell back
to ATen unless the case says so) and compares the result with eager torch in
fp32 - on the example inputs and on a second, fresh set of inputs of the same
shapes, so nothing about the example values may be baked in.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler
from egraph_compiler import UnsupportedOpError, ops, pipeline
from egraph_compiler.plan import check_plan

ATOL = RTOL = 1e-5
INTERNAL_OPS = {"input", "const", "extern"}


# ---- input factories -----------------------------------------------------

def randn(*shape):
    return torch.randn(shape)


def pos(*shape):
    """Strictly positive values in [0.1, 2.1): for log, sqrt, rsqrt."""
    return torch.rand(shape) * 2 + 0.1


def ties(*shape):
    """Small integers as float32, so equalities really occur (eq/ne/ge/le)."""
    return torch.randint(-2, 3, shape).float()


def bools(*shape):
    return torch.rand(shape) > 0.5


def with_nan(*shape):
    x = torch.randn(shape)
    x.view(-1)[::5] = float("nan")
    return x


@dataclass(frozen=True)
class OpCase:
    id: str  # pytest id
    op: str  # the op-table entry this case exercises (must appear in the plan)
    fn: Callable
    make: Callable[[], tuple]  # builds a fresh tuple of inputs
    fallback: str | None = None  # a plan.fallbacks entry must start with this; None: no fallbacks at all
    atol: float = ATOL
    rtol: float = RTOL


C = OpCase
CASES: list[OpCase] = [
    # ---- pointwise unary ----
    C("exp", "exp", torch.exp, lambda: (randn(3, 5),)),
    C("exp_0d", "exp", torch.exp, lambda: (randn(),)),
    C("log_positive", "log", torch.log, lambda: (pos(3, 5),)),
    C("tanh_noncontig_t", "tanh", torch.tanh, lambda: (randn(6, 4).t(),)),
    C("erf", "erf", torch.erf, lambda: (randn(2, 3, 4),)),
    C("relu_nan", "relu", torch.relu, lambda: (with_nan(4, 5),)),
    C("sigmoid", "sigmoid", torch.sigmoid, lambda: (randn(3, 5) * 4,)),
    C("neg_1elem", "neg", torch.neg, lambda: (randn(1),)),
    C("abs_strided_slice", "abs", torch.abs, lambda: (randn(4, 10)[:, 1::3],)),
    C("sqrt_positive", "sqrt", torch.sqrt, lambda: (pos(3, 5),)),
    C("rsqrt_positive", "rsqrt", torch.rsqrt, lambda: (pos(3, 5),)),
    C("silu", "silu", F.silu, lambda: (randn(3, 5) * 3,)),
    C("gelu_none", "gelu", F.gelu, lambda: (randn(3, 5) * 3,)),
    C("gelu_tanh", "gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), lambda: (randn(3, 5) * 3,)),
    # ---- pow with a scalar exponent (negative bases: NaN for fractional exponents) ----
    C("pow_2", "pow", lambda x: torch.pow(x, 2), lambda: (randn(3, 5),)),
    C("pow_0.5", "pow", lambda x: x ** 0.5, lambda: (randn(3, 5),)),
    C("pow_3", "pow", lambda x: torch.pow(x, 3), lambda: (randn(3, 5),)),
    C("pow_-1", "pow", lambda x: torch.pow(x, -1), lambda: (pos(3, 5) * torch.sign(randn(3, 5)),)),
    C("pow_1.7", "pow", lambda x: torch.pow(x, 1.7), lambda: (randn(3, 5),)),
    C("pow_tensor_tensor", "pow", torch.pow, lambda: (pos(3, 5), randn(5))),
    C("pow_scalar_base", "pow", lambda x: 2.0 ** x, lambda: (randn(3, 5),)),
    # ---- binary arithmetic: tensor-tensor with broadcasting, tensor-scalar, scalar-tensor ----
    C("add_bcast", "add", torch.add, lambda: (randn(4, 1, 8), randn(3, 1))),
    C("add_scalar", "add", lambda x: x + 2.5, lambda: (randn(3, 5),)),
    C("add_alpha", "add", lambda x, y: torch.add(x, y, alpha=0.5), lambda: (randn(3, 5), randn(5))),
    C("sub_bcast", "sub", torch.sub, lambda: (randn(4, 1, 8), randn(3, 1))),
    C("sub_scalar", "sub", lambda x: x - 1.5, lambda: (randn(3, 5),)),
    C("sub_scalar_lhs", "sub", lambda x: 1.5 - x, lambda: (randn(3, 5),)),
    C("mul_bcast", "mul", torch.mul, lambda: (randn(4, 1, 8), randn(3, 1))),
    C("mul_scalar", "mul", lambda x: x * -3.0, lambda: (randn(3, 5),)),
    C("div_bcast", "div", torch.div, lambda: (randn(4, 1, 8), pos(3, 1))),
    C("div_scalar", "div", lambda x: x / 4.0, lambda: (randn(3, 5),)),
    C("div_scalar_lhs", "div", lambda x: 2.0 / x, lambda: (pos(3, 5),)),
    C("maximum_bcast_nan", "maximum", torch.maximum, lambda: (with_nan(4, 1, 8), randn(3, 1))),
    C("maximum_0d_operand", "maximum", torch.maximum, lambda: (randn(3, 5), randn())),
    C("maximum_scalar_clamp_min", "maximum", lambda x: torch.clamp_min(x, 0.25), lambda: (randn(3, 5),)),
    # ---- comparisons (bool outputs) ----
    C("gt_bcast", "gt", torch.gt, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("gt_scalar", "gt", lambda x: x > 0.5, lambda: (ties(3, 5),)),
    C("ge_bcast", "ge", torch.ge, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("ge_scalar", "ge", lambda x: x >= 1.0, lambda: (ties(3, 5),)),
    C("lt_bcast", "lt", torch.lt, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("lt_scalar", "lt", lambda x: x < 0.0, lambda: (ties(3, 5),)),
    C("le_bcast", "le", torch.le, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("le_scalar", "le", lambda x: x <= -1.0, lambda: (ties(3, 5),)),
    C("eq_bcast", "eq", torch.eq, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("eq_scalar", "eq", lambda x: x == 1.0, lambda: (ties(3, 5),)),
    C("ne_bcast", "ne", torch.ne, lambda: (ties(4, 1, 8), ties(3, 1))),
    C("ne_scalar", "ne", lambda x: x != 0.0, lambda: (ties(3, 5),)),
    # ---- where ----
    C("where_bcast", "where", torch.where, lambda: (bools(4, 1, 8), randn(3, 1), randn(8))),
    C("where_scalar_other", "where", lambda c, x: torch.where(c, x, 0.0), lambda: (bools(3, 5), randn(3, 5))),
    # ---- cast: float32 <-> bool is generated; other dtypes run as ATen fallbacks ----
    C("cast_to_float64", "cast", lambda x: x.to(torch.float64), lambda: (randn(3, 5),), fallback="cast"),
    C("cast_float64_to_float", "cast", lambda x: x.float(), lambda: (randn(3, 5).double(),), fallback="cast"),
    C("cast_to_int32", "cast", lambda x: (x * 4).to(torch.int32), lambda: (randn(3, 5),), fallback="cast"),
    C("cast_to_bool", "cast", lambda x: x.to(torch.bool), lambda: (ties(3, 5),)),
    C("cast_bool_to_float", "cast", lambda m: m.float(), lambda: (bools(3, 5),)),
    # ---- reductions: dims [-1], [0], [0, 2], all; keepdim True and False ----
    C("sum_dim-1", "sum", lambda x: x.sum(-1), lambda: (randn(2, 3, 8),)),
    C("sum_dim0_keepdim", "sum", lambda x: x.sum(0, keepdim=True), lambda: (randn(2, 3, 8),)),
    C("sum_dims0,2", "sum", lambda x: x.sum((0, 2)), lambda: (randn(2, 3, 8),)),
    C("sum_all", "sum", lambda x: x.sum(), lambda: (randn(2, 3, 8),)),
    C("sum_all_keepdim", "sum", lambda x: torch.sum(x, dim=None, keepdim=True), lambda: (randn(2, 3, 8),)),
    C("sum_1elem", "sum", lambda x: x.sum(-1), lambda: (randn(1),)),
    C("mean_dim-1_keepdim", "mean", lambda x: x.mean(-1, keepdim=True), lambda: (randn(2, 3, 8),)),
    C("mean_dim0", "mean", lambda x: x.mean(0), lambda: (randn(2, 3, 8),)),
    C("mean_dims0,2_keepdim", "mean", lambda x: x.mean((0, 2), keepdim=True), lambda: (randn(2, 3, 8),)),
    C("mean_all", "mean", lambda x: x.mean(), lambda: (randn(2, 3, 8),)),
    C("mean_noncontig_permute", "mean", lambda x: x.mean(-1), lambda: (randn(8, 3, 2).permute(2, 1, 0),)),
    C("amax_dim-1", "amax", lambda x: torch.amax(x, -1), lambda: (randn(2, 3, 8),)),
    C("amax_dim0_keepdim", "amax", lambda x: torch.amax(x, 0, keepdim=True), lambda: (randn(2, 3, 8),)),
    C("amax_dims0,2", "amax", lambda x: torch.amax(x, (0, 2)), lambda: (randn(2, 3, 8),)),
    C("amax_all", "amax", lambda x: torch.amax(x), lambda: (randn(2, 3, 8),)),
    C("amax_dim-1_nan", "amax", lambda x: torch.amax(x, -1), lambda: (with_nan(3, 8),)),
    # ---- matmul ----
    C("matmul_2d", "matmul", torch.matmul, lambda: (randn(3, 4), randn(4, 5))),
    C("matmul_batched_3d", "matmul", torch.matmul, lambda: (randn(2, 3, 4), randn(2, 4, 5))),
    C("matmul_bcast_batch", "matmul", torch.matmul, lambda: (randn(2, 1, 3, 4), randn(3, 4, 5))),
    C("matmul_3d_by_2d", "matmul", torch.matmul, lambda: (randn(2, 3, 4), randn(4, 5))),
    C("matmul_mat_vec", "matmul", torch.matmul, lambda: (randn(3, 4), randn(4))),
    C("matmul_vec_mat", "matmul", torch.matmul, lambda: (randn(4), randn(4, 5))),
    C("matmul_vec_vec_0d", "matmul", torch.matmul, lambda: (randn(4), randn(4))),
    C("matmul_batched_vec", "matmul", torch.matmul, lambda: (randn(2, 3, 4), randn(4))),
    C("matmul_noncontig_t", "matmul", torch.matmul, lambda: (randn(4, 3).t(), randn(5, 4).t())),
    # ---- layout ----
    C("transpose", "transpose", lambda x: x.transpose(0, 2), lambda: (randn(2, 3, 4),)),
    C("transpose_2d_t", "transpose", lambda x: x.t(), lambda: (randn(3, 5),)),
    C("permute", "permute", lambda x: x.permute(2, 0, 1), lambda: (randn(2, 3, 4),)),
    C("reshape", "reshape", lambda x: x.reshape(4, 6), lambda: (randn(2, 3, 4),)),
    C("view_infer", "reshape", lambda x: x.view(-1, 2), lambda: (randn(2, 3, 4),)),
    C("reshape_after_transpose", "reshape", lambda x: x.transpose(0, 1).reshape(6, 4), lambda: (randn(2, 3, 4),)),
    C("unsqueeze", "reshape", lambda x: x.unsqueeze(1), lambda: (randn(3, 4),)),
    C("expand", "expand", lambda x: x.expand(2, 3, 4), lambda: (randn(3, 1),)),
    C("slice_step2", "slice", lambda x: x[:, 1::2], lambda: (randn(3, 8),)),
    C("slice_negative_start", "slice", lambda x: x[-2:], lambda: (randn(5, 3),)),
    C("slice_neg_start_step2", "slice", lambda x: x[..., -6:-1:2], lambda: (randn(2, 3, 8),)),
    C("select", "slice", lambda x: x[1], lambda: (randn(3, 4),)),
    C("split_uneven", "slice", lambda x: torch.split(x, 3, dim=-1), lambda: (randn(2, 8),)),
    C("split_sizes_dim0", "slice", lambda x: torch.split(x, [1, 3], dim=0), lambda: (randn(4, 3),)),
    # ---- row composites ----
    C("softmax_dim-1", "softmax", lambda x: torch.softmax(x, -1), lambda: (randn(3, 8) * 3,)),
    C("softmax_dim0", "softmax", lambda x: torch.softmax(x, 0), lambda: (randn(3, 4, 5) * 3,)),
    C("softmax_1x1", "softmax", lambda x: torch.softmax(x, -1), lambda: (randn(1, 1),)),
    C("log_softmax_dim-1", "log_softmax", lambda x: F.log_softmax(x, -1), lambda: (randn(3, 8) * 3,)),
    C("log_softmax_dim0_noncontig", "log_softmax", lambda x: F.log_softmax(x, 0), lambda: (randn(5, 4).t() * 3,)),
    C("layer_norm_weight_bias", "layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b),
      lambda: (randn(2, 3, 8), randn(8), randn(8))),
    C("layer_norm_no_affine", "layer_norm", lambda x: F.layer_norm(x, (8,)), lambda: (randn(2, 3, 8) * 2 + 1,)),
    C("layer_norm_last2_weight_bias", "layer_norm", lambda x, w, b: F.layer_norm(x, (3, 8), w, b, eps=1e-3),
      lambda: (randn(2, 3, 8), randn(3, 8), randn(3, 8))),
    C("rms_norm_weight", "rms_norm", lambda x, w: F.rms_norm(x, (8,), w, eps=1e-6),
      lambda: (randn(2, 3, 8), randn(8))),
    C("rms_norm_no_weight_default_eps", "rms_norm", lambda x: F.rms_norm(x, (8,)), lambda: (randn(2, 3, 8),)),
    C("rms_norm_last2", "rms_norm", lambda x, w: F.rms_norm(x, (3, 8), w, eps=1e-5),
      lambda: (randn(2, 3, 8), randn(3, 8))),
    # ---- library calls ----
    C("linear_bias", "linear", F.linear, lambda: (randn(3, 8), randn(5, 8), randn(5))),
    C("linear_no_bias_3d", "linear", F.linear, lambda: (randn(2, 3, 8), randn(5, 8))),
    C("sdpa_no_mask", "sdpa", F.scaled_dot_product_attention,
      lambda: (randn(2, 2, 5, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 8))),
    C("sdpa_causal", "sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
      lambda: (randn(2, 2, 5, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 8))),
    C("sdpa_float_mask", "sdpa_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
      lambda: (randn(2, 2, 5, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 4), randn(5, 6))),
    # ---- an op outside the vocabulary, feeding a generated kernel ----
    C("extern_cumsum_then_exp", "exp", lambda x: torch.exp(torch.cumsum(x, -1)), lambda: (randn(3, 5),),
      fallback="aten.cumsum"),
]


def _clone(inputs):
    return tuple(t.clone() for t in inputs)


def _compile_quietly(fn, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback warnings have their own test below
        return egraph_compiler.compile(fn, list(inputs), **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op(case: OpCase):
    torch.manual_seed(0)
    example = case.make()
    compiled = _compile_quietly(case.fn, example)
    plan = compiled.plan
    check_plan(plan)
    assert case.op in plan.ops(), f"{case.op} missing from the plan:\n{plan}"
    if case.fallback is None:
        assert plan.fallbacks == [], f"unexpected ATen fallbacks: {plan.fallbacks}"
    else:
        assert any(f.startswith(case.fallback) for f in plan.fallbacks), \
            f"expected a {case.fallback} fallback, got {plan.fallbacks}"
    for inputs in (example, case.make()):  # the example and fresh values of the same shapes
        before = _clone(inputs)
        expected = case.fn(*inputs)
        actual = compiled(*inputs)
        torch.testing.assert_close(actual, expected, atol=case.atol, rtol=case.rtol, equal_nan=True)
        for t, t0 in zip(inputs, before):  # the caller's tensors are left untouched
            torch.testing.assert_close(t, t0, atol=0, rtol=0, equal_nan=True)


def test_every_op_of_the_table_has_a_case():
    covered = {c.op for c in CASES}
    missing = set(ops.OPS) - INTERNAL_OPS - covered
    assert not missing, f"op-table entries without a test case: {sorted(missing)}"
    assert covered <= set(ops.OPS)


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


# ---- an unsupported op: ATen fallback, warning, and strict=True ----

def _cumsum(x):
    return torch.cumsum(x, dim=0)


def test_unsupported_op_falls_back_with_warning(monkeypatch):
    monkeypatch.setattr(pipeline, "_warned", set())  # the warning fires once per op per process
    torch.manual_seed(0)
    x = randn(4, 3)
    with pytest.warns(UserWarning, match="cumsum"):
        compiled = egraph_compiler.compile(_cumsum, [x])
    assert any("cumsum" in f for f in compiled.plan.fallbacks), compiled.plan.fallbacks
    assert [k.kind for k in compiled.plan.kernels] == ["aten"]
    for inputs in ((x,), (randn(4, 3),)):
        torch.testing.assert_close(compiled(*inputs), _cumsum(*inputs), atol=ATOL, rtol=RTOL)


def test_unsupported_op_strict_raises():
    with pytest.raises(UnsupportedOpError, match="cumsum"):
        egraph_compiler.compile(_cumsum, [randn(4, 3)], strict=True)
