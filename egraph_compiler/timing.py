"""Per-step timing of a compiled program inside its own wrapper: the measured side of
`benchmarks/cost_fidelity.py` and of `Compiled.report(measure=...)`."""
from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def kernel_times(executable, args, reps: int = 5, inner: int = 5) -> dict[str, float]:
    """Median seconds of each wrapper step (a kernel's name; a horizontal group
    under its first kernel's) over `reps` runs: what `benchmarks/cost_fidelity.py`
    sets beside the plan's estimates.  In each run a step is called once for
    the result the run goes on with, then `inner` more times back to back,
    timed as one block with the device synchronised around it: a kernel's
    steady-state time, as it runs inside a program (its output buffer already
    touched, its launch overlapped by the previous call's), not one call's
    latency.  A collective is called once (other processes call it once too).
    A step whose first call left values in the run's memo (training's fused
    attention: one call gives the output and its logsumexp, or dq, dk and dv)
    is timed with the memo as it was before each repeat, so the repeats do the
    call again rather than read its result (they read as ~4 us a call that takes ms)."""
    times: dict[str, list[float]] = {}
    sync = torch.cuda.synchronize if executable.target.device == "cuda" else (lambda: None)
    once = {k.name for k in executable.plan.kernels if k.output.group == "collective"}

    def timed(step, fn):
        def run(*a):
            memo = executable.steps.memo
            before = dict(memo)
            sync()
            start = time.perf_counter()
            out = fn(*a)
            calls = 1 if step in once else inner
            if calls > 1:
                after = dict(memo) if len(memo) != len(before) else None
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    if after is not None:  # (the step's own values forgotten: it computes them again)
                        memo.clear()
                        memo.update(before)
                    fn(*a)
                if after is not None:
                    memo.clear()
                    memo.update(after)
            sync()
            times.setdefault(step, []).append((time.perf_counter() - start) / calls)
            return out
        return run
    steps = {k.name for k in executable.plan.kernels}  # (not the wrapper's buffers or operands' views)
    names = {n: timed(n[1:], f) if n[1:] in steps else f for n, f in executable.wrapper.names.items()}
    run = executable._runner(names)
    for _ in range(reps + 1):  # the first run warms caches and is dropped
        run(executable._bind(args))
    return {step: statistics.median(t[1:]) for step, t in times.items()}
