"""The seven anchor workloads the compiler is measured on, written the way a
user writes them (decomposed where users decompose), with input makers at a
small test size, a CPU benchmark size and a GPU benchmark size."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ln_relu(x, w, b):
    return torch.relu(F.layer_norm(x, x.shape[-1:], w, b))


def softmax_by_hand(x):
    row_max = x.amax(-1, keepdim=True)
    e = torch.exp(x - row_max)
    return e / e.sum(-1, keepdim=True)


def gelu_tanh_by_hand(x):
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + torch.tanh(inner))


def mlp_gelu(x, w1, b1, w2, b2):
    return gelu_tanh_by_hand(x @ w1 + b1) @ w2 + b2


def attention_by_hand(q, k, v):
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return softmax_by_hand(scores) @ v


def rmsnorm_swiglu(x, g, w1, w3, w2):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    return (F.silu(h @ w1) * (h @ w3)) @ w2


def gpt_block(x, ln1_w, ln1_b, w_qkv, w_out, ln2_w, ln2_b, w1, b1, w2, b2, n_head=4):
    batch, seq, dim = x.shape
    h = F.layer_norm(x, (dim,), ln1_w, ln1_b)
    q, k, v = (h @ w_qkv).split(dim, dim=-1)
    heads = lambda t: t.view(batch, seq, n_head, dim // n_head).transpose(1, 2)  # noqa: E731
    a = attention_by_hand(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(batch, seq, dim)
    x = x + a @ w_out
    return x + mlp_gelu(F.layer_norm(x, (dim,), ln2_w, ln2_b), w1, b1, w2, b2)


def algebra(x):
    y = torch.exp(torch.log(x)).transpose(0, 1).transpose(0, 1)
    return y * 1.0 + 0.0


NAMES = ["ln_relu", "softmax", "mlp_gelu", "attention", "rmsnorm_swiglu", "gpt_block", "algebra"]

# name -> sizes at "test", "cpu" and "gpu" scale
SIZES = {
    "ln_relu": {"test": (64, 128), "cpu": (4096, 1024), "gpu": (16384, 4096)},
    "softmax": {"test": (64, 128), "cpu": (4096, 1024), "gpu": (16384, 4096)},
    "mlp_gelu": {"test": (32, 64, 128), "cpu": (512, 512, 2048), "gpu": (8192, 2048, 8192)},
    "attention": {"test": (2, 2, 32, 16), "cpu": (2, 4, 256, 64), "gpu": (8, 16, 2048, 64)},
    "rmsnorm_swiglu": {"test": (32, 64, 96), "cpu": (512, 512, 1408), "gpu": (8192, 2048, 5632)},
    "gpt_block": {"test": (2, 16, 64, 4), "cpu": (2, 128, 256, 4), "gpu": (8, 1024, 1024, 16)},
    "algebra": {"test": (64,), "cpu": (2048,), "gpu": (8192,)},
}


def make(name: str, size: str = "test", dtype=torch.float32, device="cpu", seed: int = 0):
    """(function, inputs) for one workload."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    dims = SIZES[name][size]
    if name in ("ln_relu", "softmax"):
        n, d = dims
        return (ln_relu, (r(n, d), r(d), r(d))) if name == "ln_relu" else (softmax_by_hand, (r(n, d),))
    if name == "mlp_gelu":
        t, d, h = dims
        return mlp_gelu, (r(t, d), r(d, h, scale=d ** -0.5), r(h), r(h, d, scale=h ** -0.5), r(d))
    if name == "attention":
        b, heads, s, d = dims
        return attention_by_hand, (r(b, heads, s, d), r(b, heads, s, d), r(b, heads, s, d))
    if name == "rmsnorm_swiglu":
        t, d, h = dims
        return rmsnorm_swiglu, (r(t, d), r(d), r(d, h, scale=d ** -0.5), r(d, h, scale=d ** -0.5),
                                r(h, d, scale=h ** -0.5))
    if name == "gpt_block":
        b, s, d, n_head = dims
        args = (r(b, s, d), r(d), r(d), r(d, 3 * d, scale=d ** -0.5), r(d, d, scale=d ** -0.5), r(d), r(d),
                r(d, 4 * d, scale=d ** -0.5), r(4 * d), r(4 * d, d, scale=(4 * d) ** -0.5), r(d))
        return (lambda *a: gpt_block(*a, n_head=n_head)), args
    if name == "algebra":
        (n,) = dims
        return algebra, (r(n, n).abs() + 0.1,)
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")
