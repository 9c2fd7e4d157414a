"""Launch configurations for Triton kernels, tuned: a small search space per
kernel kind (block sizes and warps), timed at a kernel's first launch on the
GPU, the fastest kept on disk by the kernel's source and the device, so that a
second compile of the same kernel launches the kept one without timing again.

A configuration never changes a kernel's source, only its constexpr block sizes,
its warps and so its grid; every candidate computes the same values
(tests/test_triton_tune.py runs each under the interpreter against eager).
Persistent row kernels keep their whole row in one block (RBLOCK is the row's
power of two in every candidate); split column sums are not tuned.  What the
heuristic in `triton._Kernel` picks is always the first candidate: the one used
where tuning is off (the default: `autotune=True` or `mode="max-autotune"` asks
for it, `EGC_AUTOTUNE=1|0` overrides both ways; a launch while a CUDA graph
records) and the one a record on disk must be one of the others to replace (a
record naming anything else is ignored).  Off by default because it costs
compile time for little (BENCHMARKS.md, ninth session: 0-5% per kernel on an H200
for up to 2.3 s more of a cold compile).

Timing runs the real launch on the call's own tensors, so it is only done for a
kernel that writes no tensor it reads (an aliasing call is launched untuned):
every candidate writes the same outputs, and the chosen one runs last.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

from egraph_compiler.cache import read_record, write_record

from .triton import _pow2

AUTOTUNE_ENV = "EGC_AUTOTUNE"  # "0": the heuristic's configuration only; "1": tune under the interpreter too
VERSION = 1  # of the search space: records of another version are not read
TARGET_MS = 0.5  # launches per timed round: about this long (at least MIN_LAUNCHES)
MIN_LAUNCHES, MAX_LAUNCHES, ROUNDS = 3, 100, 3
MIN_ELEMENTS = 1 << 17  # a smaller kernel is launch-bound whatever its blocks: the heuristic's only


@dataclass(frozen=True)
class Config:
    xblock: int
    rblock: int
    warps: int


def default(shape) -> Config:
    return Config(shape.xblock, shape.rblock, shape.warps)


def configured(shape, config: Config):
    """The kernel's launch shape (triton._Kernel) with this configuration."""
    tuned = copy.copy(shape)
    tuned.xblock, tuned.rblock, tuned.warps = config.xblock, config.rblock, config.warps
    return tuned


def candidates(shape) -> list[Config]:
    """The configurations tried for a kernel, the heuristic's first, without repeats."""
    first, k = default(shape), shape.k
    found = [first]
    if shape.split > 1 or k.outer * k.inner < MIN_ELEMENTS:
        return found
    outer = _pow2(k.outer)
    if shape.pointwise:
        rows_block = lambda total: max(1, min(total // min(_pow2(k.inner), total), outer))  # noqa: E731
        found += [Config(rows_block(total), min(_pow2(k.inner), total), warps)
                  for total, warps in ((2048, 4), (4096, 8))]
    elif shape.looped:
        found += [Config(1, rblock, warps) for rblock, warps in ((4096, 8), (4096, 16), (8192, 16))]
    else:  # persistent: the whole row in one block, more or fewer rows per program and warps
        cap = max(1, min(outer, 64))
        x, w = first.xblock, first.warps
        found += [Config(x, first.rblock, warps) for warps in (w // 2, w * 2) if 1 <= warps <= 32]
        found += [Config(rows, first.rblock, w) for rows in (x // 2, x * 2) if 1 <= rows <= cap
                  and rows * first.rblock <= 16384]
        if first.rblock >= 8192:
            found.append(Config(x, first.rblock, 32))
    unique = []
    for c in found:
        if c not in unique:
            unique.append(c)
    return unique


def enabled(requested: bool = False) -> bool:
    """Whether kernels are tuned: the compile option `autotune` (mode="max-autotune"), unless
    EGC_AUTOTUNE says otherwise ("1": always, "0": never)."""
    setting = os.environ.get(AUTOTUNE_ENV, "")
    return setting == "1" if setting in ("0", "1") else bool(requested)


def record_key(source: str, device_name: str) -> str:
    import triton
    text = json.dumps([VERSION, source, device_name, triton.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def to_compile(shape, tune: bool) -> list:
    """The launch shapes a kernel's first launch may use: every candidate where it is tuned."""
    return [configured(shape, c) for c in candidates(shape)] if tune else [shape]


def recorded(key: str, options: list[Config]) -> Config | None:
    """The configuration kept for this kernel, if it is one of its candidates."""
    data = read_record("triton_tuning", key)
    try:
        config = Config(int(data["xblock"]), int(data["rblock"]), int(data["warps"]))
    except (KeyError, TypeError, ValueError):
        return None
    return config if config in options else None


def keep(key: str, config: Config, times: dict) -> None:
    write_record("triton_tuning", key, {**asdict(config), "times_ms": times})


class Tuned:
    """A kernel's launch that settles its configuration at the first call: the one kept on
    disk, else the fastest candidate timed on that call's tensors.  `make(config)` builds
    a launch `run(tensors, extra)` for one configuration."""

    def __init__(self, make, shape, source: str):
        self.make = make
        self.outputs = [i for i, p in enumerate(shape.k.params) if p.role == "out"]  # (positions in a call)
        self.options = candidates(shape)
        self.source = source
        self.run = None
        self.config: Config | None = None
        self.times: dict[str, float] = {}
        self._untuned = None

    def describe(self) -> dict | None:
        """{"config": its label, "times_ms": each candidate's}, None before the first launch."""
        return None if self.config is None else {"config": _label(self.config), "times_ms": dict(self.times)}

    def __call__(self, tensors, extra):
        if self.run is None:
            self._settle(tensors, extra)
            if self.run is None:  # (while a CUDA graph records: the heuristic's now, tuned at a later call)
                if self._untuned is None:
                    self._untuned = self.make(self.options[0])
                return self._untuned(tensors, extra)
        return self.run(tensors, extra)

    def _settle(self, tensors, extra) -> None:
        import torch
        if len(self.options) == 1:
            self.config, self.run = self.options[0], self.make(self.options[0])
            return
        device = tensors[0].device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
        key = record_key(self.source, name)
        kept = recorded(key, self.options)
        if kept is not None:
            self.config, self.run = kept, self.make(kept)
            return
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if _aliased(tensors, self.outputs):  # (timing would launch it on what it wrote: the heuristic's, for good)
            self.config, self.run = self.options[0], self.make(self.options[0])
            return
        runs = {c: self.make(c) for c in self.options}
        for config, run in runs.items():
            try:
                self.times[_label(config)] = _time(run, tensors, extra, device)
            except Exception:  # (a candidate the GPU cannot launch: out of registers or shared memory)
                if config == self.options[0]:
                    raise
                self.times[_label(config)] = float("inf")
        best = min(runs, key=lambda c: self.times[_label(c)])
        runs[best](tensors, extra)  # (its outputs are the call's)
        keep(key, best, self.times)
        self.config, self.run = best, runs[best]


def _aliased(tensors, outputs: list[int]) -> bool:
    """Whether an output shares storage with another tensor of the call (inputs may share)."""
    storage = [t.untyped_storage().data_ptr() if t.numel() else None for t in tensors]
    written = [storage[i] for i in outputs if storage[i] is not None]
    read = {s for i, s in enumerate(storage) if i not in outputs and s is not None}
    return len(set(written)) < len(written) or bool(read.intersection(written))


def _label(config: Config) -> str:
    return f"x{config.xblock}_r{config.rblock}_w{config.warps}"


def _time(run, tensors, extra, device) -> float:
    """Milliseconds per launch: the least over ROUNDS rounds of back-to-back launches."""
    import torch
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    run(tensors, extra)  # (compiles it)
    sync()
    start = time.perf_counter()
    run(tensors, extra)
    sync()
    once_ms = (time.perf_counter() - start) * 1e3
    launches = max(MIN_LAUNCHES, min(MAX_LAUNCHES, int(TARGET_MS / max(once_ms, 1e-3))))
    best = float("inf")
    for _ in range(ROUNDS):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(launches):
                run(tensors, extra)
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / launches)
        else:
            start = time.perf_counter()
            for _ in range(launches):
                run(tensors, extra)
            best = min(best, (time.perf_counter() - start) * 1e3 / launches)
    return best

