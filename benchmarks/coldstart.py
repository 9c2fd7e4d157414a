"""Cold start of training through backend="egraph": the first forward+backward step
(compiles included) and the second, with fresh Triton and egc caches.

    EGC_COMPILE_WORKERS=0|8 python -m benchmarks.coldstart MODEL [--size gpu] [--device cuda] [--dtype bfloat16]

Prints both times and, per compiled graph, its kernels and stage timings.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--size", default="gpu")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # before triton reads it
    os.environ["EGC_CACHE_DIR"] = tempfile.mkdtemp()
    import torch

    import egraph_compiler as egc
    from benchmarks.models import SIZES, make
    from benchmarks.timing import sync
    from benchmarks.training import _loss, _no_dropout
    model, inputs = make(args.model, SIZES[args.size], args.device, getattr(torch, args.dtype))
    model.train()
    _no_dropout(model)
    compiled = torch.compile(model, backend="egraph")
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        _loss(compiled, inputs).backward()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    print(f"{args.model} workers={os.environ.get('EGC_COMPILE_WORKERS', '8')}: first step {times[0]:.1f} s, "
          f"second {1e3 * times[1]:.1f} ms")
    for c in egc.last_compiled():
        print(f"  {len(c.plan.kernels)} kernels", {k: round(v, 2) for k, v in c.levels.timings.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
