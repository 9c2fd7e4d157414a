"""Renderers from loop IR to source, one target table each (see walker.py)."""
from __future__ import annotations

from .walker import Target

TARGETS = ("cpu", "cuda", "triton")


def get_target(name: str) -> Target:
    """cpu: C++ with OpenMP; cuda: Triton on the GPU; triton: Triton on CPU tensors,
    in Triton's interpreter (how CI tests the Triton renderer)."""
    if name == "cpu":
        from .cpp import TARGET
        return TARGET
    if name in ("cuda", "triton"):
        from .triton import make_target
        return make_target(name, "cuda" if name == "cuda" else "cpu")
    raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
