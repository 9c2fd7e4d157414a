"""C++ kernels that read across rows: the loop over the row (`r`) strides through
memory and the outer loop (`o`) walks along it.  Two forms, both vectorised along
the contiguous direction: a pointwise transpose in tiles, and a column reduction
(a bias's gradient: the sum over a matrix's rows) as columns of accumulators."""
from __future__ import annotations

from egraph_compiler.loopir import STASH, Acc, Affine, Call, Const, Load, LoopKernel, contains, has_gather, loads, local_stride, substitute
from egraph_compiler.pieces import put_expr, put_index, tile_vars

TILE = 32  # a transposing kernel's square tile: its reads of each row's cache line all hit
COLUMNS = 32  # a column reduction's block of accumulators (128 bytes of each row per pass)...
NARROWEST = 8  # ...or as few as one AVX2 vector's, so that a narrow matrix still spreads over 16 threads


def column_reduction(k: LoopKernel, combiner) -> bool:
    """Sums, means or float maxima over r of loads that read along o and across r (`x[o + W*r]`):
    the row loop would stride by W through memory for every element (a [512, 1024] bias
    gradient: 0.8 ms against ~0.09 for the same bytes read in order; an `amax(0)` of [2048,
    1024]: 5.4 ms, torch 0.2; a softmax over dim 0: 19 ms, torch 2.3).  A reduction may read an
    earlier one (a softmax's sum its maximum: another pass over the block), and the result may
    be stored per element too (the softmax itself), where no read or store runs along r."""
    if not k.reductions or has_gather(k) or k.outer < 2:
        return False
    if any(combiner(red) not in ("sum", "mean", "max") for red in k.reductions):
        return False
    stores = [(k.store_index, k.value, k.store_in_inner)] + [(i, v, inner) for _, i, v, inner in k.extra_stores]
    reads = [e for red in k.reductions for e in loads(red.body)]
    reads_after = [e for _, v, _ in stores for e in loads(v) if e.param != STASH]
    across = any(local_stride(e.index, "o") == 1 and local_stride(e.index, "r") >= 16 for e in reads)
    along = any(local_stride(e.index, "r") == 1 and local_stride(e.index, "o") >= 16 for e in reads + reads_after)
    along_stores = any(inner and local_stride(i, "r") == 1 and local_stride(i, "o") != 1 for i, _, inner in stores)
    return across and not along and not along_stores


def _column_passes(k: LoopKernel) -> list[list]:
    """The reductions in passes over a block: a new pass where one reads a result of the current."""
    passes: list[list] = []
    for red in k.reductions:
        if not passes or any(contains(red.body, Acc(other.acc)) for other in passes[-1]):
            passes.append([])
        passes[-1].append(red)
    return passes


def columns(k: LoopKernel, parallel: bool, expr, finish, block: int, store) -> list[str]:
    """`column_reduction`'s kernels: each thread takes blocks of up to COLUMNS outputs.  In each
    pass over the block's rows it adds the block's elements into float accumulators in one
    vector loop per row, and every `block` rows it adds those into double ones (the rounding of
    `_pass`'s blocked sums: float within a block, the blocks' sums in double); a maximum keeps a
    NaN flag beside it.  A pass's results are kept per column (`{acc}_v`) for the passes and
    stores after it.  o is written `ol + width*ob` (ol within the block), so that a divided
    index (a [B, S, D] tensor reduced over S: `o % D`, `o / D`) is the block's constant part
    plus ol, read in order (`pieces.put_index`).  `expr(e, acc)` renders a body (`acc(name)` an
    accumulator's text), `finish(red)` a reduction's closing line from its `{acc}_d`,
    `store(param, index, value, acc)` one store."""
    width = max(NARROWEST, min(COLUMNS, k.outer // 16 // NARROWEST * NARROWEST))
    blocks = -(-k.outer // width)
    o = Affine.var("ol", width) + Affine.var("ob", blocks).scale(width)
    column = lambda name: f"{name}_v[ol]"  # noqa: E731
    body = lambda e: expr(put_expr(e, "o", o), column)  # noqa: E731
    lines = ["  #pragma omp parallel for schedule(static)"] if parallel else []
    lines += [f"  for (int64_t ob = 0; ob < {blocks}; ++ob) {{",
              # (a bound g++ cannot see is at most `width`: told so, it vectorised amax(0)'s loop with
              # a 16-byte epilogue too, 0.118 -> 0.157 ms; a constant trip count unrolled softmax(0)'s
              # exp loops and left them scalar, 2 -> 6 ms)
              f"    const int64_t oe = std::min<int64_t>({width} * ob + {width}, {k.outer}) - {width} * ob;",
              "    " + " ".join(f"float {red.acc}_v[{width}];" for red in k.reductions)]
    for reds in _column_passes(k):
        lines += _column_pass(k, reds, body, finish, block, width)
    value = k.value
    if k.stash_last:  # (the stash is a row's: here its body is computed again)
        value = substitute(value, Load(STASH, Affine.var("r", k.inner)), k.reductions[-1].body)
    hoisted: dict = {}
    stores = [(p, put_index(i, "o", o), put_expr(_per_column(v, hoisted), "o", o), inner) for p, i, v, inner in
              [(k.store_param, k.store_index, value, k.store_in_inner)] + list(k.extra_stores)]
    if hoisted:  # (a log_softmax's log of its sum: a logf per element, 2x eager's time)
        lines += [f"    float {name}_v[{width}];" for name in hoisted.values()]
        lines += ["    for (int64_t ol = 0; ol < oe; ++ol) { "
                  + " ".join(f"{name}_v[ol] = {body(e)};" for e, name in hoisted.items()) + " }"]
    inner = " ".join(store(p, i, v, column) for p, i, v, in_inner in stores if in_inner)
    outer = " ".join(store(p, i, v, column) for p, i, v, in_inner in stores if not in_inner)
    if inner:
        lines += [f"    for (int64_t r = 0; r < {k.inner}; ++r) {{", "      #pragma omp simd",
                  f"      for (int64_t ol = 0; ol < oe; ++ol) {{ {inner} }}", "    }"]
    if outer:
        lines += ["    #pragma omp simd", f"    for (int64_t ol = 0; ol < oe; ++ol) {{ {outer} }}"]
    return lines + ["  }", "}"]


def _per_column(e, found: dict):
    """`e` with each largest part that reads accumulators and constants alone (the same for every r)
    replaced by a column's value computed once (found: part -> its name), and a division by one
    by a product with its reciprocal, as the row form renders it (walker.render_expr)."""
    if not isinstance(e, Call):
        return e
    if _of_accs(e) and _reads_acc(e):
        return Acc(found.setdefault(e, f"h{len(found)}"))
    if e.op == "div" and _of_accs(e.args[1]) and not isinstance(e.args[1], Const):
        reciprocal = Call("div", (Const(1.0), e.args[1]), e.dtype)
        return Call("mul", (_per_column(e.args[0], found), Acc(found.setdefault(reciprocal, f"h{len(found)}"))), e.dtype)
    return Call(e.op, tuple(_per_column(a, found) for a in e.args), e.dtype)


def _of_accs(e) -> bool:
    return isinstance(e, (Acc, Const)) or (isinstance(e, Call) and all(_of_accs(a) for a in e.args))


def _reads_acc(e) -> bool:
    return isinstance(e, Acc) or (isinstance(e, Call) and any(_reads_acc(a) for a in e.args))


def _column_pass(k: LoopKernel, reds: list, body, finish, block: int, width: int) -> list[str]:
    maxima = [red for red in reds if red.combiner == "max"]  # (float: column_reduction)
    accs = [red.acc for red in reds if red.combiner != "max"]
    steps = [f"{red.acc}_p[ol] += {body(red.body)};" for red in reds if red.combiner != "max"] + [
        f"{{ const float v = {body(red.body)}, m = {red.acc}_m[ol]; {red.acc}_m[ol] = v > m ? v : m; "
        f"{red.acc}_n[ol] |= (v != v); }}" for red in maxima]
    lines = ["    {",
             "    " + " ".join([f"double {a}_c[{width}] = {{}};" for a in accs]
                              + [f"float {r.acc}_m[{width}]; int {r.acc}_n[{width}] = {{}};" for r in maxima]),
             *[f"    for (int64_t ol = 0; ol < {width}; ++ol) {r.acc}_m[ol] = -INFINITY;" for r in maxima],
             f"    for (int64_t rb = 0; rb < {k.inner}; rb += {block}) {{",
             "      " + " ".join(f"float {a}_p[{width}] = {{}};" for a in accs),
             f"      for (int64_t r = rb; r < std::min<int64_t>(rb + {block}, {k.inner}); ++r) {{",
             "        #pragma omp simd",
             "        for (int64_t ol = 0; ol < oe; ++ol) { " + " ".join(steps) + " }",
             "      }",
             "      for (int64_t ol = 0; ol < oe; ++ol) { " + " ".join(f"{a}_c[ol] += {a}_p[ol];" for a in accs) + " }",
             "    }",
             "    for (int64_t ol = 0; ol < oe; ++ol) {"]
    for red in reds:
        if red.combiner == "max":
            lines += [f"      float {red.acc} = {red.acc}_m[ol]; const int {red.acc}_nan = {red.acc}_n[ol];",
                      "  " + finish(red)]
        else:
            lines += [f"      const double {red.acc}_d = {red.acc}_c[ol];", "  " + finish(red)]
        lines.append(f"      {red.acc}_v[ol] = {red.acc};")
    return lines + ["    }", "    }"]


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
