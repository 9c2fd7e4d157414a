"""Timing for the benchmarks: a block of calls timed (CUDA events on a GPU), this process's page
faults, and the machine's load from other processes (a benchmark waits for quiet before timing)."""
from __future__ import annotations

import os
import resource
import sys
import time

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def minor_faults() -> int:
    """This process's minor page faults so far: a call whose fresh output's pages fault in again
    pays for it in its time (where that happens depends on the heap other variants leave)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_block(fn, args, inner: int, device: str) -> float:
    """Seconds per call, averaged over one block of `inner` calls."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(inner):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn(*args)
    return (time.perf_counter() - t0) / inner


# --------------------------------------------------------------------------- machine noise

def _proc_stat_busy() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Fraction of the machine's CPU capacity used by OTHER processes between
    construction and `fraction()` (machine busy time minus this process's)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _proc_stat_busy(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def fraction(self) -> float | None:
        busy = _proc_stat_busy()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        foreign = (busy - self.busy0) - (self._own() - self.own0)
        return max(0.0, foreign) / (wall * (os.cpu_count() or 1))


def wait_quiet(args) -> float:
    """Wait (at most --quiet-timeout s) until other processes use at most
    --max-foreign-load of the CPUs over a 1 s sample.  Returns seconds waited."""
    t0 = time.perf_counter()
    warned = False
    while time.perf_counter() - t0 < args.quiet_timeout:
        meter = ForeignLoad()
        time.sleep(1.0)
        load = meter.fraction()
        if load is None or load <= args.max_foreign_load:
            break
        if not warned:
            print(f"[bench] machine busy ({100 * load:.0f}% of CPUs used by other processes); waiting "
                  f"up to {args.quiet_timeout:.0f}s for quiet", file=sys.stderr, flush=True)
            warned = True
    return time.perf_counter() - t0


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
