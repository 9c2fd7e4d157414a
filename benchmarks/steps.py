"""Where a real model's compiled programs spend their time, step by step.

    python -m benchmarks.steps [--models llama_gqa] [--size cpu] [--device cpu] [--dtype float32]
                               [--train] [--reps 7] [--top 12] [--json PATH]
    python -m benchmarks.steps --workloads gpt_block [--size cpu] ...

With `--workloads` (names from `egraph_compiler.workloads`, instead of models), each anchor
workload is compiled by `egc.compile` and its one program measured the same way, with
Inductor's whole call (`torch.compile`, default mode) timed beside it in the same process.

The model runs through `torch.compile(backend="egraph")` (with `--train`, a training step:
forward, loss, backward, so a forward and a backward program).  Each program is then called
again on the arguments its last run got: the whole call's time (median of `--reps` calls),
and each step's (a kernel, a library call) time alone (5 back-to-back calls: warm caches,
touched buffers) and in sequence (one call, in the program's order: what a run pays), beside
the plan's estimate (`timing.kernel_times`).  The whole call minus its steps in sequence is
host time (the wrapper, buffers, the call's own checks); in sequence minus alone is what the
program's order costs its steps (caches, page faults of fresh buffers, threads waking).
On a 16-core Xeon a LLaMA training step's backward read 6.75 ms alone and 8.65 in sequence
(BENCHMARKS.md, forty-second session).
"""
from __future__ import annotations

import contextlib
import statistics
import sys

import torch

import egraph_compiler as egc
from benchmarks.common import model_parser, write_json
from benchmarks.models import MODELS, SIZES, make
from benchmarks.timing import time_block
from benchmarks.training import _loss, _no_dropout
from egraph_compiler import runtime, workloads
from egraph_compiler.timing import kernel_times


@contextlib.contextmanager
def _arguments_recorded(seen: dict):
    """Each program's arguments of its last call, by program (id of its executable)."""
    call = runtime.Executable.__call__

    def recording(self, *args):
        seen[id(self)] = args
        return call(self, *args)
    runtime.Executable.__call__ = recording
    try:
        yield
    finally:
        runtime.Executable.__call__ = call


def program_steps(executable, args, reps: int) -> dict:
    """One program: its whole call's seconds and, per step, (kind, op, shape, estimate, alone, in sequence)."""
    device = executable.target.device
    alone = kernel_times(executable, args, reps=reps, inner=5)
    in_sequence = kernel_times(executable, args, reps=reps, inner=1)
    call = _median_call(executable, args, device, reps, warm=1)
    estimate: dict[str, float] = {}
    first: dict[str, object] = {}
    for k in executable.plan.kernels:  # (a horizontal group is one step: its kernels' estimates summed)
        step = k.loop_nest or k.name
        estimate[step] = estimate.get(step, 0.0) + k.seconds
        first.setdefault(step, k)
    steps = {step: {"kind": k.kind, "op": k.output.op, "shape": list(k.output.shape),
                    "estimated_us": estimate[step] * 1e6, "alone_us": alone.get(step, 0.0) * 1e6,
                    "in_sequence_us": in_sequence.get(step, 0.0) * 1e6} for step, k in first.items()}
    return {"call_us": call * 1e6, "estimated_us": executable.plan.cost * 1e6,
            "steps": steps}


def bench_model(name: str, args) -> list[dict]:
    device, dtype = args.device, getattr(torch, args.dtype)
    model, inputs = make(name, SIZES[args.size], device, dtype)
    model.train() if args.train else model.eval()
    _no_dropout(model)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled, seen = torch.compile(model, backend="egraph"), {}
    with _arguments_recorded(seen):
        for _ in range(2):
            if args.train:
                model.zero_grad(set_to_none=True)
                _loss(compiled, inputs).backward()
            else:
                with torch.no_grad():
                    compiled(*inputs)
    programs = []
    for i, c in enumerate(egc.last_compiled()):
        executable = c._executable
        if id(executable) in seen:
            row = program_steps(executable, seen[id(executable)], args.reps)
            programs.append({"model": name, "program": i, **row})
    torch._dynamo.reset()
    return programs


def bench_workload(name: str, args) -> list[dict]:
    """One anchor workload's program, with Inductor's whole call beside it."""
    fn, inputs = workloads.make(name, args.size, dtype=getattr(torch, args.dtype), device=args.device)
    compiled, seen = egc.compile(fn, inputs), {}
    with _arguments_recorded(seen):
        compiled(*inputs)
    row = program_steps(compiled._executable, seen[id(compiled._executable)], args.reps)
    torch._dynamo.reset()
    inductor = _median_call(torch.compile(fn), inputs, args.device, args.reps, warm=3)
    torch._dynamo.reset()
    return [{"model": name, "program": 0, **row, "inductor_call_us": inductor * 1e6}]


def _median_call(fn, args, device: str, reps: int, warm: int) -> float:
    """Seconds of one whole call, the median of `reps` after `warm` untimed calls."""
    for _ in range(warm):
        fn(*args)
    return statistics.median(time_block(fn, args, 1, device) for _ in range(reps))


def markdown(programs: list[dict], top: int) -> str:
    lines = []
    for p in programs:
        steps = p["steps"].values()
        sums = {key: sum(s[key] for s in steps) for key in ("estimated_us", "alone_us", "in_sequence_us")}
        lines += [f"\n### {p['model']}, program {p['program']}: {len(p['steps'])} steps; whole call "
                  f"{p['call_us']:.1f} us, steps in sequence {sums['in_sequence_us']:.1f}, alone {sums['alone_us']:.1f}, "
                  f"estimated {sums['estimated_us']:.1f}"
                  + (f"; Inductor's whole call {p['inductor_call_us']:.1f} us" if "inductor_call_us" in p else "") + "\n",
                  "| step | kind | op | shape | estimated us | alone us | in sequence us |", "|---|---|---|---|---|---|---|"]
        ranked = sorted(p["steps"].items(), key=lambda kv: -kv[1]["in_sequence_us"])[:top]
        lines += [f"| {step} | {s['kind']} | {s['op']} | {s['shape']} | {s['estimated_us']:.1f} | {s['alone_us']:.1f} | "
                  f"{s['in_sequence_us']:.1f} |" for step, s in ranked]
    return "\n".join(lines)


def parser():
    options = model_parser(__doc__, "llama_gqa", reps=7)
    options.add_argument("--train", action="store_true", help="a training step's forward and backward programs")
    options.add_argument("--top", type=int, default=12, help="steps listed per program (by time in sequence)")
    options.add_argument("--workloads", default="", help="anchor workloads instead of models (e.g. gpt_block)")
    return options


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    programs = []
    for name in filter(None, args.workloads.split(",")):
        if name not in workloads.NAMES:
            raise SystemExit(f"steps: unknown workload {name!r} (known: {', '.join(workloads.NAMES)})")
        programs += bench_workload(name, args)
    for name in ([] if args.workloads else args.models.split(",")):
        if name not in MODELS:
            raise SystemExit(f"steps: unknown model {name!r} (known: {', '.join(MODELS)})")
        programs += bench_model(name, args)
    print(f"## Steps of the compiled programs, {args.size} size, {args.device}, {args.dtype}, "
          f"{'training' if args.train else 'inference'} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(markdown(programs, args.top))
    if args.json:
        write_json(args.json, programs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
