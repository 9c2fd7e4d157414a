"""What the real-model benchmarks share: their command line, the interleaved
timing rounds, and the loop over models that prints one table.

`benchmarks.models` (inference) and `benchmarks.training` (training steps) each
supply a `bench_model(name, args) -> row` and a `markdown(rows)`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def model_parser(doc: str, models: str, reps: int) -> argparse.ArgumentParser:
    """The options both model benchmarks take (each may add its own)."""
    from benchmarks.models import SIZES
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--models", default=models)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--json", default=None)
    parser.add_argument("--mode", default=None, help='torch.compile mode for both (e.g. "reduce-overhead": CUDA graphs)')
    return parser


def workload_parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The options the per-workload cost benchmarks take (cost_fidelity, regret)."""
    from egraph_compiler import workloads
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size", default="cpu", choices=["test", "cpu", "gpu"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--profile", default=None, help="device profile (default: the target's)")
    parser.add_argument("--workloads", default=",".join(workloads.NAMES))
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--json", default=None)
    return parser


def interleaved(measure, variants: list[str], reps: int) -> dict[str, float]:
    """Median of `measure(variant)` (ms) over `reps` rounds; each round runs every
    variant once, starting from a different one (no variant always goes first)."""
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(reps):
        shift = r % max(len(variants), 1)
        for v in variants[shift:] + variants[:shift]:
            rounds[v].append(measure(v))
    return {v: statistics.median(t) for v, t in rounds.items() if t}


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def run_models(tag: str, args, bench_model, markdown, title: str) -> int:
    """Bench each of `args.models`, print the table under `title`, write the JSON;
    exit status 0 only when every variant of every model ran and matched eager."""
    from benchmarks.models import MODELS
    rows = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"{tag}: unknown model {name!r} (known: {', '.join(MODELS)})")
        print(f"[{tag}] {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args))
        print(f"[{tag}] {name}: {rows[-1]['status']} {rows[-1]['ms']}", file=sys.stderr, flush=True)
    print(f"\n## {title}, {args.size} size, {args.device}, {args.dtype} (torch {torch.__version__})\n")
    print(markdown(rows))
    if args.json:
        write_json(args.json, rows)
    return 0 if all(v == "ok" for r in rows for v in r["status"].values()) else 1
