"""Triton renderer: loop IR -> one `@triton.jit` function per kernel (its loader, which
writes the module into the cache, imports it and launches on a grid: triton_load.py).

A kernel computes a block of XBLOCK outer indices (rows) against RBLOCK inner
indices: `o` is a column [XBLOCK, 1], `r` a row [1, RBLOCK].  Pointwise kernels
tile both over a 2-D grid.  Row kernels keep a whole row in registers when it
fits (persistent: each reduction is one `tl.sum`/`tl.max`, and the stashed
body is a value reused by the store, so the input is read once); longer rows
loop over RBLOCK chunks.  Arithmetic runs in float32; half-precision buffers
are widened when loaded and rounded when stored.  This module and its siblings
(triton_table.py: scalar formulas, dtypes, jit helpers; triton_load.py: loading;
triton_launch.py: launches; triton_tune.py: launch configurations; triton_staged.py: long
rows looped over on one program per SM; triton_build.py: ahead-of-time compiles;
triton_cache.py, which Triton loads as its cache manager) are the only code that imports
triton; CPU tensors run under the Triton interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from egraph_compiler.errors import EgraphCompilerError
from egraph_compiler.loopir import (ERROR_FLAG, STASH, Acc, Affine, Load, LoopKernel, contains, has_gather,
                                    substitute, transposed_reads, variables)
from egraph_compiler.pieces import pieces

from . import triton_split, triton_staged
from .triton_load import SIZED, interpreted as _interpreted
from .triton_table import FIELDS, PRELUDE, TL
from .walker import Target, render_expr, render_index

PERSISTENT_MAX = 32768  # longest row kept in registers (87-91% of copy bandwidth at 16k on an H200)
LOOP_BLOCK = 8192  # a looped row's chunk, 16 warps: 90% of copy for ln_relu at 32k on an H100, 47% at 2048 (BENCHMARKS.md)
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel
TILE = 32  # a transposing pointwise kernel's block: 2*TILE rows (o) by TILE columns (r)


class _Kernel:
    """Renders one loop kernel: its launch shape and its body lines."""

    def __init__(self, k: LoopKernel, splittable: bool = True):
        self.k = k
        self.types = {p.name: p.dtype for p in k.params}
        self._outer = False  # rendering the stores made once per outer index (a load's mask: `load`)
        self.pointwise = not k.reductions and all(s[3] for s in self.stores())
        self.looped = not self.pointwise and k.inner > PERSISTENT_MAX
        if self.pointwise:
            self.rblock = min(_pow2(k.inner), POINTWISE_BLOCK)
            self.xblock = max(1, min(POINTWISE_BLOCK // self.rblock, _pow2(k.outer)))
        else:
            self.rblock = LOOP_BLOCK if self.looped else _pow2(k.inner)
            self.xblock = max(1, min(2048 // self.rblock, _pow2(k.outer), 64))
        self.warps = 8 if self.rblock * self.xblock >= 4096 else 4
        if self.rblock >= 8192:  # (generated rows on the H200, BENCHMARKS.md: 16k rows 77-82% with 32)
            self.warps = 16 if self.rblock < 16384 else 32
        self.split, self.chunk = triton_split.split_rows(k) if splittable else (1, k.inner)
        if self.split > 1:  # a column reduction over many rows: partial sums, then their sum (triton_split.py)
            self.xblock, self.rblock = triton_split.SPLIT_TILE
            self.looped, self.warps = True, 4
        # a reduction over a cat: one body per operand's part of the domain (pieces.py), chosen by the
        # grid's third axis, each reading its operand alone (the `where` form loads every operand: a
        # qkv bias's gradient 79 -> 32 us on the H200).  A pointwise cat keeps the `where`: in pieces
        # the H200 took 27-28 us for a qkv cat that the `where` form does in 20 (BENCHMARKS.md)
        parts = pieces(k) if self.split <= 1 and not self.pointwise else [k]
        shapes = [_Kernel(p, splittable=False) for p in parts] if len(parts) > 1 else []
        shared = triton_split.split_pieces(k, parts) if splittable and shapes else None
        if shared:  # a column sum over a cat: every piece split alike (triton_split.split_pieces)
            for s in [self] + shapes:
                s.split, s.chunk = shared
                (s.xblock, s.rblock), s.looped, s.warps = triton_split.SPLIT_TILE, True, 4
        elif any(s.split > 1 or s.pointwise != self.pointwise or s.looped != self.looped for s in shapes):
            parts, shapes = [k], []  # (pieces of other shapes than the whole's: one body)
        self.pieces, self._piece_shapes = parts, shapes
        for s in shapes:  # a piece runs under the whole kernel's launch: RBLOCK is the whole's (a row
            s.rblock = self.rblock  # that fills its own smaller block is no row that fills RBLOCK: `_columns`)
        if self.pointwise and transposed_reads(k) and k.outer >= TILE and k.inner >= TILE:
            self.xblock, self.rblock = 2 * TILE, TILE  # reads along o, writes along r: both in runs
        self.staged = (not self.pointwise and not self.looped and self.split <= 1 and len(self.pieces) == 1
                       and triton_staged.stages(k, self.rblock))

    def stores(self):
        k = self.k
        return [(k.store_param, k.store_index, k.value, k.store_in_inner)] + list(k.extra_stores)

    def grid(self) -> tuple:
        if len(self.pieces) > 1:
            return (max(-(-p.outer // self.xblock) for p in self.pieces),
                    max(-(-p.inner // self.rblock) for p in self.pieces) if self.pointwise else 1, len(self.pieces))
        outer = -(-self.k.outer // self.xblock)
        if self.staged:
            return (max(1, min(outer, triton_staged.programs())),)
        return (outer, -(-self.k.inner // self.rblock)) if self.pointwise else (outer,)

    def load(self, e: Load) -> str:
        if e.param == STASH:
            return "stash"
        index = render_index(e.index, TABLE)
        names = variables(e.index) & {"o", "r"}  # (a gather's row is already in range)
        mask = {frozenset(): None, frozenset({"o"}): "omask", frozenset({"r"}): "rmask"}.get(frozenset(names), "mask")
        if self.k.inner == 0 or self.k.outer == 0:  # an empty domain: a loop variable of no values left the
            mask = "omask" if self._outer else "mask"  # index, and the buffer may hold nothing to read at all
            index += " + o * 0" if self._outer else " + o * 0 + r * 0"  # (a block, as its mask)
        text = f"tl.load({e.param} + ({index})" + (f", mask={mask}, other=0)" if mask else ")")
        # narrow floats compute in float32; integers stay integers (computed exactly)
        return f"{text}.to(tl.float32)" if self.types[e.param] in ("float16", "bfloat16") else text

    def expr(self, e) -> str:
        return render_expr(e, TABLE, self.load, types=self.types)

    def render(self) -> str:
        k = self.k
        params = ", ".join([p.name for p in k.params] + ([ERROR_FLAG] if has_gather(k) else []))
        if self.split > 1:
            columns = [render_index(s.k.store_index, TABLE) for s in self._piece_shapes]
            return triton_split.render(self, params, self._outer_stores(), columns)
        lines = ["@triton.jit", f"def {k.name}({params}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):"]
        if self.staged:  # rows in turn, the next ones' loads staged in shared memory (triton_staged.py)
            return "\n".join(lines + triton_staged.loop(k, self._body()))
        if len(self.pieces) == 1:
            return "\n".join(lines + self._body())
        for i, shape in enumerate(self._piece_shapes):  # (blocks past a piece's extent are masked off whole)
            lines += [f"    if tl.program_id(2) == {i}:"] + ["    " + line for line in shape._body()]
        return "\n".join(lines)

    def _body(self) -> list[str]:
        k = self.k
        lines = ["    o = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]", f"    omask = o < {k.outer}"]
        if self.pointwise:
            lines += self._columns("tl.program_id(1) * RBLOCK", "    ")
            return lines + self._inner_stores("    ")
        if not self.looped:
            lines += self._columns("0", "    ", even=0 < k.inner == self.rblock)
        for group in self._passes():
            if len(group) == 1:
                lines += self._reduction(*group[0])
            else:
                lines += self._looped_sums(group) if self.looped else self._sums(group)
        stores = self.stores()
        if any(s[3] for s in stores):
            if self.looped:
                lines.append(f"    for r0 in range(0, {k.inner}, RBLOCK):")
                lines += self._columns("r0", "        ")
                lines += self._inner_stores("        ")
            else:
                lines += self._inner_stores("    ")
        return lines + self._outer_stores()

    def _outer_stores(self) -> list[str]:
        """The stores made once per outer index (a reduction's result)."""
        self._outer = True
        try:
            return [f"    tl.store({param} + ({render_index(index, TABLE)}) + o * 0, "
                    f"{self._cast_out(param, self.expr(value))}, mask=omask)"
                    for param, index, value, in_inner in self.stores() if not in_inner]
        finally:
            self._outer = False

    def _columns(self, start: str, pad: str, even: bool = False) -> list[str]:
        """The row's columns and masks.  `even`: a row kept in registers fills its block exactly, so the
        mask along it is `r < RBLOCK`, which Triton folds away, as it folds `r < 8192` of a literal
        build; in a template (codegen/sizes.py) `r < egc_s0` stays a mask on every element (softmax on
        the H200: 16k rows 52-68% of the copy bandwidth -> 92-93%).  A template serves only programs
        rendered alike, so rows of another length than their block keep their literal mask."""
        bound = "RBLOCK" if even else self.k.inner
        return [f"{pad}r = {start} + tl.arange(0, RBLOCK)[None, :]", f"{pad}rmask = r < {bound}",
                f"{pad}mask = omask & rmask"]

    def _passes(self) -> list[list]:
        """The reductions in loop order; consecutive float32 sums that do not read each other's
        results are grouped: a looped kernel takes them in one pass over the row (layer_norm's centred
        sum and sum of squares: three passes over a long row, then the store's, instead of four), a row
        kept in registers as one reduction of a tuple of up to three (`_sums`).  Not in Triton's
        interpreter: it reduces a tuple element by element along the row, so a float32 sum of 16k
        equal terms drifted by 1e-3 relative (soak 43002:0:161, a layer_norm's variance), where
        `tl.sum` is numpy's pairwise sum; a GPU reduces either as a tree."""
        groups: list[list] = []
        tree = self.looped or not _interpreted()
        for i, red in enumerate(self.k.reductions):
            joins = (tree and groups and red.combiner == "sum" and red.dtype == "float32" and (self.looped or len(groups[-1]) < 3)
                     and all(r.combiner == "sum" and r.dtype == "float32" and not contains(red.body, Acc(r.acc))
                             for _, r in groups[-1]))
            if joins:
                groups[-1].append((i, red))
            else:
                groups.append([(i, red)])
        return groups

    def _sums(self, group) -> list[str]:
        """Independent float32 sums over a row kept in registers, as one reduction of a tuple: one
        tree (each sum's own, as tl.sum's) and its barriers shared (layer_norm's centred sum and sum
        of squares: +4 points of the copy bandwidth at 16k and 32k on the H200, BENCHMARKS.md)."""
        last = len(self.k.reductions) - 1
        values = []
        lines = []
        for i, red in group:
            name = "stash" if self.k.stash_last and i == last else f"{red.acc}_v"
            lines.append(f"    {name} = {self.expr(red.body)}")
            values.append(f"tl.where(mask, {name}, 0.0)")
        accs = ", ".join(red.acc for _, red in group)
        return lines + [f"    {accs} = tl.reduce(({', '.join(values)}), 1, _egc_add{len(group)}, keep_dims=True)"]

    def _looped_sums(self, group) -> list[str]:
        """float32 sums over a long row, accumulated together in one loop over its chunks."""
        lines = [f"    {red.acc}_b = tl.full([XBLOCK, RBLOCK], 0.0, tl.float32)" for _, red in group]
        lines.append(f"    for r0 in range(0, {self.k.inner}, RBLOCK):")
        lines += self._columns("r0", "        ")
        for _, red in group:
            lines += [f"        {red.acc}_v = {self.expr(red.body)}",
                      f"        {red.acc}_b = {red.acc}_b + tl.where(mask, {red.acc}_v, 0.0)"]
        return lines + [f"    {red.acc} = tl.sum({red.acc}_b, axis=1, keep_dims=True)" for _, red in group]

    def _reduction(self, i: int, red) -> list[str]:
        acc, is_max = red.acc, red.combiner == "max"
        if red.dtype != "float32":
            return self._integer_reduction(red)
        identity = "-INF" if is_max else "0.0"
        stash = self.k.stash_last and i == len(self.k.reductions) - 1 and not self.looped
        if not self.looped:
            body = self.expr(red.body)
            lines = [f"    {'stash' if stash else acc + '_v'} = {body}"]
            v = "stash" if stash else f"{acc}_v"
            return lines + self._combine(acc, v, is_max, identity, "    ")
        if not is_max:
            return self._looped_sums([(i, red)])
        lines = [f"    {acc}_b = tl.full([XBLOCK, RBLOCK], -INF, tl.float32)",
                 f"    {acc}_n = tl.zeros([XBLOCK, RBLOCK], tl.int32)",
                 f"    for r0 in range(0, {self.k.inner}, RBLOCK):", *self._columns("r0", "        "),
                 f"        {acc}_v = {self.expr(red.body)}",
                 f"        {acc}_b = tl.maximum({acc}_b, tl.where(mask, {acc}_v, -INF))",
                 f"        {acc}_n = {acc}_n | tl.where(mask, ({acc}_v != {acc}_v).to(tl.int32), 0)"]
        return lines + [f"    {acc} = tl.max({acc}_b, axis=1, keep_dims=True)",
                        f"    {acc} = tl.where(tl.max({acc}_n, axis=1, keep_dims=True) > 0, INF - INF, {acc})"]

    def _integer_reduction(self, red) -> list[str]:
        """An integer (or bool) sum or max, exact in the accumulator's integer type (no NaN to track)."""
        acc, kind, combine = red.acc, TL[red.dtype], "max" if red.combiner == "max" else "sum"
        identity = str(-(1 << (63 if red.dtype == "int64" else 31))) if combine == "max" else "0"
        if not self.looped:
            return [f"    {acc}_v = ({self.expr(red.body)}).to({kind})",
                    f"    {acc} = tl.{combine}(tl.where(mask, {acc}_v, {identity}), axis=1, keep_dims=True)"]
        fold = f"tl.maximum({acc}_b, {{}})" if combine == "max" else f"{acc}_b + {{}}"
        return [f"    {acc}_b = tl.full([XBLOCK, RBLOCK], {identity}, {kind})",
                f"    for r0 in range(0, {self.k.inner}, RBLOCK):", *self._columns("r0", "        "),
                f"        {acc}_v = ({self.expr(red.body)}).to({kind})",
                f"        {acc}_b = " + fold.format(f"tl.where(mask, {acc}_v, {identity})"),
                f"    {acc} = tl.{combine}({acc}_b, axis=1, keep_dims=True)"]

    @staticmethod
    def _combine(acc, v, is_max, identity, pad) -> list[str]:
        if not is_max:
            return [f"{pad}{acc} = tl.sum(tl.where(mask, {v}, 0.0), axis=1, keep_dims=True)"]
        # one reduction whose max keeps a NaN (tl.max drops them), not a max and a NaN flag's max:
        # softmax's 16k and 32k rows +3-5 points of the copy bandwidth on the H200 (BENCHMARKS.md)
        return [f"{pad}{acc} = tl.reduce(tl.where(mask, {v}, -INF), 1, _egc_nanmax, keep_dims=True)"]

    def _inner_stores(self, pad: str) -> list[str]:
        lines = []
        for param, index, value, in_inner in self.stores():
            if not in_inner:
                continue
            if self.looped and self.k.stash_last:  # no stash across chunks: compute the body again
                value = substitute(value, Load(STASH, _stash_index(self.k)), self.k.reductions[-1].body)
            lines.append(f"{pad}tl.store({param} + ({render_index(index, TABLE)}) + o * 0 + r * 0, "
                         f"{self._cast_out(param, self.expr(value))}, mask=mask)")
        return lines

    def _cast_out(self, param: str, text: str) -> str:
        return f"tl.cast({text}, {TL[self.types[param]]})"  # tl.cast: a constant value is a Python float


def _stash_index(k: LoopKernel):
    return Affine.var("r", k.inner)


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def render_program(kernels: list[LoopKernel]) -> str:
    shapes = [_Kernel(k) for k in kernels]
    return PRELUDE + "\n\n" + "\n\n\n".join(s.render() for s in shapes) + "\n"


def load(source: str, kernels: list[LoopKernel], autotune: bool = False, sizes: list[int] | None = None):
    """Import the module and wrap each kernel as a launch over its grid (triton_load.py)."""
    from .triton_load import load_module
    return load_module(source, kernels, autotune, sizes)


def kernel_source(k: LoopKernel) -> str:
    """A kernel's source with its launch above it: a row that fills its block has its length
    only in RBLOCK, so two kernels of one text may differ in their launches (walker.unique_kernels
    shares a compiled kernel between those of one source, and so between those of one launch)."""
    shape = _Kernel(k)
    return (f"# launch: grid {shape.grid()}, XBLOCK {shape.xblock}, RBLOCK {shape.rblock}, "
            f"warps {shape.warps}, split {shape.split} x {shape.chunk}\n" + shape.render())


TABLE = Target(name="cuda", device="cuda", render=render_program, kernel_source=kernel_source,
               load=load, tunes=True, sized=SIZED, **FIELDS)


def make_target(name: str, device: str) -> Target:
    """The Triton table for a device; on the CPU, kernels run in Triton's interpreter,
    which triton switches on (from TRITON_INTERPRET) when it is first imported."""
    if device == "cpu":
        standard = sys.modules.get("triton.language.standard")
        if standard is not None and type(standard.max).__name__ != "InterpretedFunction":
            raise EgraphCompilerError(
                "target='triton' runs kernels on CPU tensors in Triton's interpreter, and triton was imported "
                "in this process without it: set TRITON_INTERPRET=1 in the environment before starting Python")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .triton_build import start_workers
    return replace(TABLE, name=name, device=device, prepare=start_workers if device == "cuda" else None)
