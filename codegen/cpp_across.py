"""C++ kernels that read across rows: the loop over the row (`r`) strides through
memory and the outer loop (`o`) walks along it.  Two forms, both vectorised along
the contiguous direction: a pointwise transpose in tiles, and a column reduction
(a bias's gradient: the sum over a matrix's rows) as columns of accumulators."""
from __future__ import annotations

from egraph_compiler.loopir import Acc, LoopKernel, contains, has_gather, loads, local_stride
from egraph_compiler.pieces import tile_vars

TILE = 32  # a transposing kernel's square tile: its reads of each row's cache line all hit
COLUMNS = 32  # a column reduction's block of accumulators (128 bytes of each row per pass)...
NARROWEST = 8  # ...or as few as one AVX2 vector's, so that a narrow matrix still spreads over 16 threads


def column_reduction(k: LoopKernel, combiner) -> bool:
    """Sums, means or float maxima over r of loads that read along o and across r (`x[o + W*r]`),
    stored once per o: the row loop would stride by W through memory for every element (a
    [512, 1024] bias gradient: 0.8 ms against ~0.09 for the same bytes read in order; an
    `amax(0)` of [2048, 1024]: 5.4 ms, torch 0.2)."""
    if (not k.reductions or k.stash_last or k.store_in_inner or any(s[3] for s in k.extra_stores)
            or has_gather(k) or k.outer < 2):
        return False
    if any(combiner(red) not in ("sum", "mean", "max") for red in k.reductions):
        return False
    accs = [Acc(red.acc) for red in k.reductions]
    if any(contains(red.body, acc) for red in k.reductions for acc in accs):
        return False  # one reads another's result: not one pass
    reads = [e for red in k.reductions for e in loads(red.body)]
    across = any(local_stride(e.index, "o") == 1 and local_stride(e.index, "r") >= 16 for e in reads)
    along = any(local_stride(e.index, "r") == 1 and local_stride(e.index, "o") >= 16 for e in reads)
    return across and not along


def columns(k: LoopKernel, parallel: bool, expr, finish, block: int, store_lines) -> list[str]:
    """`column_reduction`'s kernels: each thread takes blocks of up to COLUMNS outputs; for every
    row it adds the block's elements into float accumulators in one vector loop, and every
    `block` rows it adds those into double ones (the rounding of `_pass`'s blocked sums:
    float within a block, the blocks' sums in double).  `expr(e)` renders a body, `finish(red)`
    a reduction's closing line from its `{acc}_d`, `store_lines()` the stores per output."""
    width = max(NARROWEST, min(COLUMNS, k.outer // 16 // NARROWEST * NARROWEST))
    maxima = [red for red in k.reductions if red.combiner == "max"]  # (float: column_reduction)
    accs = [red.acc for red in k.reductions if red.combiner != "max"]
    end = f"std::min<int64_t>(ob + {width}, {k.outer})"
    # a maximum per column, with a NaN flag beside it (cpp._REDUCTIONS["max"]), taken by value
    steps = [f"{red.acc}_p[o - ob] += {expr(red.body)};" for red in k.reductions if red.combiner != "max"] + [
        f"{{ const float v = {expr(red.body)}, m = {red.acc}_m[o - ob]; {red.acc}_m[o - ob] = v > m ? v : m; "
        f"{red.acc}_n[o - ob] |= (v != v); }}" for red in maxima]
    lines = ["  #pragma omp parallel for schedule(static)"] if parallel else []
    lines += [f"  for (int64_t ob = 0; ob < {k.outer}; ob += {width}) {{",
              f"    const int64_t oe = {end};",
              "    " + " ".join([f"double {a}_c[{width}] = {{}};" for a in accs]
                              + [f"float {r.acc}_m[{width}]; int {r.acc}_n[{width}] = {{}};" for r in maxima]),
              *[f"    for (int64_t o = 0; o < {width}; ++o) {r.acc}_m[o] = -INFINITY;" for r in maxima],
              f"    for (int64_t rb = 0; rb < {k.inner}; rb += {block}) {{",
              "      " + " ".join(f"float {a}_p[{width}] = {{}};" for a in accs),
              f"      for (int64_t r = rb; r < std::min<int64_t>(rb + {block}, {k.inner}); ++r) {{",
              "        #pragma omp simd",
              "        for (int64_t o = ob; o < oe; ++o) { " + " ".join(steps) + " }",
              "      }",
              "      for (int64_t o = ob; o < oe; ++o) { " + " ".join(f"{a}_c[o - ob] += {a}_p[o - ob];" for a in accs)
              + " }",
              "    }",
              "    for (int64_t o = ob; o < oe; ++o) {"]
    for red in k.reductions:
        if red.combiner == "max":
            lines += [f"      float {red.acc} = {red.acc}_m[o - ob]; const int {red.acc}_nan = {red.acc}_n[o - ob];",
                      "  " + finish(red)]
        else:
            lines += [f"      const double {red.acc}_d = {red.acc}_c[o - ob];", "  " + finish(red)]
    lines += ["      " + line for line in store_lines()]
    return lines + ["    }", "  }", "}"]


def tiled(k: LoopKernel, types, parallel: bool, expr, ctypes, store_bits, index) -> list[str]:
    """A pointwise kernel that reads across rows (a transpose), in TILE x TILE tiles: its
    values computed in a vector loop along the reads (contiguous there) into a tile on the
    stack, then stored in a vector loop along the stores.  Along the stores alone, every
    read is a gather, which g++ does not vectorise around a vector-math call (gelu_tanh
    then ran scalar tanhf: 4.5 ms against 0.26 untransposed, for 512k elements); along the
    reads alone, every store a scatter (a plain transpose 12x slower).  Inside a tile the
    variables are `ol + TILE*ob` and `rl + TILE*rb` (pieces.tile_vars): a divided index such
    as a head's `o % 128` becomes the tile's constant part plus ol, read in order."""
    stores = [(p, i, v) for p, i, v, _ in tile_vars(k, TILE)]
    at = f"[rl * {TILE} + ol]"
    # (a narrow result's tile holds its bits, written as cpp._store writes them: `store_bits`)
    bits = {p: store_bits[ctypes[types[p]]] for p, _, _ in stores if ctypes[types[p]] in store_bits}
    tile_type = {p: "uint16_t" if p in bits else ctypes[types[p]] for p, _, _ in stores}
    compute = " ".join(f"tile{n}{at} = {bits[p]}({expr(v)});" if p in bits else
                       f"tile{n}{at} = static_cast<{ctypes[types[p]]}>({expr(v)});" for n, (p, _, v) in enumerate(stores))
    write = " ".join(f"{f'reinterpret_cast<uint16_t*>({p})' if p in bits else p}[{index(i)}] = tile{n}{at};"
                     for n, (p, i, _) in enumerate(stores))
    def loops(o_end: str, r_end: str) -> list[str]:
        return [f"        for (int64_t rl = 0; rl < {r_end}; ++rl) {{", "          #pragma omp simd",
                f"          for (int64_t ol = 0; ol < {o_end}; ++ol) {{ {compute} }}", "        }",
                f"        for (int64_t ol = 0; ol < {o_end}; ++ol) {{", "          #pragma omp simd",
                f"          for (int64_t rl = 0; rl < {r_end}; ++rl) {{ {write} }}", "        }"]
    # a whole tile's loops have a constant trip count, which g++ vectorises without a remainder
    # (a gelu_tanh of a [512, 1024] transpose: 1.5 ms with std::min bounds on every tile, 0.55 ms)
    return (["  #pragma omp parallel for collapse(2) schedule(static)"] if parallel else []) + [
        f"  for (int64_t ob = 0; ob < {-(-k.outer // TILE)}; ++ob) {{",
        f"    for (int64_t rb = 0; rb < {-(-k.inner // TILE)}; ++rb) {{"] + [
        f"      alignas(64) {tile_type[p]} tile{n}[{TILE * TILE}];" for n, (p, _, _) in enumerate(stores)] + [
        f"      if ((ob + 1) * {TILE} <= {k.outer} && (rb + 1) * {TILE} <= {k.inner}) {{"] + loops(
        str(TILE), str(TILE)) + [
        "      } else {"] + loops(f"std::min<int64_t>({TILE}, {k.outer} - ob * {TILE})",
                                  f"std::min<int64_t>({TILE}, {k.inner} - rb * {TILE})") + [
        "      }", "    }", "  }", "}"]
