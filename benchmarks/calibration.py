"""Reproducible calibration: do calibrations of this machine give the same plans?

    python -m benchmarks.calibration [--runs 3] [--size cpu] [--workloads a,b] [--json PATH]

Issue 10 asks that two calibrations on the same machine give the same plans for the
seven workloads.  This calibrates the CPU profile `--runs` times in a row (each a fresh
measurement, `calibrate.calibrate_cpu`: refused while the machine is busy, and then
tried again), compiles every workload with each profile, and compares the plans: the
kernels in order, each with its kind and the ops it computes.  Printed: each profile's
readings, and per workload whether every calibration gave the same plan (and, where not,
the kernel counts).  The cached calibration is left as the last run measured it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from egraph_compiler import calibrate, workloads
from egraph_compiler.api import compile as egc_compile

READINGS = ("bandwidth", "flops", "exp_cost", "tanh_cost", "trig_cost", "launch")


def plan_shape(profile, name: str, size: str) -> list[tuple[str, str]]:
    fn, inputs = workloads.make(name, size=size)
    compiled = egc_compile(fn, inputs, target="cpu", unsafe=name == "algebra", profile=profile)
    return [(k.kind, " -> ".join(n.op for n in k.ops)) for k in compiled.plan.kernels]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", default="cpu", choices=["test", "cpu"])
    parser.add_argument("--workloads", default=",".join(workloads.NAMES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    runs = []
    for run in range(args.runs):
        measured = None
        for _ in range(5):  # a busy moment refuses the reading: wait and measure again
            measured = calibrate.calibrate_cpu()
            if measured is not None:
                break
            time.sleep(2)
        if measured is None:
            print(f"calibration {run + 1}: refused five times (the machine is busy); stopping", file=sys.stderr)
            return 1
        readings = {k: getattr(measured, k) for k in READINGS if hasattr(measured, k)}
        print(f"calibration {run + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in readings.items()), flush=True)
        runs.append({"readings": readings, "plans": {n: plan_shape("cpu", n, args.size) for n in names}})
    print("\n| workload | same plan in every calibration | kernels per calibration |\n|---|---|---|")
    rows = []
    for n in names:
        shapes = [r["plans"][n] for r in runs]
        same = all(s == shapes[0] for s in shapes)
        rows.append({"workload": n, "same": same, "kernels": [len(s) for s in shapes]})
        print(f"| {n} | {'yes' if same else 'NO'} | {', '.join(str(len(s)) for s in shapes)} |")
    print(f"\n{sum(r['same'] for r in rows)} of {len(rows)} workloads planned alike by {len(runs)} calibrations")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": runs, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
