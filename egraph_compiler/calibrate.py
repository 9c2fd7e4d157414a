"""Device profiles for the cost model: the H200's measured ceilings, and this
CPU's, calibrated on first use by a short measurement and cached on disk.

The measurement (well under a second): copy bandwidth (a 64 MB copy), the
rate of vectorised exp on cache-resident data in the op table's FLOP units
(what generated loops reach), matmul FLOP rate (what the library reaches),
and the fixed cost of one kernel call.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from . import ops
from .cost import PROFILES, DeviceProfile
from .runtime import cache_dir

PROFILE_VERSION = 2


def _median_seconds(fn, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu() -> DeviceProfile:
    n = 1 << 24  # 64 MB of float32
    src, dst = torch.ones(n), torch.empty(n)
    bandwidth = 2 * 4 * n / _median_seconds(lambda: dst.copy_(src))
    # exp on a cache-resident buffer: compute-bound vector code, counted at the
    # op table's FLOPs per exp (the unit the cost model charges generated code in)
    small = torch.rand(1 << 18)
    work = torch.empty_like(small)
    flops = ops.get("exp").flops * small.numel() * 4 / _median_seconds(
        lambda: [torch.exp(small, out=work) for _ in range(4)])
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    library = 2 * 512 ** 3 / _median_seconds(lambda: torch.mm(a, b))
    one = torch.ones(1)
    launch = _median_seconds(lambda: [torch.add(one, one) for _ in range(100)]) / 100
    return DeviceProfile("cpu", bandwidth, flops, library, launch)


def cpu_profile() -> DeviceProfile:
    """This machine's profile, measured once and cached by machine and torch version."""
    key = f"cpu-v{PROFILE_VERSION}-{os.cpu_count()}-{torch.get_num_threads()}-{torch.__version__}"
    path = cache_dir() / "profiles.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_cpu().__dict__
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return DeviceProfile(**cached[key])


def profile_for(name: str) -> DeviceProfile:
    """`cpu` is calibrated on this machine; `cpu-default` and `h200` are fixed tables."""
    if name == "cpu":
        return cpu_profile()
    if name == "cpu-default":
        return PROFILES["cpu"]
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: cpu, cpu-default, {', '.join(PROFILES)}") from None
