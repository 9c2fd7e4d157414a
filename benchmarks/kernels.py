"""Per-kernel device time of one workload: eager vs Inductor vs egraph-compiler.

    python -m benchmarks.kernels --workload gpt_block [--size gpu] [--device cuda]
                                 [--dtype bfloat16] [--calls 20]

Each variant runs `--calls` times under torch.profiler after a warm-up; the
table lists every device kernel (CPU: every op) by total self time per call,
so a slow workload can be read kernel by kernel against Inductor's.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import egraph_compiler as egc
from egraph_compiler import workloads


def kernel_times(fn, inputs, calls: int, device: str) -> list[tuple[str, float, int]]:
    """(kernel name, microseconds per call, launches per call), slowest first."""
    for _ in range(3):
        fn(*inputs)
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = (e.self_device_time_total if device == "cuda" else e.self_cpu_time_total) / calls
        if us > 0 and (device != "cuda" or e.device_type.name == "CUDA"):
            rows.append((e.key, us, e.count // calls))
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=workloads.NAMES)
    p.add_argument("--size", default="cpu", choices=["test", "cpu", "gpu"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    fn, inputs = workloads.make(args.workload, size=args.size, dtype=getattr(torch, args.dtype), device=args.device)
    variants = {"eager": fn, "inductor": torch.compile(fn), "ours": egc.compile(fn, inputs)}
    with torch.no_grad():
        for name, f in variants.items():
            rows = kernel_times(f, inputs, args.calls, args.device)
            print(f"\n## {name}: {sum(r[1] for r in rows):.1f} us per call in {sum(r[2] for r in rows)} kernels\n")
            for key, us, count in rows[:25]:
                print(f"{us:9.1f} us  x{count:<3d} {key[:110]}")
    if hasattr(variants["ours"], "plan"):
        print("\n## our plan\n")
        print(variants["ours"].plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
