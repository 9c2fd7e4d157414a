"""Loading a rendered Triton module: write it into the cache (Triton reads a kernel's
source from its file), import it once per process, and wrap each kernel as a launch
over its grid; and the Triton side of sizes as arguments (codegen/sizes.py): a
template's kernels take the sizes they read as int arguments before their block sizes,
which Triton specialises as it does any int (equal to 1, divisible by 16, 32 or 64 bits),
so one compiled kernel serves every size of a class, as Inductor's dynamic kernels do."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import sys

from egraph_compiler import remote
from egraph_compiler.cache import cache_dir
from egraph_compiler.loopir import ERROR_FLAG, LoopKernel, has_gather

from .sizes import Sized


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, read when triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_MODULES: dict = {}  # path -> the module imported from it (its JITFunctions keep their compiled kernels)
_WARMED: set = set()  # (module path, the sizes' specialisation) compiled ahead in this process


def _module_path(source: str):
    return cache_dir() / f"egc_triton_{hashlib.sha256(source.encode()).hexdigest()[:24]}.py"


def _write(source: str):
    """The module's file in the cache, written (atomically) unless it holds `source` already;
    returns (path, whether it was written)."""
    path = _module_path(source)
    if path.exists() and path.read_text() == source:
        return path, False
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(source)
    os.replace(tmp, path)
    return path, True


def _import(source: str):
    path, written = _write(source)
    if not written and path in _MODULES:
        return _MODULES[path]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton resolves the kernels' globals through the module
    spec.loader.exec_module(module)
    _MODULES[path] = module
    return module


def load_module(source: str, kernels: list[LoopKernel], autotune: bool = False, sizes: list[int] | None = None):
    """Import the module and wrap each kernel as a launch over its grid; `sizes`: this program's
    sizes in a template's build (each kernel passes those it reads, `size_params`)."""
    from . import triton_split, triton_tune
    from .triton import _Kernel
    from .triton_build import WARM_MIN_KERNELS, warm_in_parallel
    from .triton_launch import checked, direct
    share_triton_cache()
    path = _module_path(source)
    compiled_now = not path.exists()
    module = _import(source)
    named = {name: [(f"egc_s{i}", sizes[i]) for i in slots]
             for name, slots in (size_params(source) if sizes is not None else {}).items()}
    args = {name: tuple(v for _, v in pairs) for name, pairs in named.items()}
    tune = triton_tune.enabled(autotune)
    classes = (path, tuple(specialisation(s) for s in sizes or ()))
    if (sizes is not None and classes not in _WARMED) or compiled_now:  # (a template, sizes of a new class)
        _WARMED.add(classes)
        if len(kernels) >= WARM_MIN_KERNELS and not interpreted():
            warm_in_parallel(source, kernels, tune, named)
        compiled_now = True
    calls = {}
    for k in kernels:
        shape = _Kernel(k)
        if shape.split > 1:
            run = triton_split.launcher(module, k, shape, launch_options(k, shape),
                                        args.get(f"{k.name}_part", ()), args.get(k.name, ()))
        elif tune:  # block sizes and warps settled at the first launch (triton_tune.py)
            run = triton_tune.Tuned(functools.partial(_configured_launch, getattr(module, k.name), k, shape,
                                                      args.get(k.name, ())), shape, shape.render())
        else:
            run = direct(getattr(module, k.name), shape.grid(), launch_options(k, shape), args.get(k.name, ()))
        calls[k.name] = checked(run, k.name) if has_gather(k) else (lambda *tensors, run=run: run(tensors, ()))
        calls[k.name].tuned = run if isinstance(run, triton_tune.Tuned) else None  # (Executable.launch_configs)
    return calls, compiled_now


def _configured_launch(fn, k: LoopKernel, shape, sizes: tuple, config):
    from .triton_launch import direct
    from .triton_tune import configured
    tuned = configured(shape, config)
    return direct(fn, tuned.grid(), launch_options(k, tuned), sizes)


def specialisation(size: int) -> tuple:
    """What Triton specialises an int argument on: 1, divisible by 16, fits 32 bits."""
    return size == 1, size % 16 == 0, -(1 << 31) <= size < (1 << 31)


def kernel_functions(k: LoopKernel, shape, sizes: dict | None = None) -> list[tuple[str, list[tuple]]]:
    """A loop kernel's Triton functions, each with its parameters in order: (name, dtype) for
    tensors, (name, value) for a template's sizes (`sizes`: function name -> those pairs)."""
    from . import triton_split
    params = [(p.name, p.dtype) for p in k.params] + ([(ERROR_FLAG, "int32")] if has_gather(k) else [])
    names = [f"{k.name}_part", k.name] if shape.split > 1 else [k.name]
    if shape.split > 1:
        params.append((triton_split.WORKSPACE, "float32"))
    return [(name, params + list((sizes or {}).get(name, ()))) for name in names]


def launch_options(k: LoopKernel, shape) -> dict:
    """Block sizes and compile options of a kernel's launches.  No fused multiply-add: torch
    rounds every op, and a contracted `x*x - max(x*x)` is not 0 (exp of it overflows
    softmax; see tests/test_regressions.py).  A kernel with gathers runs with `debug`, so
    that its device asserts fire (as Inductor's indirect indexing does), without the
    integer overflow checks that debug would also add where Triton can leave them out."""
    from .triton_launch import has_option
    options = dict(XBLOCK=shape.xblock, RBLOCK=shape.rblock, num_warps=shape.warps, enable_fp_fusion=False)
    if has_gather(k):
        options["debug"] = True
        if has_option("sanitize_overflow"):
            options["sanitize_overflow"] = False
    return options


def share_triton_cache() -> None:
    """With EGC_REMOTE_CACHE set, Triton's cache manager (TRITON_CACHE_MANAGER, unless
    the user set one) becomes triton_cache.SharedCacheManager, for this process and the
    compile workers it starts: every Triton kernel compiled here, Inductor's included,
    is stored in the shared cache, and one compiled elsewhere is fetched instead."""
    if os.environ.get(remote.URL_ENV) and not os.environ.get("TRITON_CACHE_MANAGER"):
        os.environ["TRITON_CACHE_MANAGER"] = "egraph_compiler.codegen.triton_cache:SharedCacheManager"


# --- sizes as arguments -------------------------------------------------------------------------

_DEF = re.compile(r"^def (\w+)\(([^)]*)\):", re.M)
_CONSTANT = re.compile(r"(tl\.arange\(|tl\.full\(\[|tl\.zeros\(\[|axis=|tl\.program_id\()[^()]*$")


def _fixed(line: str, column: int) -> bool:
    """A literal Triton needs as a constant: a block's shape (`tl.arange`, `tl.full`), an axis, a
    program axis.  Divisors may be sizes: Triton divides by a runtime int as Inductor's dynamic
    kernels do (BENCHMARKS.md has what that costs on the H200)."""
    return _CONSTANT.search(line[:column]) is not None


def _with_sizes(text: str, count: int) -> str:
    """Each kernel takes the sizes its body reads, in order, before its block sizes."""
    chunks = text.split("\n@triton.jit\n")
    out = [chunks[0]]
    for chunk in chunks[1:]:
        used = sorted({int(i) for i in re.findall(r"\begc_s(\d+)\b", chunk)})
        if used:
            head, rest = chunk.split(", XBLOCK: tl.constexpr", 1)
            chunk = head + "".join(f", egc_s{i}" for i in used) + ", XBLOCK: tl.constexpr" + rest
        out.append(chunk)
    return "\n@triton.jit\n".join(out)


def size_params(source: str) -> dict[str, list[int]]:
    """Per Triton function of a template, the sizes it takes, in order."""
    return {name: [int(i) for i in re.findall(r"\begc_s(\d+)\b", params)]
            for name, params in _DEF.findall(source) if "egc_s" in params}


SIZED = Sized(fixed=_fixed, slot=lambda i: f"egc_s{i}", finish=_with_sizes,
              note=lambda sizes: "# sizes as arguments (codegen/sizes.py): " +
              ", ".join(f"egc_s{i} = {v}" for i, v in enumerate(sizes)) + "\n")
