"""A small transformer-style MLP block compiled by egraph-compiler.

Run: python examples/mlp.py
It compiles the module, prints the chosen plan, and checks the compiled result
against eager PyTorch (exiting non-zero on a mismatch).

See every IR level (or one, with --level plan|loops|source|...):
    egc explain examples/mlp.py
    egc explain examples/mlp.py --target triton --level source
"""
import sys

import torch

import egraph_compiler as egc


class MLPBlock(torch.nn.Module):
    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(self.norm(x))
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)))  # gelu, by hand
        return x + self.down(h) * 1.0  # the "* 1.0" is left for the rules to remove


program = MLPBlock()


def example_inputs():
    torch.manual_seed(0)
    return (torch.randn(8, 32, 64),)


def main() -> int:
    torch.manual_seed(0)
    inputs = example_inputs()
    compiled = egc.compile(program, inputs)
    print(compiled.plan)
    with torch.no_grad():  # compiled programs are inference-only (grad-requiring calls run eagerly)
        expected = program(*inputs)
        got = compiled(*inputs)
    error = (got - expected).abs().max().item()
    print(f"max |compiled - eager| = {error:.3g}")
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        print("MISMATCH against eager PyTorch", file=sys.stderr)
        return 1
    print("matches eager PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
