"""Per-step overhead of the runtime: a 40-step program of tiny tensors.

    python -m benchmarks.overhead [--steps 40] [--device cpu|cuda] [--reps 2000]

Fusion is switched off, so every op is its own generated kernel and a call
runs `--steps` kernels on 4-element tensors: the time per step is what the
executor (argument checks, allocation, launch, release) costs over the kernel
itself.  Eager torch on the same program is printed beside it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import egraph_compiler as egc

OPS = [torch.exp, torch.tanh, torch.sigmoid, torch.relu, torch.neg, torch.abs]


def chain(steps: int):
    def program(x):
        for i in range(steps):
            x = OPS[i % len(OPS)](x)
        return x
    return program


def per_call(fn, args, reps: int, device: str) -> float:
    for _ in range(20):
        fn(*args)
    samples = []
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args(argv)
    program = chain(args.steps)
    x = torch.randn(4, device=args.device)
    compiled = egc.compile(program, [x], disable=["fusion"])
    assert len(compiled.plan.kernels) == args.steps, str(compiled.plan)
    torch.testing.assert_close(compiled(x), program(x))
    with torch.no_grad():
        ours = per_call(compiled, (x,), args.reps, args.device)
        eager = per_call(program, (x,), args.reps, args.device)
    print(f"{args.steps} steps on {args.device}: ours {ours * 1e6:.1f} us per call "
          f"({ours / args.steps * 1e6:.2f} us per step); eager {eager * 1e6:.1f} us "
          f"({eager / args.steps * 1e6:.2f} us per op)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
