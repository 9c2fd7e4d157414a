"""A CPU linear through torch's GEMM (`addmm`/`mm` into the wrapper's buffer: MKL's sgemm in
torch's x86 builds), or, asked for, oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`,
in the same torch), alone or with an activation or a product in its epilogue (rules/onednn.rules).

`EGC_CPU_LINEAR` says which: `torch` (the default), `timed` (per shape, the faster of the two on
this machine), `onednn` (oneDNN's wherever it can run the linear).  Neither library wins
everywhere.  On a 2-core AMD EPYC (BENCHMARKS.md, thirty-fourth session) oneDNN took 0.69x torch's
time for a [1, 1024] x [1024, 1024] product and 0.78-0.93x for the [512, 256] x [256, 1024] class
of the real models' layers, but 1.2-2.9x below 16 MFLOP, where its fixed cost per call (~12 us)
dominates.  It is not the default because it cannot write a buffer of ours: its result is a fresh
tensor every call, and a program's fresh tensors fault their pages in again whenever glibc has
given the heap's top back (a SwiGLU MLP: 992 faults and 5.9 ms a call, against none and 4.6 ms
through torch's GEMM into reused buffers; in other heap states it was 5-10% ahead on GPT-2, BERT
and LLaMA).  A timing loop on its own never sees those faults.

`timed`: a float32 linear of at least `MIN_FLOPS` is timed both ways when a program holding it is
compiled, on random operands of its shape run as its step would run them (interleaved rounds,
the median per routine), and the faster routine is kept: in this process, and on disk by the
shape, the thread count, the core count and torch's version, so a later compile of the same shape
does not time again.  The wrapper then allocates a buffer for torch's GEMM only
(wrapper.into_buffer).  A smaller linear, one past `MAX_FLOPS` or `MAX_BYTES` (timing would cost
seconds of compile, or a second copy of a large weight), another dtype, an empty one, or a torch
without oneDNN runs torch's GEMM untimed.  Both libraries compute the same product (their sums
differ in rounding only, as eager's own kernels do between shapes).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time

import torch

from .cache import read_record, write_record

ROUTINE_ENV = "EGC_CPU_LINEAR"
RULES = "onednn"  # the rule group of linears with their epilogue in oneDNN's call (rules/onednn.rules)
MIN_FLOPS = 1 << 24  # below this, oneDNN's fixed cost per call outweighs what it saves: never timed
# above either, timing would cost seconds of compile or a second copy of a large weight: not timed
MAX_FLOPS, MAX_BYTES = 1 << 33, 1 << 29
VERSION = 1  # of the records on disk
ROUNDS, ROUND_SECONDS, MAX_CALLS = 5, 0.002, 20  # timing: rounds per routine, calls per round about this long
ROUTINES = ("torch", "onednn")
SETTINGS = ("torch", "timed", "onednn")


def setting() -> str:
    """EGC_CPU_LINEAR, checked: torch (unset), timed or onednn."""
    value = os.environ.get(ROUTINE_ENV, "") or "torch"
    if value not in SETTINGS:
        raise ValueError(f"{ROUTINE_ENV}={value!r}: expected one of {', '.join(SETTINGS)}")
    return value


def epilogues() -> bool:
    """Whether rules/onednn.rules are installed for a CPU target: oneDNN's linears asked for, and there."""
    return setting() != "torch" and onednn() is not None


@functools.cache
def onednn():
    """oneDNN's linear `(x, w, b) -> x w^T + b` where this torch has it and it gives F.linear's answer
    on a small case; None otherwise (a build without oneDNN, another architecture's)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None

    def linear(x, w, b=None):  # (a bias of stride 0, expanded from one value, was read as if dense:
        return op(x, w, b if b is None or b.is_contiguous() else b.contiguous(), "none", [], "")  # soak 34001)
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen) for shape in ((5, 7), (3, 7), (3,)))
        if not torch.allclose(linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5):
            return None
    except (RuntimeError, NotImplementedError):
        return None
    return linear


def choose(rows: int, k: int, n: int, bias: bool, transposed: bool, dtype: torch.dtype) -> str:
    """"torch" or "onednn": the routine of a linear of this shape (x [rows, k], weight [n, k] or,
    `transposed`, the transpose of a [k, n] matrix), settled once per shape and machine."""
    asked = setting()
    if asked == "torch" or dtype != torch.float32 or not (rows and k and n) or onednn() is None:
        return "torch"
    if asked == "onednn":
        return asked
    if not MIN_FLOPS <= 2 * rows * k * n <= MAX_FLOPS or 4 * (rows * k + k * n + rows * n) > MAX_BYTES:
        return "torch"
    key = _key(rows, k, n, bias, transposed)
    chosen = _kept.get(key) or _recorded(key)
    if chosen is None:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # (a compile inside the user's autocast)
            times = _timed(_candidates(rows, k, n, bias, transposed))
        chosen = min(times, key=times.get)
        _keep(key, chosen, times)
    _kept[key] = chosen
    return chosen


_kept: dict[str, str] = {}  # this process's picks: record key -> routine


def _candidates(rows: int, k: int, n: int, bias: bool, transposed: bool) -> dict:
    """Each routine on operands of the shape, run as a step runs it: torch's GEMM into a buffer
    of its own (the wrapper hands it a warm one), oneDNN's making its result."""
    x = torch.randn(rows, k)
    w = torch.randn(k, n).t() if transposed else torch.randn(n, k)
    b = torch.randn(n) if bias else None
    out, dnn = torch.empty(rows, n), onednn()
    if b is None:
        return {"torch": lambda: torch.mm(x, w.t(), out=out), "onednn": lambda: dnn(x, w)}
    return {"torch": lambda: torch.addmm(b, x, w.t(), out=out), "onednn": lambda: dnn(x, w, b)}


def _timed(runs: dict) -> dict[str, float]:
    """Median seconds per call of each routine, in interleaved rounds."""
    calls = {}
    for name, run in runs.items():
        run()  # (warm: oneDNN makes its primitive, the buffer is touched)
        start = time.perf_counter()
        run()
        calls[name] = max(1, min(MAX_CALLS, int(ROUND_SECONDS / max(time.perf_counter() - start, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                run()
            times[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


def _key(rows: int, k: int, n: int, bias: bool, transposed: bool) -> str:
    text = json.dumps([VERSION, os.cpu_count(), torch.get_num_threads(), torch.__version__,
                       rows, k, n, bias, transposed])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _recorded(key: str) -> str | None:
    chosen = (read_record("cpu_linear", key) or {}).get("routine")
    return chosen if chosen in ROUTINES else None


def _keep(key: str, chosen: str, times: dict) -> None:
    write_record("cpu_linear", key, {"routine": chosen, "times_us": {n: t * 1e6 for n, t in times.items()}})


def epilogue(op: str, bias: bool):
    """oneDNN's one call for a linear with its epilogue (ops.py's `linear_silu`, `linear_gelu_tanh`,
    `linear_mul`; rules/onednn.rules) over a step's arguments (x, w, b[, y]), `bias` where b is
    one; None where this torch has no oneDNN linear.  A bias or a factor not contiguous is made so
    first (one of stride 0 was read as dense, above)."""
    if onednn() is None:
        return None
    call = torch.ops.mkldnn._linear_pointwise

    def dense(t):
        return t if t.is_contiguous() else t.contiguous()
    if op == "linear_mul":
        binary = call.binary
        if bias:
            return lambda t: binary(t[0], dense(t[3]), t[1], dense(t[2]), "mul")
        return lambda t: binary(t[0], dense(t[3]), t[1], None, "mul")
    attr, algorithm = {"linear_silu": ("swish", ""), "linear_gelu_tanh": ("gelu", "tanh")}[op]
    if bias:
        return lambda t: call(t[0], t[1], dense(t[2]), attr, [], algorithm)
    return lambda t: call(t[0], t[1], None, attr, [], algorithm)
