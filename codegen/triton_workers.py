"""Compile workers that live as long as this process (as Inductor's do): child Pythons
that import torch and Triton once, then compile the kernels each module hands them
(`triton_build.warm_in_parallel`) into Triton's on-disk cache, where this process's
first launch finds them.  A one-shot child spent ~4 s starting and ~1.5 s on its first
kernel, against ~0.15 s a kernel after that (BENCHMARKS.md, H100); `start` runs when a
compile for the GPU begins, so that start-up overlaps the e-graph's work.

The children never touch the GPU: Triton's driver in them answers with the parent's
target (architecture, warp size) instead of asking CUDA, so no worker holds a CUDA
context (on a machine without a GPU, they compile for the one named).  They build each
kernel's launcher as well, where Triton builds one per signature with the host's C
compiler (3.6; 3.9 has one generic launcher), so that the first launch finds it in the cache.  Each request
carries the parent's TRITON_* environment, whose variables are part of Triton's cache
key.  Best effort throughout: workers that cannot start, or one that dies or answers
nonsense, leave the kernels to compile at their first launch, as without workers."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

from egraph_compiler.errors import OptionError

from .triton_load import _write

WORKERS_ENV = "EGC_COMPILE_WORKERS"  # how many (0: none); default 8, at most the CPUs


def count() -> int:
    text = (os.environ.get(WORKERS_ENV) or "8").strip()  # (set but empty: the default)
    if not text.isdigit():
        raise OptionError(f"{WORKERS_ENV}={text!r}: expected how many compile workers to start, "
                          f"a whole number (0: none, each kernel compiles at its first launch)")
    return min(int(text), os.cpu_count() or 1)


class Workers:
    """A fixed set of children serving one request at a time (a lock: threads take turns)."""

    def __init__(self, size: int, target: tuple):
        prewarm, _ = _write(PREWARM)
        self.lock = threading.Lock()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled, not interpreted)
        self.children = [subprocess.Popen([sys.executable, "-c", _SERVE, json.dumps(target), str(prewarm)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env)
                         for _ in range(size)]

    def compile(self, path: str, specs: list, spread: int) -> tuple[int, int]:
        """Hand `specs` (function name, argument dtypes, launch options) of the module at `path`
        to `spread` children; returns (compiled, failed) as the children counted them."""
        with self.lock:
            busy = self.children[:max(1, min(spread, len(self.children)))]
            env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_") and k != "TRITON_INTERPRET"}
            for i, child in enumerate(busy):
                child.stdin.write(json.dumps([path, specs[i::len(busy)], env]) + "\n")
                child.stdin.flush()
            done = [0, 0]
            for child in busy:
                answer = child.stdout.readline().split()
                while answer[:1] == ["ready"]:  # (its start-up, once)
                    answer = child.stdout.readline().split()
                if answer[:1] != ["done"] or len(answer) != 3:
                    raise OSError(f"compile worker {child.pid} answered {answer!r}")
                done[0] += int(answer[1])
                done[1] += int(answer[2])
            return done[0], done[1]

    def close(self) -> None:
        for child in self.children:
            try:
                child.stdin.close()  # (a child exits at the end of its input)
            except OSError:
                pass
        for child in self.children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()


_POOL: list = [None]
_START = threading.Lock()


def start(target: tuple) -> Workers | None:
    """This process's workers, started on the first call (`target`: the GPU's
    (backend, architecture, warp size), which the children compile for)."""
    with _START:
        if _POOL[0] is not None:
            return _POOL[0]
        size = count()
        if size <= 0:
            return None
        try:
            _POOL[0] = Workers(size, target)
        except OSError:  # (no process or file to be had: the kernels compile at their first launch)
            return None
        return _POOL[0]


def discard(pool: Workers) -> None:
    """Stop a pool that failed (the next `start` makes another)."""
    with _START:
        if _POOL[0] is pool:
            _POOL[0] = None
    pool.close()


def _forked() -> None:
    """A forked process (a DataLoader's worker) lets go of its parent's workers: its copies of
    their pipes would keep them alive after the parent exits, and a lock may have been held."""
    global _START
    _START = threading.Lock()
    pool, _POOL[0] = _POOL[0], None
    for child in pool.children if pool is not None else ():
        for pipe in (child.stdin, child.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):
                pass


os.register_at_fork(after_in_child=_forked)


@atexit.register
def _close() -> None:
    if _POOL[0] is not None:  # (a forked process has none: _forked)
        _POOL[0].close()


PREWARM = """import triton
import triton.language as tl


@triton.jit
def egc_prewarm(x, y, n, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0)
    tl.store(y + i, tl.exp(v) / tl.sum(v, 0), mask=i < n)
"""

_SERVE = """
import importlib.util, json, os, sys
(backend, arch, warp), prewarm = json.loads(sys.argv[1]), sys.argv[2]
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
class Offline:  # the parent's GPU, for a machine whose Triton has no GPU driver (CI)
    def get_current_target(self):
        return GPUTarget(backend, arch, warp)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0
try:  # the parent's GPU, without a CUDA context here
    active = driver.active
    active.get_current_target, active.get_current_device, active.get_current_stream = (
        Offline().get_current_target, Offline().get_current_device, Offline().get_current_stream)
except Exception:
    driver.set_active(Offline())
try:  # a first kernel costs a Triton process ~1.5 s more than the next: paid while the parent saturates
    spec = importlib.util.spec_from_file_location("egc_prewarm", prewarm)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.egc_prewarm.warmup(torch.float32, torch.float32, 8, XBLOCK=128, grid=(1,))
except Exception:
    pass
print("ready", flush=True)
modules = {}
for line in sys.stdin:
    path, specs, env = json.loads(line)
    for key in [k for k in os.environ if k.startswith("TRITON_") and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    compiled = failed = 0
    try:
        if path not in modules:
            spec = importlib.util.spec_from_file_location(f"egc_warm_{len(modules)}", path)
            modules[path] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = modules[path]
            spec.loader.exec_module(modules[path])
        module = modules[path]
    except Exception:
        module, failed = None, len(specs)
    for name, dtypes, options in specs if module is not None else ():
        try:
            kernel = getattr(module, name).warmup(*[getattr(torch, d) if isinstance(d, str) else d for d in dtypes],
                                                  grid=(1,), **options)
            compiled += 1
        except Exception:
            failed += 1
            continue
        try:  # its launcher too: Triton 3.6 builds a C stub per kernel signature with the host's compiler
            launcher = getattr(driver.active, "launcher_cls", None)  # at the first launch (7 of them took
            if launcher is not None:  # BERT's first call 2 s, serially): built here, in parallel, into
                launcher(kernel.src, kernel.metadata)  # the cache where that launch finds it
        except Exception:
            pass
    print("done", compiled, failed, flush=True)
"""
