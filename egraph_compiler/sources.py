"""Where in the user's code: the source line a warning or an error names (an op's fallback,
a failed capture), read from the FX nodes' stack traces and from tracebacks, past the frames
of torch, of this package, of Python's own library and of FX's generated code."""
from __future__ import annotations

import os
import re
import traceback

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))  # torch's frames are not the user's source
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))  # nor Python's own (contextlib, functools)


def _users(where: str) -> bool:
    """Whether a frame (its path, or a stack trace's `File "..."` line) is the user's code: not
    torch's, this package's, Python's own library's (its site-packages are users') or FX's
    generated code."""
    if any(d in where for d in (_TORCH_DIR, _PACKAGE_DIR, "<eval_with_key>")):
        return False
    return not (_STDLIB_DIR in where and "-packages" not in where)


def user_line(fx_node) -> str:
    trace = fx_node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and _users(lines[i]):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
    return f"<no source line> ({fx_node.name})"


def failed_at(exc: BaseException) -> str:
    """' at File "...", line N: code' for the user's deepest frame in the failure's traceback
    (a branch on a tensor's value, a call with the wrong arguments), or '' where none is."""
    frames = []
    while exc is not None:
        frames = traceback.extract_tb(exc.__traceback__) + frames
        exc = exc.__cause__ or exc.__context__
    for frame in reversed(frames):
        if _users(os.path.abspath(frame.filename)) and frame.line:
            return f' at File "{frame.filename}", line {frame.lineno}: {frame.line.strip()}'
    return ""


_GENERATED = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in \w+\n\s*(\w+) = ')  # fx's generated code


def keep_stack_traces(before, after) -> None:
    """`run_decompositions` traces the program again; inside a higher-order op's body (an autocast
    region) the new nodes' stack traces point at the traced module's generated code, not at the
    user's line.  Such a frame names the node it ran (`special_i0 = ...`): its trace is taken from
    that node of the program before."""
    traces: dict[str, str] = {}
    for module in before.modules():  # (the program's module and its higher-order ops' bodies)
        if hasattr(module, "graph"):
            for node in module.graph.nodes:
                if node.meta.get("stack_trace") and "<eval_with_key>" not in node.meta["stack_trace"]:
                    traces.setdefault(node.name, node.meta["stack_trace"])
    for node in after.graph.nodes:
        ran = _GENERATED.findall(node.meta.get("stack_trace") or "")
        if ran and ran[-1] in traces:
            node.meta["stack_trace"] = traces[ran[-1]]
