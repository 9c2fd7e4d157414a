"""The cost model: one small pure function plus device profiles.

Every cost formula lives here, used by greedy and ILP extraction and by the
plan's estimates: `kernel_cost` is a kernel's roofline time in seconds,
max(FLOPs / peak, bytes / bandwidth) + launch overhead, with library calls
(matmul, sdpa) at the library's rate; `inlined_cost` is what an op computed
inside its consumer's kernel adds; `additive_kernel_cost` is kernel_cost's
linear upper bound, for the ILP.  Views (layout ops) cost nothing but a tiny
tie-breaker (VIEW_COST), so that extraction prefers fewer of them.
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
    link_bandwidth: float = 5e9  # bytes / s between processes (collectives)
    attention_flops: float = 0.0  # FLOP / s for fused attention (sdpa); 0: the matmul rate
    # what a FLOP of a transcendental call costs, in FLOPs of arithmetic: exp's kind (exp, log,
    # sigmoid, silu, softmax, pow), tanh's (tanh, gelu_tanh, erf, gelu) and trig's (cos, sin: on the
    # device box's Xeon a rotary kernel's cos and sin took ~6 ns a call where exp took ~0.3)
    exp_cost: float = 1.0
    tanh_cost: float = 1.0
    trig_cost: float = 1.0
    # what a library call costs beyond its FLOPs at the rate (thread start-up, packing): fitted,
    # with the rate, from two sizes (16 cores: +35 us per matmul, +100 us per fused attention)
    library_launch: float = 0.0
    attention_launch: float = 0.0


ATTENTION = frozenset({"sdpa", "sdpa_mask", "softmax_attention", "sdpa_fwd", "sdpa_fwd_mask", "sdpa_grad",
                       "sdpa_grad_mask"})
# nodes that take their value from a call another node makes (flash.py: the forward's logsumexp,
# the backward's three gradients): the call's fixed cost shared among them
SHARES = {"sdpa_lse": 0.0, "sdpa_lse_mask": 0.0, "sdpa_grad": 1 / 3, "sdpa_grad_mask": 1 / 3}


def launch_cost(profile: DeviceProfile, library: bool, op: str = "") -> float:
    """A kernel's fixed cost: its launch, and a library call's own (`library_launch`)."""
    if not library:
        return profile.launch
    share = SHARES.get(op, 1.0)
    return share * (profile.launch + (profile.attention_launch if op in ATTENTION else profile.library_launch))


def peak_flops(profile: DeviceProfile, library: bool, op: str = "") -> float:
    """The arithmetic rate a kernel runs at: generated code's, the library's matmul
    rate, or fused attention's where the profile measured it."""
    if not library:
        return profile.flops
    return profile.attention_flops if op in ATTENTION and profile.attention_flops else profile.library_flops


PROFILES = {
    # measured ceilings on the H200 (copy bandwidth; bf16 dense matmul)
    # (NVLink 4, one direction; flash attention: the attention workload, 8x16x2048x64 bf16, in 0.30 ms)
    "h200": DeviceProfile("h200", 4.2e12, 60e12, 790e12, 4e-6, 450e9, attention_flops=450e12),
    # a conservative two-core CPU; issue-level calibration refines it
    "cpu": DeviceProfile("cpu", 10e9, 40e9, 100e9, 3e-6),
}

VIEW_COST = 1e-12  # layout ops are index maps; a tiny cost still prefers fewer of them
_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "bool": 1,
             "int16": 2, "int8": 1, "uint8": 1}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def kernel_cost(flops: float, bytes_moved: float, profile: DeviceProfile, library: bool = False,
                link: bool = False, serial_bytes: float = 0.0, op: str = "") -> float:
    """A kernel's time: the roofline (compute and memory overlap) plus its launch;
    a collective (`link`): its bytes over the link between processes.
    `serial_bytes` are moved by a separate pass that overlaps nothing (a library
    call's `extra_passes`); `op` picks the library's rate (`peak_flops`)."""
    if link:
        return bytes_moved / profile.link_bandwidth + profile.launch
    peak = peak_flops(profile, library, op)
    return (max(flops / peak, bytes_moved / profile.bandwidth) + serial_bytes / profile.bandwidth
            + launch_cost(profile, library, op))


def inlined_cost(flops: float, loads: float, profile: DeviceProfile) -> float:
    """What computing an op inside its consumer's kernel adds: its arithmetic and
    its loads, summed (extraction adds these up along a fused body)."""
    return flops / profile.flops + loads / profile.bandwidth


def additive_kernel_cost(flops: float, loads: float, store: float, profile: DeviceProfile,
                         library: bool = False, link: bool = False, serial_bytes: float = 0.0, op: str = "") -> float:
    """`kernel_cost` with compute and memory summed instead of overlapped: the
    linear form the ILP can minimise (an upper bound of kernel_cost)."""
    if link:
        return kernel_cost(flops, loads + store, profile, link=True)
    peak = peak_flops(profile, library, op)
    return flops / peak + (loads + store + serial_bytes) / profile.bandwidth + launch_cost(profile, library, op)


def extra_passes(op: str, in_shapes, attrs=None) -> int:
    """Passes over its output that a library call makes beyond writing it once,
    each a separate pass (charged after the roofline, not overlapped with it).
    torch's linear with a bias (addmm) first fills the output with the bias, then
    accumulates the product into it: one more write and one more read than a
    matmul.  Measured on gpt_block: addmm 25-40% slower than matmul on 2 and 16
    CPU cores and on the H200, where the bias added in the consumer's generated
    kernel costs next to nothing (BENCHMARKS.md, "bias in the epilogue").
    A generated kernel whose store transposes its innermost dim (`attrs`: the root's) goes
    through a tile, or stores across rows: one more pass (on 2 CPU cores a [512, 1024] silu*mul
    took 0.59 ms stored transposed against 0.25 ms in order; a library call takes the transpose
    of the value stored in order as a view, for free)."""
    if op == "linear" and len(in_shapes) > 2 and len(in_shapes[2]) >= 1:
        return 2
    return 1 if attrs is not None and moves_inner_dim(op, attrs, in_shapes[0] if in_shapes else ()) else 0


def moves_inner_dim(op: str, attrs, shape) -> bool:
    """A transpose or permute that takes another dim of `shape` (both longer than 1) innermost."""
    rank = len(shape)
    if rank < 2 or shape[-1] == 1:
        return False
    if op == "transpose":
        d0, d1 = ops.norm_dim(attrs["dim0"], rank), ops.norm_dim(attrs["dim1"], rank)
        other = d1 if d0 == rank - 1 else d0 if d1 == rank - 1 else None
        return other is not None and other != rank - 1 and shape[other] > 1
    if op == "permute":
        inner = ops.norm_dim(attrs["dims"][-1], rank)
        return inner != rank - 1 and shape[inner] > 1
    return False


# linears with their epilogue in oneDNN's call (ops.py): a linear's FLOPs, the epilogue's next to none
ONEDNN_LINEARS = ("linear_silu", "linear_gelu_tanh", "linear_mul")


# ops whose value a consumer's kernel computes per element where it reads it (a reduction or a
# row op inside a kernel is computed once per row, however often its value is read)
ELEMENTWISE = frozenset({"pointwise", "layout", "concat", "gather", "source"})


def repeats(group: str, out_elements: float, operand_elements: float) -> float:
    """How often an elementwise operand computed inside its consumer is evaluated, per element of
    its own: once per element of the consumer's output where that broadcasts it (LLaMA's
    `q * cos`, with cos [B, S, D] read by every head of q: computed once per head).  A reduction or
    row consumer reads each element of its operand once."""
    if group not in ELEMENTWISE or operand_elements <= 0:
        return 1.0
    return max(1.0, out_elements / operand_elements)


# of an op's FLOPs per element (the op table's), those spent in transcendental calls, by kind:
# generated code runs them slower than its arithmetic, by the profile's measured factors
TRANSCENDENTAL = {"exp": ("exp", 4), "log": ("exp", 4), "sigmoid": ("exp", 4), "silu": ("exp", 4),
                  "softmax": ("exp", 4), "log_softmax": ("exp", 7), "pow": ("exp", 4), "cos": ("trig", 6),
                  "sin": ("trig", 6), "log1p": ("exp", 6), "expm1": ("exp", 6), "tanh": ("tanh", 6),
                  "gelu_tanh": ("tanh", 6), "erf": ("tanh", 8),
                  "gelu": ("tanh", 8)}


def op_flops(op: str, out_shape, in_shapes, profile: DeviceProfile | None = None) -> float:
    """The op's FLOPs (op-table units); with a profile, its transcendental calls weighted
    by what they cost there (`DeviceProfile.exp_cost`, `tanh_cost`, `trig_cost`)."""
    flops = _table_flops(op, out_shape, in_shapes)
    if profile is not None and op in TRANSCENDENTAL:
        kind, share = TRANSCENDENTAL[op]
        factor = getattr(profile, f"{kind}_cost")  # (exp_cost, tanh_cost, trig_cost)
        flops *= 1 + (factor - 1) * share / ops.get(op).flops
    return flops


def _table_flops(op: str, out_shape, in_shapes) -> float:
    opdef = ops.get(op)
    if op in ("matmul", "linear") or op in ONEDNN_LINEARS:
        k = in_shapes[0][-1]
        return 2.0 * math.prod(out_shape) * k
    if op == "conv2d":  # each output element: a dot product over in_channels/groups x kernel window
        return 2.0 * math.prod(out_shape) * math.prod(in_shapes[1][1:])
    if op == "conv2d_input_grad":  # as conv2d's, counted on the output gradient (operand 0)
        return 2.0 * math.prod(in_shapes[0]) * math.prod(in_shapes[1][1:])
    if op == "conv2d_weight_grad":
        return 2.0 * math.prod(in_shapes[0]) * math.prod(out_shape[1:])
    if op == "embedding_grad":  # the zero fill, and one add per gradient element
        return math.prod(out_shape) + math.prod(in_shapes[0])
    if op in ("sdpa_grad", "sdpa_grad_mask"):  # each of dq, dk, dv: a third of a backward of about 2.5 forwards
        q, k = in_shapes[1], in_shapes[2]
        return 10.0 / 3.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    if op in ATTENTION:
        q, k = in_shapes[0], in_shapes[1]
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    if opdef.group == "reduction":
        return opdef.flops * math.prod(in_shapes[0])
    return opdef.flops * math.prod(out_shape)
