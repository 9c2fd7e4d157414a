"""Loading a C++ program: build its shared object (egraph_compiler.cache) and wrap each kernel
as a callable over torch tensors through ctypes; and the C++ side of sizes as arguments
(codegen/sizes.py): which literals stay constants, and how a template takes its sizes."""

from __future__ import annotations

import ctypes
import re
import threading

from egraph_compiler.cache import build_shared_object
from egraph_compiler.errors import IndexOutOfRange
from egraph_compiler.loopir import LoopKernel, has_gather

from .sizes import Sized


def load(source: str, kernels: list[LoopKernel], sizes: list[int] | None = None):
    """Build (or find in the cache) the shared object, and wrap each kernel as
    a callable over torch tensors: their data pointers go through ctypes (and, for
    a template's build, the address of this program's sizes last: codegen/sizes.py)."""
    path, compiled_now = build_shared_object(source)
    library = ctypes.CDLL(str(path))
    calls = {}
    array = None if sizes is None else (ctypes.c_int64 * max(len(sizes), 1))(*sizes)
    extra = () if array is None else (ctypes.addressof(array),)
    for k in kernels:
        fn = getattr(library, k.name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * (len(k.params) + has_gather(k) + len(extra))
        if has_gather(k):
            calls[k.name] = _checked(fn, k.name, extra)
        else:
            calls[k.name] = lambda *tensors, fn=fn: fn(*[t.data_ptr() for t in tensors], *extra)
        calls[k.name].sizes = array  # (kept alive with the callable)
    return calls, compiled_now


def _checked(fn, name: str, extra: tuple):
    """A kernel with gathers: its error flag passed after the tensors, and read after each call.
    A flag per thread: ctypes lets go of the GIL during the call, and with one flag a thread whose
    ids were in range could read (and clear) another's error, which then returned rows it never
    read, silently."""
    flags = threading.local()

    def call(*tensors):
        flag = getattr(flags, "flag", None)
        if flag is None:
            flag = flags.flag = (ctypes.c_int32 * 1)()
        fn(*[t.data_ptr() for t in tensors], ctypes.addressof(flag), *extra)
        if flag[0]:
            flag[0] = 0
            raise IndexOutOfRange(name)
    return call


def _fixed(line: str, column: int) -> bool:
    """A literal C++ needs as a constant (in a pragma, an alignment, a template argument, the bound of
    an initialised array; a row's stash may have a variable length: g++ takes it), or one that must stay
    constant to stay fast: a divisor inside a row's loop (g++ divides there per element, a softmax over
    [4, 8, 512, 512] scores took 35 ms against 6; a divisor once per row, a gather's, costs nothing)."""
    before = line[:column].rstrip()
    return (line.lstrip().startswith("#") or before.endswith("alignas(") or re.search(r"\w<$", before) is not None
            or (before.endswith("[") and re.match(r"\d+\]\s*=", line[column:]) is not None)
            or (before.endswith(("/", "%")) and re.search(r"for \(int64_t r\w* =", line) is not None))


def _with_sizes(text: str, count: int) -> str:
    """Each kernel takes the size array last and reads the sizes its body uses once, at its top."""
    out = []
    for chunk in text.split('extern "C" void ')[1:]:
        used = [i for i in range(count) if f"egc_s{i}" in chunk]
        head, body = chunk.split(") {\n", 1)
        out.append(f'extern "C" void {head}, const int64_t* __restrict__ egc_sz) {{\n'
                   + "".join(f"  const int64_t egc_s{i} = egc_sz[{i}];\n" for i in used) + body)
    return text.split('extern "C" void ')[0] + "".join(out)


SIZED = Sized(fixed=_fixed, slot=lambda i: f"egc_s{i}", finish=_with_sizes,
              note=lambda sizes: "// sizes as arguments (codegen/sizes.py): " +
              ", ".join(f"egc_s{i} = {v}" for i, v in enumerate(sizes)) + "\n")
