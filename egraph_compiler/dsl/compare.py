"""Comparing a rule's two sides on one instance (`verify`): shapes, values in
float64 with each side's own rounding error tolerated below it, and the
counterexample a failure reports."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import reduce

import torch

from .evaluate import NotApplicable, evaluate

TOLERANCES = {torch.float64: (1e-6, 1e-9), torch.float32: (1e-4, 1e-5),  # (rtol, atol)
              torch.float16: (1e-2, 1e-3), torch.bfloat16: (5e-2, 1e-2)}


@dataclass
class Instance:
    shapes: dict
    attrs: dict
    tensors: dict
    dtype: torch.dtype
    profile: str
    pattern: object  # the matched side
    lhs: torch.Tensor  # its value

    def describe(self) -> str:
        shapes = " ".join(f"{n}={list(s)}" for n, s in self.shapes.items())
        attrs = "".join(f" {n}={v!r}" for n, v in self.attrs.items())
        return f"{str(self.dtype)[6:]}, {self.profile} values, {shapes}{attrs}"


def compare(inst: Instance, result):
    """(error, failure message or '', counterexample or '') for one instance; None when the rule would not fire."""
    try:
        rhs = evaluate(result, inst.tensors, inst.attrs)
    except NotApplicable:
        return None
    except Exception as exc:
        what = f"the other side fails: {explain(exc)}"
        return math.inf, what, f"{what} on {_inputs(inst)}"
    lhs = inst.lhs
    if tuple(lhs.shape) != tuple(rhs.shape):
        what = f"shapes differ: {list(lhs.shape)} vs {list(rhs.shape)}"
        return math.inf, what, f"lhs and rhs {what} on {_inputs(inst)}"
    rtol, atol = max(TOLERANCES[d] for d in (inst.dtype, lhs.dtype, rhs.dtype) if d in TOLERANCES)
    error, what = _error(lhs.double(), rhs.double(), rtol, atol, _noise(inst, result, lhs, rhs))
    return error, what, (_worst_element(inst, lhs.double(), rhs.double()) + f" on {_inputs(inst)}" if what else "")


def _inputs(inst: Instance) -> str:
    """The instance as a user can rebuild it: each input's shape and leading values, then the attributes."""
    def leading(t):
        values = [str(bool(v)).lower() if t.dtype == torch.bool else f"{float(v):.4g}" for v in t.flatten()[:4]]
        return ", ".join(values) + (", ..." if t.numel() > 4 else "")
    tensors = ", ".join(f"{n}: shape {list(t.shape)} [{leading(t)}]" for n, t in inst.tensors.items())
    attrs = "".join(f", {n}={v!r}" for n, v in inst.attrs.items())
    return f"{str(inst.dtype)[6:]} {inst.profile} values {tensors}{attrs}"


def _worst_element(inst, a, b) -> str:
    """Where lhs and rhs differ most (NaN or inf on one side only counts as infinitely far), with the
    input values there (inputs that broadcast to the output)."""
    diff = torch.nan_to_num((a - b).abs(), nan=math.inf, posinf=math.inf)
    diff = torch.where(a.isnan() & b.isnan() | (a == b), torch.zeros_like(diff), diff)
    at = tuple(int(i) for i in torch.unravel_index(diff.flatten().argmax(), a.shape)) if a.dim() else ()
    there = []
    for name, t in inst.tensors.items():
        try:
            there.append(f"{name}={float(torch.broadcast_to(t, a.shape)[at]):.6g}")
        except RuntimeError:  # an input that does not broadcast to the output (a reduction's, a reshape's)
            pass
    where = f" where {', '.join(there)}" if there else ""
    return f"lhs {float(a[at]):.6g} vs rhs {float(b[at]):.6g} at {list(at)}{where} (max |lhs - rhs| " \
           f"{float(diff.max()):.3g})"


def explain(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _noise(inst, result, lhs, rhs):
    """Below float64, each side's own rounding error (against float64 evaluation) is allowed too."""
    if inst.dtype == torch.float64:
        return 0.0
    wide = {n: t.double() for n, t in inst.tensors.items()}
    try:
        lhs64, rhs64 = evaluate(inst.pattern, wide, inst.attrs), evaluate(result, wide, inst.attrs)
    except Exception:
        return 0.0
    parts = [lhs.double(), lhs64.double(), rhs.double(), rhs64.double()]
    finite = reduce(operator.and_, [torch.isfinite(p) for p in parts])  # overflow is never excused
    noise = (parts[0] - parts[1]).abs() + (parts[2] - parts[3]).abs()
    return torch.where(finite, noise, torch.zeros_like(noise))


def _error(a, b, rtol, atol, noise):
    """Pass when |a - b| <= atol + rtol * (output magnitude) + 2 * noise everywhere; NaN matches NaN."""
    both_nan, finite = a.isnan() & b.isnan(), a.isfinite() & b.isfinite()
    if bool(((a != b) & ~finite & ~both_nan).any()):
        return math.inf, "values differ (NaN or inf on one side only, or infs of opposite sign)"
    if a.numel() == 0:
        return 0.0, ""
    zero = torch.zeros_like(a)
    diff = torch.where(finite, (a - b).abs(), zero)
    scale = float(torch.where(finite, torch.maximum(a.abs(), b.abs()), zero).max())
    error = float(diff.max()) / max(1.0, scale)
    if bool((diff > atol + rtol * scale + 2 * noise).any()):
        return error, f"values differ by {float(diff.max()):.3g} (output magnitude {scale:.3g})"
    return error, ""
