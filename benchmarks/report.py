"""Output of the benchmark harness: the markdown table, the list of problems,
and the source revision that was measured."""
from __future__ import annotations

import datetime
import math
import os
import platform
import sys

import torch

import egraph_compiler as egc

def geomean(values):
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def cell_ms(row, v) -> str:
    if v in row["ms"]:
        return f"{row['ms'][v]:.3f}"
    status = row["status"].get(v, "")
    if status.startswith("n/a"):
        return "n/a"
    if status.startswith("mismatch"):
        return "FAILED check"
    return "ERROR" if status else "-"


def fmt_x(x) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def fmt_s(x) -> str:
    return f"{x:.1f}" if x is not None else "-"


def kernels_cell(row) -> str:
    if "kernels" not in row:
        return "n/a" if row["status"].get("ours", "").startswith("n/a") else "-"
    kinds = row["kernel_kinds"]
    short = {"generated": "gen", "library": "lib", "aten": "aten"}
    detail = ", ".join(f"{n} {short.get(k, k)}" for k, n in sorted(kinds.items()))
    return f"{row['kernels']}" + (f" ({detail})" if detail else "")


def markdown_table(rows, max_foreign_load: float = 0.1) -> str:
    autotuned = any("inductor_max" in row["compile_s"] for row in rows)
    head = ("| workload | eager ms | inductor ms | " + ("inductor max-autotune ms | " if autotuned else "")
            + "ours ms | ours/inductor speedup | ours/eager speedup | ours kernels | compile s (inductor, "
            + ("max-autotune, " if autotuned else "") + "ours) |")
    lines = [head, "|" + "---|" * (9 if autotuned else 8)]
    for row in rows:
        compiles = ["inductor"] + (["inductor_max"] if autotuned else []) + ["ours"]
        comp = ", ".join(fmt_s(row["compile_s"].get(v)) for v in compiles)
        lines.append(f"| {row['workload']} | {cell_ms(row, 'eager')} | {cell_ms(row, 'inductor')} | "
                     + (f"{cell_ms(row, 'inductor_max')} | " if autotuned else "")
                     + f"{cell_ms(row, 'ours')} | {fmt_x(row.get('speedup_vs_inductor'))} | "
                     f"{fmt_x(row.get('speedup_vs_eager'))} | {kernels_cell(row)} | {comp} |")
    faulted = [f"{r['workload']} ({', '.join(f'{v} {n:.0f}' for v, n in r['faults_per_call'].items())})"
               for r in rows if any(n >= 1 for n in r.get("faults_per_call", {}).values())]
    gi = geomean([r.get("speedup_vs_inductor") for r in rows])
    ge = geomean([r.get("speedup_vs_eager") for r in rows])
    n = sum(1 for r in rows if r.get("speedup_vs_inductor"))
    lines.append(f"| **geomean** | | | {'| ' if autotuned else ''}| **{fmt_x(gi)}** | **{fmt_x(ge)}** | | |")
    lines.append("")
    noisy = [f"{r['workload']} ({100 * r['foreign_load']:.0f}%)" for r in rows
             if r.get("foreign_load") is not None and r["foreign_load"] > max_foreign_load]
    if noisy:
        lines.append("WARNING: other processes took a noticeable share of the CPUs while timing: "
                     + ", ".join(noisy) + "; treat those rows as noisy.")
        lines.append("")
    if faulted:
        lines.append("Page faults per call (median; a fresh output's pages faulted in again, which depends on the "
                     "heap the other variants leave): " + "; ".join(faulted) + ".")
        lines.append("")
    lines.append(f"speedup = baseline ms / ours ms (>1: ours faster; against the better of Inductor's default "
                 f"and max-autotune where both ran); geometric mean over the {n} workload(s) where both times exist.")
    return "\n".join(lines)


def problems(rows) -> list[str]:
    out, not_available = [], []
    for row in rows:
        for v, status in row["status"].items():
            if status.startswith("n/a"):
                not_available.append(row["workload"])
                reason = status
            elif status != "ok":
                out.append(f"{row['workload']} / {v}: {status}")
    if not_available:
        out.insert(0, f"ours: {reason} -- {', '.join(not_available)}")
    return out


def source_revision() -> dict:
    """Where egraph_compiler was imported from, and its git commit if it is a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(egc.__file__)))
    info = {"egraph_compiler": os.path.dirname(os.path.abspath(egc.__file__)), "git_commit": None}
    try:
        import subprocess
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            info["git_commit"] = head.stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True)
            info["git_dirty"] = bool(dirty.stdout.strip())
    except OSError:
        pass
    return info


def environment(args) -> dict:
    env = {
        **source_revision(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "size": args.size,
        "reps": args.reps,
        "warmup": args.warmup,
        "block_ms": args.block_ms,
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.run", *sys.argv[1:]]),
    }
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


