"""Differential testing: random programs of pointwise ops, views, reductions and
row composites, compiled and compared with eager.  Exercises fusion, index maps
through views (transpose, permute, slice, reshape, expand) and reductions over
non-trailing dims together, where hand-written cases are sparse."""
import random

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc

UNARY = [torch.exp, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.neg, F.silu, F.gelu,
         lambda t: torch.sqrt(t.abs() + 0.5), lambda t: t * 0.5 + 1.0]
BINARY = [torch.add, torch.sub, torch.mul, torch.maximum, lambda a, b: a / (b.abs() + 1.0)]


def random_program(rng: random.Random):
    """A function of one [B, R, C] input built from random steps."""
    steps = []
    for _ in range(rng.randint(3, 7)):
        kind = rng.choice(["unary", "binary", "view", "reduce", "row"])
        if kind == "unary":
            steps.append(("unary", rng.randrange(len(UNARY))))
        elif kind == "binary":
            steps.append(("binary", rng.randrange(len(BINARY)), rng.choice(["self", "row", "col", "scalar"])))
        elif kind == "view":
            steps.append(("view", rng.choice(["transpose", "permute", "slice", "reshape", "flip_back"])))
        elif kind == "reduce":
            steps.append(("reduce", rng.choice(["sum", "mean", "amax"]), rng.choice([-1, -2, 0]), True))
        else:
            steps.append(("row", rng.choice(["softmax", "log_softmax", "layer_norm", "rms_norm"])))

    def program(x):
        y = x
        for step in steps:
            if step[0] == "unary":
                y = UNARY[step[1]](y)
            elif step[0] == "binary":
                other = {"self": y, "row": y.mean(-1, keepdim=True),
                         "col": y.amax(0, keepdim=True), "scalar": 1.5}[step[2]]
                y = BINARY[step[1]](y, other if not isinstance(other, float) else torch.tensor(other))
            elif step[0] == "view":
                if step[1] == "transpose":
                    y = y.transpose(-1, -2)
                elif step[1] == "permute":
                    y = y.permute(2, 0, 1)
                elif step[1] == "slice":
                    y = y[..., 1::2] if y.shape[-1] > 2 else y
                elif step[1] == "reshape":
                    y = y.reshape(y.shape[0], -1, y.shape[-1])
                else:
                    y = y.transpose(0, 1).contiguous().transpose(0, 1)
            elif step[0] == "reduce":
                op = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}[step[1]]
                y = y + op(y, step[2], keepdim=True)
            else:
                if step[1] == "softmax":
                    y = torch.softmax(y, -1)
                elif step[1] == "log_softmax":
                    y = torch.log_softmax(y, -2)
                elif step[1] == "layer_norm":
                    y = F.layer_norm(y, y.shape[-1:])
                else:
                    y = F.rms_norm(y, y.shape[-1:], eps=1e-6)
        return y
    return program, steps


@pytest.mark.parametrize("seed", range(24))
def test_random_program_matches_eager(seed):
    rng = random.Random(seed)
    program, steps = random_program(rng)
    shape = (rng.choice([2, 3]), rng.choice([4, 5, 8]), rng.choice([6, 7, 16]))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    compiled = egc.compile(program, [x])
    expected = program(x)
    torch.testing.assert_close(compiled(x), expected, atol=1e-4, rtol=1e-4, equal_nan=True,
                               msg=lambda m: f"{m}\nsteps: {steps}\n{compiled.plan}")


def random_program_with_weights(rng: random.Random):
    """A function of x [6, 8] and w [8, 8]: matmuls, masks, splits, ATen fallbacks (cat)."""
    steps = [rng.choice(["matmul_w", "where", "gt_mul", "softmax_last", "split_add", "unsq_sum", "expand_add",
                         "pow2", "div_scalar", "ln_affine", "gelu_t", "sub_rev", "clamp"])
             for _ in range(rng.randint(3, 8))]

    def program(x, w):
        y = x
        for step in steps:
            if step == "matmul_w":
                y = y @ w
            elif step == "where":
                y = torch.where(y > 0, y, y * 0.1)
            elif step == "gt_mul":
                y = (y > 0.2).float() * y
            elif step == "softmax_last":
                y = torch.softmax(y * 2.0, -1)
            elif step == "split_add":
                a, b = y.split(y.shape[-1] // 2, -1)
                y = torch.cat([a + b, a - b], -1)
            elif step == "unsq_sum":
                y = y.unsqueeze(1).sum(1)
            elif step == "expand_add":
                y = y + y[:, :1].expand(-1, y.shape[1])
            elif step == "pow2":
                y = y.pow(2) - y
            elif step == "div_scalar":
                y = y / 3.0
            elif step == "ln_affine":
                y = F.layer_norm(y, y.shape[-1:], torch.full((y.shape[-1],), 0.5), None)
            elif step == "gelu_t":
                y = F.gelu(y, approximate="tanh")
            elif step == "sub_rev":
                y = 1.0 - y
            else:
                y = torch.clamp(y, min=-0.5)
        return y
    return program, steps


@pytest.mark.filterwarnings("ignore:egraph-compiler")
@pytest.mark.parametrize("seed", range(12))
def test_random_program_with_weights_matches_eager(seed):
    rng = random.Random(1000 + seed)
    program, steps = random_program_with_weights(rng)
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(6, 8, generator=gen), torch.randn(8, 8, generator=gen) * 0.3
    compiled = egc.compile(program, [x, w])
    torch.testing.assert_close(compiled(x, w), program(x, w), atol=1e-4, rtol=1e-4, equal_nan=True,
                               msg=lambda m: f"{m}\nsteps: {steps}\n{compiled.plan}")
