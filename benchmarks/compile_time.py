"""Compile-time benchmark: saturation + extraction of a 12-layer GPT-2-small
sized graph (d=768, 12 heads, 12 blocks), and cold compile of one gpt_block
against Inductor's cold compile, in one process.

    python -m benchmarks.compile_time [--layers 12] [--seq 64]
    python -m benchmarks.compile_time --scaling 2,8,32

`--scaling`: a LLaMA-shaped `transformers` model (hidden 64, GQA 4/2 heads) with
each layer count, through `torch.compile` (ours `backend="egraph"`, Inductor's
default), capture to first call, each in a fresh process with fresh caches after
one warm-up compile of a tiny function (so neither pays its one-time start-up).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

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


def llama_once(layers: int, compiler: str) -> None:
    """One cold compile of a LLaMA-shaped model in this (fresh) process; prints a JSON line."""
    import json
    import warnings
    import transformers as tf
    warnings.simplefilter("ignore")
    backend = "egraph" if compiler == "ours" else "inductor"
    with torch.no_grad():
        torch.compile(lambda x: torch.relu(x) * 2, backend=backend)(torch.randn(8))  # start-up, not charged
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   num_hidden_layers=layers, use_cache=False)).eval()
        ids = torch.randint(0, 512, (2, 16))
        expected = model(ids).logits
        egc.last_compiled(clear=True)
        start = time.perf_counter()
        got = torch.compile(model, backend=backend)(ids).logits
        seconds = time.perf_counter() - start
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    parts: dict = {}
    for compiled in egc.last_compiled():
        for k, v in compiled.levels.timings.items():
            parts[k] = parts.get(k, 0.0) + v
    print(json.dumps({"layers": layers, "compiler": compiler, "seconds": seconds, "parts": parts}))


def scaling(counts: list[int]) -> None:
    import json
    import subprocess
    import sys
    from egraph_compiler.cache import cache_dir
    profile_for("cpu")  # calibrated here once
    calibrated = cache_dir() / "profiles.json"
    rows = []
    for layers in counts:
        row = {}
        for compiler in ("inductor", "ours"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench_inductor_"),
                       EGC_CACHE_DIR=tempfile.mkdtemp(prefix="bench_egc_"))
            if calibrated.exists():  # the calibration is a one-time cost: measured once, copied in
                shutil.copy(calibrated, Path(env["EGC_CACHE_DIR"]) / calibrated.name)
            out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--once", str(layers), compiler],
                                 env=env, capture_output=True, text=True, check=True).stdout
            row[compiler] = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        ours, ind = row["ours"], row["inductor"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ours["parts"].items())
        print(f"{layers} layers: inductor {ind['seconds']:.2f}s, ours {ours['seconds']:.2f}s "
              f"(ours/inductor {ours['seconds'] / ind['seconds']:.2f}; ours' parts: {parts})", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--scaling", help="LLaMA layer counts, e.g. 2,8,32 (cold compiles, fresh processes)")
    parser.add_argument("--once", nargs=2, metavar=("LAYERS", "COMPILER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.once:
        return llama_once(int(args.once[0]), args.once[1])
    if args.scaling:
        return scaling([int(n) for n in args.scaling.split(",")])
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
