"""Compiling rendered Triton modules ahead of their first launch: for this
machine's GPU in compile workers (`warm_in_parallel`; triton_workers.py, as Inductor's
compile workers do), or for another GPU on a machine without one (`compile_for_gpu`,
how CI checks that what the interpreter runs, a GPU's compiler accepts).
Kernels compile with the options their launches use (`triton.launch_options`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from egraph_compiler.errors import CodegenError
from egraph_compiler.loopir import LoopKernel

from . import triton_tune
from .triton import _Kernel
from .triton_load import (_import, _module_path, interpreted, kernel_functions, launch_options, share_triton_cache,
                          size_params)

WARM_MIN_KERNELS = 8  # fewer kernels compile about as fast in this process as in the workers


def start_workers() -> None:
    """Start this process's compile workers (triton_workers.py) while the e-graph works."""
    from .triton_launch import gpu_target
    from .triton_workers import start
    if not interpreted():
        share_triton_cache()  # (the workers take its cache manager from the environment)
        start(gpu_target())


def warm_in_parallel(source: str, kernels: list[LoopKernel], tune: bool = False,
                     sizes: dict | None = None) -> tuple[int, int]:
    """Compile a module's kernels for this machine's GPU in this process's compile workers
    (triton_workers.py): each runs `warmup` on its share, which stores the binaries in
    Triton's on-disk cache, where this process's first launch finds them (`tune`: every
    candidate configuration; `sizes`: a template's (name, value) size arguments per
    function, compiled for their values' class).  Returns (compiled, failed) as the
    workers counted them.  Best effort: a kernel no worker compiled is compiled at its
    first launch, as before (errors surface there)."""
    from .triton_launch import gpu_target
    from .triton_workers import discard, start
    path = _module_path(source)
    specs = [(name, [dtype for _, dtype in params], launch_options(k, shape))  # (each candidate, where tuned)
             for k in kernels if f"def {k.name}(" in source  # (a repeated kernel runs another's code)
             for shape in triton_tune.to_compile(_Kernel(k), tune)
             for name, params in kernel_functions(k, shape, sizes)]
    pool = start(gpu_target())
    if pool is None or not specs:
        return 0, 0
    try:
        return pool.compile(str(path), specs, -(-len(specs) // 4))
    except (OSError, ValueError):  # (a worker died: the kernels compile at their first launch)
        discard(pool)
        return 0, len(specs)


SIGNATURE = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "bool": "*i1", "int64": "*i64",
             "int32": "*i32", "uint8": "*u8", "int8": "*i8", "int16": "*i16"}


# bytes of shared memory one block may use, by compute capability (sm_90: 227 KB)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def compile_for_gpu(modules: list[tuple[str, list[LoopKernel]]], arch: int = 90, candidates: bool = False) -> None:
    """Compile every kernel of rendered modules, (source, loop kernels) pairs,
    for an NVIDIA GPU of this compute capability, down to a cubin, on any
    machine (no GPU needed): what the interpreter accepts and a GPU's compiler
    refuses (types, constants) fails here.  Runs in one child Python without
    TRITON_INTERPRET (which replaces triton.language's own functions in this
    process); raises CodegenError with the compiler's message and the module.
    `candidates`: with every launch configuration the tuner may try (triton_tune.py); a
    template's sizes (codegen/sizes.py) compile as 32-bit ints."""
    share_triton_cache()
    specs = []
    for source, kernels in modules:
        path = _module_path(source)
        if not path.exists() or path.read_text() != source:
            _import(source)
        sized = {name: [(f"egc_s{i}", 2) for i in slots] for name, slots in size_params(source).items()}
        specs += [(str(path), name, {p: SIGNATURE.get(dtype, "i32") for p, dtype in params}, launch_options(k, shape))
                  for k in kernels for shape in triton_tune.to_compile(_Kernel(k), candidates)
                  for name, params in kernel_functions(k, shape, sized)
                  if f"def {k.name}(" in source]  # (a repeated kernel runs another's code: walker.unique_kernels)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    limit = f"SHARED_LIMIT = {SHARED_LIMIT.get(arch, SHARED_LIMIT[90])}\n"
    done = subprocess.run([sys.executable, "-c", limit + _GPU_COMPILE, json.dumps(specs), str(arch)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise CodegenError(f"Triton refuses a kernel for sm_{arch}:\n{done.stderr[-3000:]}")


_GPU_COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
specs, arch, modules = json.loads(sys.argv[1]), int(sys.argv[2]), {}
for path, name, signature, options in specs:
    xblock, rblock = options.pop("XBLOCK"), options.pop("RBLOCK")
    if path not in modules:
        spec = importlib.util.spec_from_file_location(f"egc_gpu_check_{len(modules)}", path)
        modules[path] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = modules[path]
        spec.loader.exec_module(modules[path])
    src = triton.compiler.ASTSource(fn=getattr(modules[path], name), signature=signature | {
        "XBLOCK": "constexpr", "RBLOCK": "constexpr"}, constexprs={"XBLOCK": xblock, "RBLOCK": rblock})
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:
        sys.exit(f"{path}: {name}: {exc}")
    if kernel.metadata.shared > SHARED_LIMIT:  # (the launch would fail with OutOfResources)
        sys.exit(f"{path}: {name}: {kernel.metadata.shared} bytes of shared memory, over sm_{arch}'s {SHARED_LIMIT}")
"""
