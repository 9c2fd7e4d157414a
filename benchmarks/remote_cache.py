"""The shared compile cache: what a second machine saves.

    python -m benchmarks.remote_cache [--size test] [--workloads a,b,...]

Starts a redis-server on localhost (Debian's `redis-server`), then compiles the
workloads (and a small GPT-2 through torch.compile when transformers is there)
in three fresh processes, each with an empty local cache:
  A  "machine A": the shared cache empty (cold: builds and stores);
  B  "machine B": the shared cache filled by A (fetches);
  C  no shared cache (cold, the baseline for B).
Prints per process the compile seconds (egc.compile until the program runs,
first call included) and the C++ builds, and B's saving against C.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WORKLOADS = "ln_relu,softmax,mlp_gelu,attention,rmsnorm_swiglu,gpt_block,algebra"


def child(size: str, names: list[str]) -> None:
    import torch

    import egraph_compiler as egc
    from egraph_compiler import cache, remote, workloads
    seconds = {}
    for name in names:
        fn, inputs = workloads.make(name, size)
        start = time.perf_counter()
        compiled = egc.compile(fn, inputs, unsafe=name == "algebra")
        compiled(*inputs)
        seconds[name] = time.perf_counter() - start
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).eval()
        ids = torch.randint(0, 128, (2, 16))
        start = time.perf_counter()
        with torch.no_grad():
            torch.compile(model, backend="egraph")(ids)
        seconds["gpt2 (torch.compile)"] = time.perf_counter() - start
    except ImportError:
        pass
    print(json.dumps({"seconds": seconds, "builds": cache.builds, "hits": remote.stats.hits,
                      "stores": remote.stats.stores}))


def _run(size: str, names: str, url: str | None) -> dict:
    env = dict(os.environ, EGC_CACHE_DIR=tempfile.mkdtemp(prefix="egc-bench-"), EGC_PROFILE="cpu-default")
    env.pop("EGC_REMOTE_CACHE", None)
    if url:
        env["EGC_REMOTE_CACHE"] = url
    out = subprocess.run([sys.executable, "-m", "benchmarks.remote_cache", "--child", "--size", size,
                          "--workloads", names], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="test", choices=["test", "cpu", "gpu"])
    p.add_argument("--workloads", default=WORKLOADS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.size, args.workloads.split(","))
        return 0
    from tests.redis_server import redis_server
    with redis_server() as url:
        runs = {"A (shared cache empty)": _run(args.size, args.workloads, url),
                "B (shared cache filled by A)": _run(args.size, args.workloads, url),
                "C (no shared cache)": _run(args.size, args.workloads, None)}
    names = list(next(iter(runs.values()))["seconds"])
    print("| process | " + " | ".join(names) + " | total s | C++ builds | fetched |")
    print("|---|" + "---|" * (len(names) + 3))
    for label, r in runs.items():
        cells = " | ".join(f"{r['seconds'][n]:.2f}" for n in names)
        print(f"| {label} | {cells} | {sum(r['seconds'].values()):.2f} | {r['builds']} | {r['hits']} |")
    b, c = runs["B (shared cache filled by A)"], runs["C (no shared cache)"]
    saved = sum(c["seconds"].values()) - sum(b["seconds"].values())
    print(f"\nB against C: {saved:.2f} s saved of {sum(c['seconds'].values()):.2f} s "
          f"({saved / sum(c['seconds'].values()):.0%}); B ran {b['builds']} C++ builds, C ran {c['builds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
