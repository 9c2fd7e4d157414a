"""Device profiles for the cost model: the H200's measured ceilings, and this
CPU's, calibrated on first use by a short measurement and cached on disk.

The measurement (a few seconds, and four C++ compiles, cached): copy bandwidth (a 64 MB
copy), the rate generated code reaches in the op table's FLOP units (a compiled chain of
multiply-adds), what its transcendental calls cost against that (compiled chains of exp,
of tanh and of cos and sin: `DeviceProfile.exp_cost`, `tanh_cost`, `trig_cost`), the
library's matmul rate and its fixed cost per call (fitted to two sizes), and the fixed
cost of one kernel call.  Each is the best of nine readings, each the mean of
back-to-back calls lasting at least READING, and a measurement whose readings disagree
(the median more than 1.5x the best: the machine is busy) is refused: the fixed table
serves that process (CalibrationWarning), and the next measures again, so a calibration
taken under load is never cached.
"""
from __future__ import annotations

import json
import os
import time
import warnings

import torch

from .cost import PROFILES, TRANSCENDENTAL, DeviceProfile
from .cache import cache_dir
from .errors import CalibrationWarning

PROFILE_VERSION = 10  # (10: trig_cost)
UNSTABLE = 1.5  # a reading whose median run is this much slower than its best was taken on a busy machine
_refused = False  # this process found the machine too busy once: the fixed table, no second attempt


READING = 2e-3  # seconds: a reading times back-to-back calls for at least this long


def _best_seconds(fn, repeat: int = 9) -> float:
    """The least disturbed of several readings (a busy machine slows runs down, never
    up), each the mean of as many back-to-back calls as take READING (a 256-cube matmul
    takes ~25 us on 16 cores, where one call's time is mostly its threads waking); raises
    _Busy where the readings disagree too much for the best to be trusted."""
    start = time.perf_counter()
    fn()
    calls = min(1000, max(1, int(READING / max(time.perf_counter() - start, 1e-7))))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    times.sort()
    if times[len(times) // 2] > UNSTABLE * times[0]:
        raise _Busy
    return times[0]


class _Busy(Exception):
    pass


MAX_LIBRARY_LAUNCH = 1e-3  # seconds: a library call's fitted fixed cost above this was a disturbed reading
ATTEMPTS = 3  # a reading refused as disturbed is taken again (a moment later) this many times in all


def measure_cpu() -> DeviceProfile | None:
    """This CPU's profile, or None when the machine is too busy to measure: ATTEMPTS
    readings were refused (on a 16-core machine one disturbed reading in a row is
    common, and a refused calibration leaves the fixed 2-core table pricing its plans)."""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(0.5)
        try:
            measured = _measure_cpu()
        except _Busy:
            continue
        if plausible(measured):
            return measured
    return None


def _measure_cpu() -> DeviceProfile:
    n = 1 << 24  # 64 MB of float32
    src, dst = torch.ones(n), torch.empty(n)
    bandwidth = 2 * 4 * n / _best_seconds(lambda: dst.copy_(src))
    flops, _ = _generated_rate(_chain)
    library, library_launch = _fitted([(2 * n ** 3, lambda n=n, a=torch.randn(n, n): torch.mm(a, a))
                                       for n in (256, 512)])
    one = torch.ones(1)
    launch = _best_seconds(lambda: [torch.add(one, one) for _ in range(100)]) / 100
    exp_cost, tanh_cost, trig_cost = (_transcendental_cost(fn, op, flops) for fn, op in (
        (_exp_chain, "exp"), (_tanh_chain, "tanh"), (_trig_chain, "cos")))
    # (fused attention is charged the matmul rate and fixed cost: its own fit, over 128 and 256
    # queries, read 34-38 us per call on this 2-core machine when quiet and 90-98 us inside a test
    # run, which flipped the attention workload's plan; TESTING.md)
    return DeviceProfile("cpu", bandwidth, flops, library, launch, exp_cost=exp_cost, tanh_cost=tanh_cost,
                         trig_cost=trig_cost, library_launch=library_launch)


def _fitted(calls) -> tuple[float, float]:
    """(FLOP / s, seconds per call) of a library op, fitted to its times at two sizes
    ((FLOPs, call) pairs, smaller first): time = fixed + FLOPs / rate.  Small calls run
    far below the large ones' rate (thread start-up, packing): on 16 cores a matmul of
    34 MFLOP took twice its FLOPs at the 512-cube's rate."""
    (small, small_call), (large, large_call) = calls
    t_small, t_large = _best_seconds(small_call), _best_seconds(large_call)
    if t_large <= t_small * 1.05:  # (no slope to fit: the large call's rate, nothing fixed)
        return large / t_large, 0.0
    rate = (large - small) / (t_large - t_small)
    fixed = max(0.0, t_small - small / rate)
    return rate, fixed


def _transcendental_cost(chain, op: str, rate: float) -> float:
    """The factor by which `op`'s FLOPs (TRANSCENDENTAL's share) must be weighted for
    `chain` (16 independent calls of `op` per element, summed) to take, at the arithmetic
    `rate`, the time it took."""
    measured, per_element = _generated_rate(chain)
    transcendental = 16 * TRANSCENDENTAL[op][1]
    factor = (per_element * rate / measured - (per_element - transcendental)) / transcendental
    return min(max(factor, 1.0), 50.0)


def _chain(x, a, b):
    for _ in range(32):
        x = x * a + b
    return x


def _exp_chain(x, a, b):
    # 16 exps per element that do not wait for each other (a dependent chain would time
    # their latency, where kernels pay their throughput)
    return sum(torch.exp(x * (-0.05 * k)) for k in range(1, 17))


def _tanh_chain(x, a, b):
    return sum(torch.tanh(x * (0.05 * k)) for k in range(1, 17))


def _trig_chain(x, a, b):
    # (angles up to ~130 radians, as a rotary embedding's positions times its frequencies;
    # cos and sin of different angles: g++ would merge a pair of one angle into sincosf)
    return sum((torch.cos if k % 2 else torch.sin)(x * (8.0 * k)) for k in range(1, 17))


def _generated_rate(chain) -> tuple[float, float]:
    """(rate, FLOPs per element): the rate generated code reaches on `chain`, in the op-table FLOPs the cost model
    charges it: `_chain`'s 32 multiply-adds per element (or the tanh/exp chain),
    compiled by this package (with the fixed table, so no calibration recurses) and
    timed on 4M elements.  (The arithmetic rate was
    vectorised torch.exp, counted at the table's 4 FLOPs per exp: arithmetic in a
    fused loop runs several times faster than that, and on 16 cores the cost model
    then split ln_relu to save arithmetic it does not pay: 3x slower; issue 10.)"""
    from .api import compile  # the pipeline imports this module
    x, a, b = torch.rand(256, 16384), torch.rand(1), -0.1 - torch.rand(1)  # (b < 0: the exp chain stays in (0, 1])
    compiled = compile(chain, [x, a, b], target="cpu", profile="cpu-default", trust_rules=True, cache=False)
    flops = sum(k.flops for k in compiled.plan.kernels if k.kind == "generated")
    rate = flops / _best_seconds(lambda: compiled(x, a, b))
    return rate, flops / x.numel()


def plausible(profile: DeviceProfile) -> bool:
    """Within a factor of the fixed CPU table: a reading far outside it was
    taken on a machine too busy to measure, and is not kept.  A library call's fixed
    cost is 20-40 us on 16 cores; one of 11 ms was read on this 2-core machine with both
    cores taken by other processes (every matmul run alike slow, so no run stood out),
    and priced every library call of every plan at a whole layer's time."""
    default = PROFILES["cpu"]
    ratios = [profile.bandwidth / default.bandwidth, profile.flops / default.flops,
              profile.library_flops / default.library_flops, default.launch / max(profile.launch, 1e-9)]
    fixed = max(profile.library_launch, profile.attention_launch)
    return all(0.1 <= r <= 100 for r in ratios) and fixed <= MAX_LIBRARY_LAUNCH


def _key() -> str:
    return f"cpu-v{PROFILE_VERSION}-{os.cpu_count()}-{torch.get_num_threads()}-{torch.__version__}"


def _cached() -> dict:
    try:
        return json.loads((cache_dir() / "profiles.json").read_text())
    except (OSError, ValueError):
        return {}


def _store(cached: dict) -> None:
    path = cache_dir() / "profiles.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, path)


def cached_cpu_profile() -> DeviceProfile | None:
    """This machine's calibrated profile (machine, thread count, torch version), if measured."""
    entry = _cached().get(_key())
    profile = DeviceProfile(**entry) if entry else None
    return profile if profile is not None and plausible(profile) else None  # (one cached before the check: again)


def calibrate_cpu() -> DeviceProfile | None:
    """Measure now and cache it (replacing an earlier calibration); None, and
    nothing cached, when the machine is too busy to measure."""
    measured = measure_cpu()
    if measured is not None:
        _store(_cached() | {_key(): measured.__dict__})
    return measured


def reset() -> int:
    """Forget every cached calibration; how many there were."""
    cached = _cached()
    if cached:
        _store({})
    return len(cached)


def cpu_profile() -> DeviceProfile:
    """This machine's profile, measured once and cached by machine and torch version."""
    global _refused
    profile = cached_cpu_profile()
    if profile is None:
        profile = None if _refused else calibrate_cpu()
        if profile is None:  # too busy to measure now: the fixed table, not cached (measured again next process)
            if not _refused:  # (a 16-core box's plans were priced so, unseen: BENCHMARKS.md, forty-second session)
                warnings.warn("this CPU's cost profile could not be measured (the machine was busy: "
                              f"{ATTEMPTS} readings were refused); plans in this process are priced by the fixed "
                              "table `cpu-default`. Run `egc profile calibrate` on a quiet machine to cache one.",
                              CalibrationWarning, stacklevel=2)
            _refused = True
            return PROFILES["cpu"]
    return profile


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
