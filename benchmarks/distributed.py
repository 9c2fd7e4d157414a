"""Data-parallel training steps: eager vs Inductor vs egraph-compiler, under DDP and FSDP2.

    python -m benchmarks.distributed [--size test|cpu|gpu] [--device cpu|cuda] [--dtype float32|bfloat16]
                                     [--models gpt2,llama_gqa] [--wrappers ddp,fsdp2] [--steps N] [--json PATH]

Two processes (NCCL on two GPUs, gloo on the CPU), started here.  Per model and
wrapper, three copies of the same initial weights train side by side on the same
batches (each rank its own): eager, Inductor and ours (`backend="egraph"`);
DDP wraps the compiled model (`DDP(torch.compile(m))`), FSDP2 shards each block
and the root and then compiles (`torch.compile(fully_shard(m))`).  One step is
forward, loss, backward and an SGD update.  Reported: the median step time over
`--steps` steps after 3 warm-up steps (compiles included in those), and the
largest parameter difference from eager after all steps, relative to the largest
parameter (the compiled variants must track eager).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import write_json

WORLD = 2


def _blocks(model) -> list:
    inner = getattr(model, "transformer", None) or model.model
    return list(inner.h if hasattr(inner, "h") else inner.layers)


def _wrap(model, wrapper: str, compiler: str | None, device: str):
    from torch.nn.parallel import DistributedDataParallel as DDP
    if wrapper == "ddp":
        inner = model if compiler is None else torch.compile(model, backend=compiler)
        return DDP(inner, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device, (WORLD,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model if compiler is None else torch.compile(model, backend=compiler)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _rank(rank: int, init: str, args, results) -> None:
    import warnings
    warnings.simplefilter("ignore")
    from benchmarks.models import SIZES, make
    from benchmarks.training import _loss, _no_dropout
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init, rank=rank, world_size=WORLD)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        for name in args.models.split(","):
            base, inputs = make(name, SIZES[args.size], device, dtype)
            base.train()
            _no_dropout(base)
            for wrapper in args.wrappers.split(","):
                row = {"model": name, "wrapper": wrapper, "ms": {}, "diff": {}, "error": {}}
                models = {v: copy.deepcopy(base) for v in ("eager", "inductor", "ours")}
                fns = {v: _wrap(m, wrapper, {"eager": None, "inductor": "inductor", "ours": "egraph"}[v], device)
                       for v, m in models.items()}
                opts = {v: torch.optim.SGD(f.parameters(), lr=1e-3) for v, f in fns.items()}
                times = {v: [] for v in fns}
                g = torch.Generator().manual_seed(rank)
                for step in range(3 + args.steps):
                    ids = torch.randint(0, 512, inputs[0].shape, generator=g).to(device)
                    for v, f in fns.items():
                        if v in row["error"]:
                            continue
                        sync()
                        start = time.perf_counter()
                        try:
                            opts[v].zero_grad()
                            _loss(f, [ids]).backward()
                            opts[v].step()
                        except Exception as exc:  # reported in the table, not hidden
                            row["error"][v] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                            continue
                        sync()
                        if step >= 3:
                            times[v].append(time.perf_counter() - start)
                ref = [_full(p).float() for p in fns["eager"].parameters()]
                scale = max(r.abs().max().item() for r in ref)
                for v, f in fns.items():
                    if times[v]:
                        row["ms"][v] = 1e3 * statistics.median(times[v])
                    if v != "eager" and v not in row["error"]:
                        row["diff"][v] = max((_full(p).float() - r).abs().max().item()
                                             for p, r in zip(f.parameters(), ref)) / scale
                if rank == 0:
                    results.append(row)
                    print(json.dumps(row), flush=True)
                torch._dynamo.reset()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="test", choices=["test", "cpu", "gpu"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--models", default="gpt2,llama_gqa")
    p.add_argument("--wrappers", default="ddp,fsdp2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().list()
        mp.spawn(_rank, args=(f"file://{tmp}/rendezvous", args, results), nprocs=WORLD)
        rows = list(results)
    print(f"\n## {args.size} size, {args.device}, {args.dtype}, {WORLD} processes (torch {torch.__version__})\n")
    print("| model | wrapper | eager ms | inductor ms | ours ms | ours/inductor | ours/eager | "
          "param diff (inductor, ours) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        ratio = (lambda a: f"{ms[a] / ms['ours']:.2f}x" if a in ms and "ours" in ms else "-")
        cells = " | ".join(f"{ms[v]:.2f}" if v in ms else r["error"].get(v, "-") for v in ("eager", "inductor", "ours"))
        diffs = ", ".join(f"{r['diff'][v]:.1e}" if v in r["diff"] else "-" for v in ("inductor", "ours"))
        print(f"| {r['model']} | {r['wrapper']} | {cells} | {ratio('inductor')} | {ratio('eager')} | {diffs} |")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
