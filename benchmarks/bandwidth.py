"""Memory-bound row kernels against the copy bandwidth, by row length (GPU).

    python -m benchmarks.bandwidth [--mb 256] [--dtype bfloat16] [--rows 256,1024,4096,16384,32768]
                                   [--tuned] [--persistent-max N] [--loop-block N]

For each row length, a [N, L] input of `--mb` megabytes: softmax, rms_norm and
layer_norm+relu run as eager, Inductor (default mode) and egraph-compiler in
one process, on the same tensors, outputs checked against eager first.  Time:
median over `--reps` CUDA-event-timed blocks of back-to-back calls.  Achieved
bandwidth counts one read of the input and one write of the output (the
weights are negligible); `copy` is `y.copy_(x)` on the same tensors, timed the
same way, and each kernel's share of it is reported; `--tuned` also times ours
compiled with `autotune=True` (codegen/triton_tune.py: block sizes and warps timed
at the first launch) in the same process, with the configuration it chose.
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F

import egraph_compiler as egc
from benchmarks.timing import time_block

PROGRAMS = {
    "softmax": lambda x, w, b: torch.softmax(x, -1),
    "rms_norm": lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6),
    "ln_relu": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b).relu(),
}


def timed(fn, args, reps: int, inner: int = 10) -> float:
    """Median seconds per call over `reps` blocks of `inner` calls."""
    for _ in range(3):
        fn(*args)
    return statistics.median(time_block(fn, args, inner, "cuda") for _ in range(reps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="256,1024,4096,16384,32768")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tuned", action="store_true", help="also time ours with tuned launch configurations")
    p.add_argument("--persistent-max", type=int, default=None,
                   help="longest row the Triton renderer keeps in registers (default: its own)")
    p.add_argument("--loop-block", type=int, default=None,
                   help="chunk of a longer row that the renderer's loops take at a time (default: its own)")
    args = p.parse_args(argv)
    if args.persistent_max or args.loop_block:
        from egraph_compiler.codegen import triton as renderer
        renderer.PERSISTENT_MAX = args.persistent_max or renderer.PERSISTENT_MAX
        renderer.LOOP_BLOCK = args.loop_block or renderer.LOOP_BLOCK
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.mb} MB per tensor\n")
    print("| program | row | copy TB/s | eager TB/s | inductor TB/s | ours TB/s | ours % of copy | "
          "ours/inductor | ours tuned TB/s | ours kernels (tuned config) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in map(int, args.rows.split(",")):
        rows = args.mb * 2 ** 20 // (length * size)
        x = torch.randn(rows, length, device="cuda", dtype=dtype)
        w, b = torch.randn(length, device="cuda", dtype=dtype), torch.randn(length, device="cuda", dtype=dtype)
        moved = 2 * x.numel() * size
        y = torch.empty_like(x)
        copy = moved / timed(lambda: y.copy_(x), (), args.reps)
        for name, fn in PROGRAMS.items():
            ref = fn(x, w, b)
            row = {"eager": moved / timed(fn, (x, w, b), args.reps)}
            torch._dynamo.reset()
            inductor = torch.compile(fn)
            variants = [("inductor", inductor), ("ours", _compiled(fn, [x, w, b], tuned=False))]
            if args.tuned:
                variants.append(("tuned", _compiled(fn, [x, w, b], tuned=True)))
            for variant, f in variants:
                out = f(x, w, b)
                torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
                row[variant] = moved / timed(f, (x, w, b), args.reps)
            ours = variants[1][1]
            configs = variants[-1][1].launch_configs()
            kinds = ",".join(k.kind + (f" ({configs[k.name]['config']})" if configs.get(k.name) else "")
                             for k in ours.plan.kernels)
            tuned = f"{row['tuned'] / 1e12:.2f}" if args.tuned else "-"
            print(f"| {name} | {length} | {copy / 1e12:.2f} | {row['eager'] / 1e12:.2f} | "
                  f"{row['inductor'] / 1e12:.2f} | {row['ours'] / 1e12:.2f} | {100 * row['ours'] / copy:.0f}% | "
                  f"{row['ours'] / row['inductor']:.2f}x | {tuned} | {kinds} |", flush=True)
        del x, y, w, b
        torch.cuda.empty_cache()
    return 0


def _compiled(fn, inputs, tuned: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return egc.compile(fn, inputs, autotune=tuned)


if __name__ == "__main__":
    raise SystemExit(main())
