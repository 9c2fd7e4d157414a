"""Split column reductions for Triton: a sum over many rows of each column (a bias's
or a norm weight's gradient in training: 4,096 rows of 512 columns) as two kernels.

As one kernel, a program per column reads each row's element from its own memory
sector, and a program per block of adjacent columns leaves most of a GPU idle (tried:
1.2-4.7x slower still, BENCHMARKS.md).  So `{name}_part` sums a chunk of rows for a
block of adjacent columns (its reads coalesced along the columns; column blocks x
chunks programs) into a float32 workspace, and `{name}` adds each column's partial
sums up and stores what the kernel stores, as Inductor's split reductions do.
Only kernels whose reductions are independent sums and whose stores are per column.
"""
from __future__ import annotations

from egraph_compiler.loopir import STASH, Acc, Call, Gather, LoopKernel, loads, stride

SPLIT_TILE = (32, 64)  # columns x rows of a partial sum's step
SPLIT_PROGRAMS = 528  # programs to aim for: four per SM of an H200 (132 SMs)
SPLIT_MIN_ROWS = 1024  # fewer rows: one kernel
WORKSPACE = "egc_ws"


def split_rows(k: LoopKernel) -> tuple[int, int]:
    """(programs per column block along the rows, rows per program); (1, inner) when
    the kernel is not split."""
    if not _splittable(k):
        return 1, k.inner
    blocks = -(-k.outer // SPLIT_TILE[0])
    split = max(1, min(-(-k.inner // SPLIT_TILE[1]), -(-SPLIT_PROGRAMS // blocks)))
    chunk = -(-(-(-k.inner // split)) // SPLIT_TILE[1]) * SPLIT_TILE[1]  # a multiple of the row step
    return -(-k.inner // chunk), chunk


def _splittable(k: LoopKernel) -> bool:
    stores = [(k.store_param, k.store_index, k.value, k.store_in_inner)] + list(k.extra_stores)
    return (bool(k.reductions) and k.inner >= SPLIT_MIN_ROWS and not k.stash_last
            and not any(s[3] for s in stores)
            and all(r.combiner == "sum" and r.dtype == "float32" and not _reads_acc(r.body) for r in k.reductions)
            and _column_major(k))


def _column_major(k: LoopKernel) -> bool:
    """Reductions that read matrices along their columns: consecutive rows (inner
    indices) a stride apart, consecutive columns (outer indices) side by side.  A vector
    read per row or per column (a norm's row statistics) is a broadcast, and decides nothing."""
    strides = [(stride(e.index, "r"), stride(e.index, "o")) for red in k.reductions for e in loads(red.body)
               if e.param != STASH]
    matrices = [(r, o) for r, o in strides if r and o]
    return bool(matrices) and all(r > 1 and o == 1 for r, o in matrices)


def _reads_acc(e) -> bool:
    if isinstance(e, Acc):
        return True
    if isinstance(e, Call):
        return any(_reads_acc(a) for a in e.args)
    return isinstance(e, Gather) and (_reads_acc(e.value) or _reads_acc(e.row))


def render(shape, params: str, store_lines) -> str:
    """The two kernels of a split column reduction (`shape`: triton._Kernel)."""
    k, split, chunk = shape.k, shape.split, shape.chunk
    head = ["    o = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]", f"    omask = o < {k.outer}"]
    part = ["@triton.jit", f"def {k.name}_part({params}, {WORKSPACE}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
            *head, "    s = tl.program_id(1)"]
    part += [f"    {red.acc}_b = tl.zeros([XBLOCK, RBLOCK], tl.float32)" for red in k.reductions]
    part.append(f"    for r0 in range(0, {chunk}, RBLOCK):")
    part += shape._columns(f"s * {chunk} + r0", "        ")
    part += [f"        {red.acc}_b = {red.acc}_b + tl.where(mask, {shape.expr(red.body)}, 0.0)" for red in k.reductions]
    part += [f"    tl.store({WORKSPACE} + ({i * split} + s) * {k.outer} + o, tl.sum({red.acc}_b, axis=1, "
             f"keep_dims=True), mask=omask)" for i, red in enumerate(k.reductions)]
    final = ["@triton.jit", f"def {k.name}({params}, {WORKSPACE}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
             *head, f"    s = tl.arange(0, {1 << (split - 1).bit_length()})[None, :]", f"    smask = omask & (s < {split})"]
    final += [f"    {red.acc} = tl.sum(tl.load({WORKSPACE} + ({i * split} + s) * {k.outer} + o, mask=smask, other=0), "
              f"axis=1, keep_dims=True)" for i, red in enumerate(k.reductions)]
    return "\n".join(part + [""] * 2 + final + store_lines)


def launcher(module, k: LoopKernel, shape, options: dict, part_sizes: tuple = (), final_sizes: tuple = ()):
    """run(tensors, extra): both launches over one workspace, allocated per call (from a
    CUDA graph's pool when recorded); `extra`: the arguments after the tensors (a flag); each
    kernel's sizes, in a template's build (triton_load.py), after the workspace."""
    import torch
    part, final = getattr(module, f"{k.name}_part"), getattr(module, k.name)
    blocks = -(-k.outer // shape.xblock)
    size = len(k.reductions) * shape.split * k.outer

    def run(tensors, extra):
        workspace = torch.empty(size, dtype=torch.float32, device=tensors[0].device)
        part[(blocks, shape.split)](*tensors, *extra, workspace, *part_sizes, **options)
        final[(blocks,)](*tensors, *extra, workspace, *final_sizes, **options)
    return run
