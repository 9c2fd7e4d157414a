"""Multi-output kernels: a value that several generated kernels compute inline
is stored by the first of them, beside its own output, and read by the later
ones.

Extraction prices each kernel alone, so a transformer's residual stream
(`h1 = x + attn`, `h2 = h1 + mlp`, ...) is recomputed from all its terms by
every later norm kernel: the k-th layer's norm reads 2k tensors, and a model's
norm kernels read a quadratic number of them.  The first kernel that computes
`h` already holds it in registers; one more store there lets every later kernel
read one tensor instead of all of `h`'s terms (Inductor's fused add + norm
kernels store the sum the same way).  Applied where it moves fewer bytes.
"""
from __future__ import annotations

from .cost import ELEMENTWISE, DeviceProfile, itemsize
from .graph import Node, topo_order
from .plan import Kernel, Plan, estimate, kernel_body

# what a stored value's kernel may compute on the way to it: per-element arithmetic on
# the first kernel's own loop domain (no reduction or row composite that it would need
# to evaluate at other indices)
ON_THE_WAY = ELEMENTWISE | {"boundary"}


def share_results(plan: Plan, profile: DeviceProfile) -> Plan:
    generated = [k for k in plan.kernels if k.kind == "generated"]
    produced = {id(n) for k in plan.kernels for n in k.outputs}
    seen_in: dict[int, int] = {}
    for k in generated:
        for n in k.ops:
            if n is not k.output:
                seen_in[id(n)] = seen_in.get(id(n), 0) + 1
    candidates = [n for n in topo_order(plan.graph.outputs)
                  if seen_in.get(id(n), 0) >= 2 and id(n) not in produced and n.group == "pointwise"]
    for value in candidates:
        users = [k for k in generated if any(n is value for n in k.ops) and k.output is not value]
        # the first user that can store it (a norm's statistics, reductions before its pointwise
        # kernel, cannot: they keep computing it), and the users after it (plan order is run order)
        at = next((i for i, k in enumerate(users) if _storable(k, value)), len(users))
        first, later = (users[at], users[at + 1:]) if at < len(users) else (None, [])
        if not later:
            continue
        bodies = [kernel_body(k.output, k.stored | {id(value)}) for k in later]
        saved = sum(_bytes(k.inputs) - _bytes(inputs) for k, (_, inputs) in zip(later, bodies))
        if saved <= _bytes([value]):  # the store costs one write of the value
            continue
        first.extra_outputs.append(value)
        estimate(first, profile)
        for k, (body, inputs) in zip(later, bodies):
            k.stored, k.ops, k.inputs = k.stored | {id(value)}, body, inputs
            estimate(k, profile)
    return plan


def _storable(kernel: Kernel, value: Node) -> bool:
    """The kernel's loop nest runs over as many elements as the value has (its
    output is not a reduction), and it reaches the value by elementwise steps
    only: the kernel stores the value's k-th element at its own k-th index."""
    root = kernel.output
    if root.group == "reduction" or root.numel != value.numel:
        return False
    body, _ = kernel_body(value, kernel.stored)
    return all(n.group in ON_THE_WAY for n in body)


def _bytes(nodes) -> int:
    return sum(n.numel * itemsize(n.dtype) for n in nodes)
