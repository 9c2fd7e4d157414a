"""The cost model: one small pure function plus device profiles.

Contract: `kernel_cost(flops, bytes_moved, profile, library)` is the roofline
time in seconds, max(FLOPs / peak, bytes / bandwidth) + launch overhead, with
library calls (matmul, sdpa) at an efficiency factor of the peak.  `op_cost`
charges one op that runs as its own kernel (inputs read, output written);
views (layout ops) cost nothing but a tiny tie-breaker, so that extraction
prefers fewer of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ops


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    bandwidth: float  # bytes / s
    flops: float  # FLOP / s for generated code
    library_flops: float  # FLOP / s for matmul-class library calls
    launch: float  # seconds per kernel


PROFILES = {
    # measured ceilings on the H200 (copy bandwidth; bf16 dense matmul)
    "h200": DeviceProfile("h200", 4.2e12, 60e12, 790e12, 4e-6),
    # a conservative two-core CPU; issue-level calibration refines it
    "cpu": DeviceProfile("cpu", 10e9, 40e9, 100e9, 3e-6),
}

VIEW_COST = 1e-12  # layout ops are index maps; a tiny cost still prefers fewer of them
_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "bool": 1}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def kernel_cost(flops: float, bytes_moved: float, profile: DeviceProfile, library: bool = False) -> float:
    peak = profile.library_flops if library else profile.flops
    return max(flops / peak, bytes_moved / profile.bandwidth) + profile.launch


def op_flops(op: str, out_shape, in_shapes) -> float:
    opdef = ops.get(op)
    if op in ("matmul", "linear"):
        k = in_shapes[0][-1]
        return 2.0 * math.prod(out_shape) * k
    if op == "conv2d":  # each output element: a dot product over in_channels/groups x kernel window
        return 2.0 * math.prod(out_shape) * math.prod(in_shapes[1][1:])
    if op in ("sdpa", "sdpa_mask"):
        q, k = in_shapes[0], in_shapes[1]
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    if opdef.group == "reduction":
        return opdef.flops * math.prod(in_shapes[0])
    return opdef.flops * math.prod(out_shape)


def op_cost(op: str, out_shape, out_dtype: str, in_shapes, in_dtypes, profile: DeviceProfile) -> float:
    group = ops.group_of(op)
    if group == "source":
        return 0.0
    if group == "layout":
        return VIEW_COST
    moved = math.prod(out_shape) * itemsize(out_dtype)
    moved += sum(math.prod(s) * itemsize(d) for s, d in zip(in_shapes, in_dtypes))
    return kernel_cost(op_flops(op, out_shape, in_shapes), moved, profile, library=group == "library")
