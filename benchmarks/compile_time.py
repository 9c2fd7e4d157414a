"""Compile-time benchmark: saturation + extraction of a 12-layer GPT-2-small
sized graph (d=768, 12 heads, 12 blocks), and cold compile of one gpt_block
against Inductor's cold compile, in one process.

    python -m benchmarks.compile_time [--layers 12] [--seq 64]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_inductor_"))
os.environ.setdefault("EGC_CACHE_DIR", tempfile.mkdtemp(prefix="bench_egc_"))

import torch  # noqa: E402

import egraph_compiler as egc  # noqa: E402
from egraph_compiler import workloads  # noqa: E402
from egraph_compiler.calibrate import profile_for  # noqa: E402
from egraph_compiler.egraph.greedy import extract_kernels  # noqa: E402
from egraph_compiler.pipeline import Levels, Options, build_egraph  # noqa: E402


def gpt2_stack(layers: int, dim: int = 768, heads: int = 12):
    gen = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    params = []
    for _ in range(layers):
        params += [r(dim), r(dim), r(dim, 3 * dim, scale=dim ** -0.5), r(dim, dim, scale=dim ** -0.5), r(dim), r(dim),
                   r(dim, 4 * dim, scale=dim ** -0.5), r(4 * dim), r(4 * dim, dim, scale=(4 * dim) ** -0.5), r(dim)]

    def model(x, *p):
        for i in range(layers):
            x = workloads.gpt_block(x, *p[10 * i:10 * i + 10], n_head=heads)
        return x
    return model, params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    model, params = gpt2_stack(args.layers)
    x = torch.randn(1, args.seq, 768)
    levels = Levels()
    start = time.perf_counter()
    graph, eclasses, report, _ = build_egraph(model, [x] + params, Options(time_limit=60.0), levels)
    captured = levels.timings["capture"]
    saturated = time.perf_counter() - start - captured
    start = time.perf_counter()
    extract_kernels(eclasses, graph, profile_for("cpu"))
    extracted = time.perf_counter() - start
    print(f"{args.layers}-layer GPT-2-small graph ({len(graph.topo())} Graph IR nodes): capture {captured:.2f}s, "
          f"saturation {saturated:.2f}s ({report.stop_reason}, {report.iterations} iterations, "
          f"{report.enodes} e-nodes), extraction {extracted:.2f}s; saturation + extraction "
          f"{saturated + extracted:.2f}s")

    fn, inputs = workloads.make("gpt_block", "cpu")
    start = time.perf_counter()
    compiled = egc.compile(fn, inputs)
    compiled(*inputs)
    ours = time.perf_counter() - start
    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(fn)(*inputs)
    inductor = time.perf_counter() - start
    print(f"gpt_block cold compile + first call: ours {ours:.2f}s, inductor {inductor:.2f}s")


if __name__ == "__main__":
    main()
