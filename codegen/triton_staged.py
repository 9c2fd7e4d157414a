"""Long rows in turn: a persistent row kernel (the whole row in registers) of one input read
along its rows, of at least MIN_ROW elements, loops over its rows on a grid of one program per
SM, and Triton's pipeliner stages the next rows' loads in shared memory while this row reduces.
One row per program leaves an SM idle through each row's reductions: bf16 softmax over 32k rows
reached 72-75% of the copy bandwidth on an H200 so, 85-89% staged (BENCHMARKS.md).  Shorter rows
gain nothing (one program per row keeps enough loads in flight), and rows of several inputs
(layer_norm's weights) need a stage of each in shared memory, which does not fit."""
from __future__ import annotations

from egraph_compiler.cost import itemsize
from egraph_compiler.loopir import STASH, LoopKernel, expressions, loads, variables

from . import triton_load

MIN_ROW = 32768
STAGES = 3
SHARED = 200 * 1024  # bytes of staged rows (sm_90 gives a block 227 KB; triton_build checks what is used)
_PROGRAMS: list = []


def stages(k: LoopKernel, rblock: int) -> bool:
    """Whether a persistent row kernel loops over its rows with staged loads: a row of at least
    MIN_ROW elements read from one input, whose STAGES - 1 rows in flight fit in SHARED."""
    if k.inner < MIN_ROW:
        return False
    rows = {(e.param, e.index) for v in expressions(k) for e in loads(v)
            if e.param != STASH and "r" in variables(e.index)}
    if len(rows) != 1:
        return False
    (param, _), = rows
    return rblock * itemsize(next(p.dtype for p in k.params if p.name == param)) * (STAGES - 1) <= SHARED


def loop(k: LoopKernel, body: list[str]) -> list[str]:
    """A kernel body (its rows from `tl.program_id(0)`) as the loop over its row blocks."""
    head = (f"    for egc_row in tl.range(tl.program_id(0), tl.cdiv({k.outer}, XBLOCK), tl.num_programs(0), "
            f"num_stages={STAGES}):")
    return [head] + ["    " + line.replace("tl.program_id(0)", "egc_row") for line in body]


def programs() -> int:
    """Programs of a staged kernel: one per SM of the current GPU (4 under the interpreter)."""
    if not _PROGRAMS:
        import torch
        interpreted = triton_load.interpreted() or not torch.cuda.is_available()
        _PROGRAMS.append(4 if interpreted else
                         torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return _PROGRAMS[0]
