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
    return _split(-(-k.outer // SPLIT_TILE[0]), k.inner)


def split_pieces(k: LoopKernel, parts: list[LoopKernel]) -> tuple[int, int] | None:
    """(split, rows per program) shared by the pieces of a column sum over a cat (pieces.py:
    `cat(dq, dk, dv)` summed over tokens, GPT-2's qkv bias gradient), each piece's partial sums
    written at its own columns of the workspace; None where the pieces do not split so.  Its
    pieces unsplit read a column per program down 4,096 rows (39 us per layer on the H200)."""
    index = k.store_index
    identity = index.const == 0 and len(index.terms) == 1 and index.terms[0][0][:2] == ("var", "o") \
        and index.terms[0][1] == 1  # (the store's offset in each piece is its columns' offset)
    if len(parts) < 2 or not identity or k.extra_stores or k.store_in_inner or k.inner < SPLIT_MIN_ROWS:
        return None
    if not all(_splittable(p) and not p.extra_stores for p in parts):
        return None
    return _split(sum(-(-p.outer // SPLIT_TILE[0]) for p in parts), k.inner)


def _split(blocks: int, rows: int) -> tuple[int, int]:
    split = max(1, min(-(-rows // SPLIT_TILE[1]), -(-SPLIT_PROGRAMS // blocks)))
    chunk = -(-(-(-rows // split)) // SPLIT_TILE[1]) * SPLIT_TILE[1]  # a multiple of the row step
    return -(-rows // chunk), chunk


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


def render(shape, params: str, store_lines, columns=None) -> str:
    """The two kernels of a split column reduction (`shape`: triton._Kernel); split pieces
    (`shape.pieces`) sum in one `_part` launch, a body per piece (the grid's third axis),
    each at its columns (`columns`: each piece's store index, rendered)."""
    k, split = shape.k, shape.split
    head = ["    o = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]", f"    omask = o < {k.outer}"]
    part = ["@triton.jit", f"def {k.name}_part({params}, {WORKSPACE}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):"]
    if len(shape.pieces) > 1:
        for i, (piece, column) in enumerate(zip(shape._piece_shapes, columns)):
            part += [f"    if tl.program_id(2) == {i}:"] + ["    " + line for line in _partial_sums(piece, column, k.outer)]
    else:
        part += _partial_sums(shape, "o", k.outer)
    final = ["@triton.jit", f"def {k.name}({params}, {WORKSPACE}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
             *head, f"    s = tl.arange(0, {1 << (split - 1).bit_length()})[None, :]", f"    smask = omask & (s < {split})"]
    final += [f"    {red.acc} = tl.sum(tl.load({WORKSPACE} + ({i * split} + s) * {k.outer} + o, mask=smask, other=0), "
              f"axis=1, keep_dims=True)" for i, red in enumerate(k.reductions)]
    return "\n".join(part + [""] * 2 + final + store_lines)


def _partial_sums(shape, column: str, columns: int) -> list[str]:
    """A `_part` body: this program's chunk of rows of a block of columns, summed into the
    workspace at `column` (of `columns` per partial sum)."""
    k, split, chunk = shape.k, shape.split, shape.chunk
    lines = ["    o = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]", f"    omask = o < {k.outer}",
             "    s = tl.program_id(1)"]
    lines += [f"    {red.acc}_b = tl.zeros([XBLOCK, RBLOCK], tl.float32)" for red in k.reductions]
    lines.append(f"    for r0 in range(0, {chunk}, RBLOCK):")
    lines += shape._columns(f"s * {chunk} + r0", "        ")
    lines += [f"        {red.acc}_b = {red.acc}_b + tl.where(mask, {shape.expr(red.body)}, 0.0)" for red in k.reductions]
    return lines + [f"    tl.store({WORKSPACE} + ({i * split} + s) * {columns} + {column}, tl.sum({red.acc}_b, "
                    f"axis=1, keep_dims=True), mask=omask)" for i, red in enumerate(k.reductions)]


def launcher(module, k: LoopKernel, shape, options: dict, part_sizes: tuple = (), final_sizes: tuple = ()):
    """run(tensors, extra): both launches over one workspace, allocated per call (from a
    CUDA graph's pool when recorded); `extra`: the arguments after the tensors (a flag); each
    kernel's sizes, in a template's build (triton_load.py), after the workspace."""
    import torch
    part, final = getattr(module, f"{k.name}_part"), getattr(module, k.name)
    blocks = -(-k.outer // shape.xblock)
    size = len(k.reductions) * shape.split * k.outer
    grid = (blocks, shape.split) if len(shape.pieces) == 1 else \
        (max(-(-p.outer // shape.xblock) for p in shape.pieces), shape.split, len(shape.pieces))

    def run(tensors, extra):
        workspace = torch.empty(size, dtype=torch.float32, device=tensors[0].device)
        part[grid](*tensors, *extra, workspace, *part_sizes, **options)
        final[(blocks,)](*tensors, *extra, workspace, *final_sizes, **options)
    return run
