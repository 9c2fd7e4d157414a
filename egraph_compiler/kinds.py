"""What kind of kernel a plan node becomes: generated where the target computes every dtype it
touches exactly (integers included), a library call, or an ATen fallback with the reason the plan
lists and warns about."""
from __future__ import annotations

import math

from . import ops
from .graph import Node


INTEGER_OPS = frozenset({"add", "sub", "mul", "neg", "where", "cast", "cat", "embedding", "gather",
                         "sum", "amax"})  # exact in integers (sums and maxima accumulate in the integer type)


def _integral(value: float) -> bool:
    """An integer that the e-graph's float64 constants hold exactly (a folded product
    past 2**53 may not be the integer torch computes)."""
    return math.isfinite(value) and value == int(value) and abs(value) <= 2**53


def _integer_reason(body) -> str:
    """Why generated code would not compute this kernel's integers exactly ("" when
    it would): targets compute integer add/sub/mul/neg/where/cast/cat, sums and
    maxima in the integer type and compare integers as integers; other integer ops
    (maximum, abs, the integer division forms) run through ATen, and no other op
    reads an integer except through a cast."""
    for n in body:
        if n.group in ("layout", "source"):
            continue
        if n.dtype in ops.INTEGERS:
            if n.op not in INTEGER_OPS:
                return f"integer {n.op} in generated code"
            fractional = [a.attr("value") for a in n.args if a.op == "const" and not _integral(a.attr("value"))]
            if fractional:
                return f"a constant ({fractional[0]}) not exactly an integer in integer {n.op}"
        elif n.op not in ops.COMPARISONS and n.op != "cast":
            read = n.args[1:] if n.op == "where" else n.args[:1] if n.group == "gather" else n.args
            if any(a.dtype in ops.INTEGERS for a in read):
                return f"{n.op} of an integer without a cast"
    return ""


def _read_as_floats(body, dtypes) -> bool:
    """Whether every read of a value of these dtypes (a kernel's inputs) is a cast to a float."""
    return all(n.op == "cast" and n.dtype in ("float32", "float16", "bfloat16")
               for n in body for a in n.args if a.dtype in dtypes)


def kernel_kind(node: Node, body, inputs, target) -> tuple[str, str]:
    """Generated where the target (its `dtypes` and `language`) handles every
    dtype the kernel touches; library calls; ATen for the rest."""
    if node.op == "extern":
        return "aten", node.attr("target").reason
    if node.group in ("library", "collective"):
        return "library", ""
    computed = {n.dtype for n in body}
    dtypes = computed | {i.dtype for i in inputs}
    missing = dtypes - target.dtypes
    if missing and computed <= target.dtypes:  # (an input's only: a uint8 image read through a cast?)
        narrow = missing <= target.narrow_reads
        if not (narrow and _read_as_floats(body, missing)):
            how = "reads only as a cast to a float" if narrow else "does not read"
            return "aten", f"an input of dtype {', '.join(sorted(missing))}, which {target.language} {how}"
    elif missing:
        return "aten", f"dtype {', '.join(sorted(missing))} in {target.language}"
    reason = _integer_reason(body) if dtypes & ops.INTEGERS else ""
    return ("aten", reason) if reason else ("generated", "")
