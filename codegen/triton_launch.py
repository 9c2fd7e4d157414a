"""Launching compiled Triton kernels from the host: straight to a compiled kernel's
launcher after its first launch (as Inductor's launches do), and the error flag of a
kernel with gathers.  With codegen/triton.py (rendering and loading) and its siblings,
the only code that imports triton."""
from __future__ import annotations

import functools
import threading

from egraph_compiler.errors import IndexOutOfRange


def direct(fn, grid, options, sizes: tuple = ()):
    """A kernel's launch.  The first with each specialisation goes through `fn[grid]` (Triton's
    JITFunction.run: binds the arguments, computes their specialisation key, finds or compiles
    the kernel), and keeps the compiled kernel it returns; later launches with the same
    specialisation call that kernel's launcher directly, as Inductor's do.  The key is what
    Triton specialises pointers on, each one's 16-byte alignment, and the device; dtypes and
    sizes are fixed per compiled program, or a template's `sizes` (ints after the tensors and
    flags) are fixed per launch and of one specialisation class.  The interpreter and a Triton older than 3.4 (no
    `triton.knobs`, whose launch hooks the direct launch passes on) take JITFunction.run every time."""
    launched: dict = {}
    names = getattr(fn, "arg_names", ())
    constexprs = [options[name] for name in names[names.index("XBLOCK"):]] \
        if "XBLOCK" in names and _knobs() is not None else None  # (after the pointers, in order)

    grid3 = (*grid, 1, 1)[:3]
    runtime = []  # (triton.knobs.runtime, the driver's current-stream function), after the first launch

    def run(tensors, extra):
        pointers = (*tensors, *extra)
        args = (*pointers, *sizes)
        device = args[0].get_device()
        key = (device, *[t.data_ptr() & 15 == 0 for t in pointers])
        kernel = launched.get(key)
        if kernel is None or constexprs is None:
            kernel = fn[grid](*args, **options)
            if constexprs is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):
                launched[key] = kernel
                runtime[:] = [_knobs().runtime, _driver().get_current_stream]
            return
        hooks, current_stream = runtime
        stream = current_stream(device)
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook  # (a profiler's launch hooks see this
        if enter is not None or leave is not None:  # launch as Triton's own; with none, no metadata)
            enter, leave = _hook(enter), _hook(leave)
        metadata = kernel.launch_metadata(grid, stream, *args, *constexprs) if enter or leave else None
        kernel.run(grid3[0], grid3[1], grid3[2], stream,
                   kernel.function, kernel.packed_metadata, metadata, enter, leave, *args, *constexprs)
    return run


def _hook(hook):
    """A launch hook, or None where there is none (Triton 3.6 and newer keep an empty HookChain)."""
    return hook if hook is not None and getattr(hook, "calls", True) else None


@functools.cache
def _knobs():
    try:
        from triton import knobs  # (Triton 3.4 and newer: the launch hooks' home)
    except ImportError:
        return None
    return knobs


@functools.cache
def _driver():
    from triton.runtime import driver
    return driver.active


def gpu_target() -> tuple:
    """This process's GPU as Triton compiles for it: (backend, architecture, warp size)."""
    target = _driver().get_current_target()
    return target.backend, target.arch, target.warp_size


@functools.cache
def has_option(name: str) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return name in getattr(CUDAOptions, "__dataclass_fields__", {})


def checked(run, name: str):
    """A kernel with gathers: its error flag (one per device) passed after its tensors; on CPU
    tensors (the interpreter, where device asserts do nothing) it is read after the launch."""
    import torch
    local = threading.local()  # (per thread, as cpp_load's flags: one thread must not read another's)

    def call(*tensors):
        device = tensors[0].device
        flags = getattr(local, "flags", None)
        if flags is None:
            flags = local.flags = {}
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        run(tensors, (flag,))
        if device.type == "cpu" and flag.item():
            flag.zero_()
            raise IndexOutOfRange(name)
    return call
