"""Cost-model fidelity: every kernel's estimated time beside its measured time.

    python -m benchmarks.cost_fidelity [--size test|cpu|gpu] [--device cpu|cuda]
                                       [--dtype float32|bfloat16] [--profile NAME]
                                       [--workloads a,b] [--reps N] [--json PATH]

Each of the seven workloads is compiled; each kernel of its plan (a horizontal
group counts as one: its kernels' estimates are summed) is timed alone inside a
normal run of the program (`Executable.kernel_times`: the device synchronised
around each step, median of `--reps` runs).  Reported per kernel: estimated and
measured microseconds and their ratio; overall: Spearman's rank correlation of
estimate against measurement and the median absolute log error (as a factor),
the two numbers issue 10 sets targets for (>= 0.9 and <= 25%).
"""
from __future__ import annotations

import json
import math
import statistics
import sys

import numpy as np
import torch

import egraph_compiler as egc
from benchmarks.common import workload_parser
from egraph_compiler import workloads


def fidelity(rows: list[dict]) -> dict:
    """Spearman's rho (Pearson's r of the ranks, ties averaged) and the median
    absolute log error, as exp(median |ln(est / measured)|) - 1."""
    est = np.array([r["estimated_us"] for r in rows])
    got = np.array([r["measured_us"] for r in rows])

    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):  # ties share their mean rank
            r[x == value] = r[x == value].mean()
        return r
    rho = float(np.corrcoef(ranks(est), ranks(got))[0, 1]) if len(rows) > 2 else float("nan")
    err = statistics.median(abs(math.log(max(e, 1e-3) / max(g, 1e-3))) for e, g in zip(est, got))
    return {"kernels": len(rows), "spearman": rho, "median_abs_log_error": math.exp(err) - 1}


def measure(name: str, args) -> list[dict]:
    fn, inputs = workloads.make(name, size=args.size, dtype=getattr(torch, args.dtype), device=args.device)
    compiled = egc.compile(fn, inputs, profile=args.profile)
    times = compiled._executable.kernel_times(*inputs, reps=args.reps)
    estimate: dict[str, float] = {}
    members: dict[str, list] = {}
    for k in compiled.plan.kernels:
        step = k.loop_nest or k.name
        estimate[step] = estimate.get(step, 0.0) + k.seconds
        members.setdefault(step, []).append(k)
    rows = []
    for step, seconds in times.items():
        ks = members[step]
        rows.append({"workload": name, "kernel": step, "kind": ks[0].kind,
                     "ops": "+".join(n.op for k in ks for n in k.ops if n.group not in ("layout", "boundary")),
                     "estimated_us": estimate[step] * 1e6, "measured_us": seconds * 1e6})
    return rows


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["| workload | kernel | kind | ops | estimated us | measured us | estimated / measured |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['kernel']} | {r['kind']} | {r['ops'][:60]} | {r['estimated_us']:.1f} | "
                     f"{r['measured_us']:.1f} | {r['estimated_us'] / max(r['measured_us'], 1e-9):.2f} |")
    lines.append("")
    lines.append(f"{summary['kernels']} kernels: Spearman rho {summary['spearman']:.2f}, median absolute log "
                 f"error {100 * summary['median_abs_log_error']:.0f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = workload_parser(__doc__, reps=7).parse_args(argv)
    rows = []
    for name in args.workloads.split(","):
        print(f"[fidelity] {name} ...", file=sys.stderr, flush=True)
        rows += measure(name, args)
    summary = fidelity(rows)
    print(f"\n## cost fidelity, {args.size} size, {args.device}, {args.dtype}, profile {args.profile or 'default'} "
          f"(torch {torch.__version__})\n")
    print(markdown(rows, summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
