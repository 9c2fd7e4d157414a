"""Storage orders: a generated kernel's output kept in the order of the tensor it reads.

A rotary embedding's q is `linear(x).view(B, S, H, D).transpose(1, 2)` rotated: a [B, H, S, D]
value whose input lies in memory as [B, S, H, D].  Stored row-major, the attention call's
output follows q's layout (torch's CPU flash kernel writes in q's order), so the output
projection's `transpose(1, 2).reshape(B, S, H * D)` is a copy per layer.  Stored in its
input's order (Inductor's pointwise outputs take their input's stride order too), the same
view is free, and the kernel writes in the order it reads.

Only where nothing assumes the buffer row-major: the kernel is elementwise (a cat too: a
partial rotary's rotated and passed-through halves) and stores one
value, is not a program output, and every reader is an attention library call taking it as
q, k or v directly (torch's kernels take any strides with a unit last one).  The last dim
stays innermost.  Decided after extraction, per kernel; lowering loops in the stored order
and the wrapper allocates the buffer with those strides.
"""
from __future__ import annotations

import math

from .graph import Node
from .loopir import loads, local_stride
from .lower import probe

ATTENTION = frozenset({"sdpa", "sdpa_mask"})  # (ops.py: torch's attention, any strides with a unit last one)


def storage_orders(plan) -> None:
    """Sets `order` on each generated kernel whose output is better stored permuted (above)."""
    readers: dict[int, list[tuple[Node, int]]] = {}  # buffer's node id -> (reader's node, argument position)
    for kernel in plan.kernels:
        node = kernel.output
        for n in kernel.inputs:  # (every materialised value read, through views too: -1 there)
            direct = [p for p, a in enumerate(node.args) if a is n] if kernel.kind != "generated" else []
            readers.setdefault(id(n), []).append((node, direct[0] if len(direct) == 1 else -1))
    outputs = {id(o) for o in plan.graph.outputs}
    for kernel in plan.kernels:
        root = kernel.output
        if (kernel.kind != "generated" or kernel.extra_outputs or kernel.loop_nest or id(root) in outputs
                or root.group not in ("pointwise", "concat") or len(root.shape) < 3):
            continue
        taken = readers.get(id(root), [])
        if taken and all(node.op in ATTENTION and node.group == "library" and position in (0, 1, 2)
                         for node, position in taken):
            kernel.order = read_order(kernel) or ()


def read_order(kernel) -> tuple[int, ...] | None:
    """The order of dims (outermost first) of the kernel's first input read along every dim (its
    strides, largest first: a slice of a wider buffer too), where that is not row-major and
    keeps the last dim last; None otherwise."""
    root = kernel.output
    shape = tuple(root.shape)
    expression = probe(kernel) if math.prod(shape) > 1 else None  # (None too where it reduces)
    if expression is None:
        return None
    for load in loads(expression):
        strides = [local_stride(load.index, f"d{d}") for d in range(len(shape))]  # (a cat reads modulo its pieces)
        moving = [strides[d] for d in range(len(shape)) if shape[d] > 1]
        if 0 in moving or len(set(moving)) < len(moving) or strides[-1] not in (1, 0):
            continue  # (a broadcast read, or one whose order is ambiguous)
        # unit dims first, in place order; then by stride, largest first
        order = tuple(sorted(range(len(shape)), key=lambda d: (shape[d] > 1, -strides[d], d)))
        if order[-1] == len(shape) - 1 and order != tuple(range(len(shape))):
            return _canonical(order, shape)
    return None


def _canonical(order: tuple, shape: tuple) -> tuple | None:
    """`order` with the unit dims back at their own places (they take no memory), or None
    where that leaves it row-major."""
    moving = [d for d in order if shape[d] > 1]
    out = [d if shape[d] == 1 else moving.pop(0) for d in range(len(shape))]
    return None if out == list(range(len(shape))) else tuple(out)


def strides_for(shape, order: tuple) -> tuple[int, ...]:
    """The strides of a [shape] tensor stored densely in `order` (outermost dim first)."""
    out, step = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = step
        step *= shape[d]
    return tuple(out)
