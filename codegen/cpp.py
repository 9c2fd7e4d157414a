"""C++ renderer: loop IR -> one OpenMP-parallel, vectorisable C++ function per
kernel.  The outer loop is `omp parallel for`, inner loops are `omp simd`
(with a reduction clause for accumulators).  Transcendentals call the C
library by name so that, with glibc's vector math library, they vectorise."""
from __future__ import annotations

import re

from egraph_compiler.loopir import (ERROR_FLAG, STASH, Acc, Call, Const, Load, LoopKernel, calls, contains,
                                    expressions, gathers, has_gather, transposed_reads, variables)
from egraph_compiler.pieces import pieces, strips

from .cpp_across import TILE, column_reduction, columns, tiled
from .cpp_load import SIZED, load
from .cpp_prelude import PRELUDE
from .walker import NARROW_INTEGERS, Target, float_literal, render_expr, render_index

CTYPES = {"float32": "float", "float64": "double", "bool": "bool", "int64": "int64_t", "int32": "int32_t",
          "float16": "_Float16", "bfloat16": "egc_bf16", "uint8": "uint8_t", "int8": "int8_t", "int16": "int16_t"}
NARROW_CTYPES = ("_Float16", "egc_bf16")  # stored narrow, loaded into float: kernels compute in float32
# a result of this C type is written as its bits, one of this type read through `LOAD_BITS` (cpp_prelude)
STORE_BITS = {"egc_bf16": "egc_bf16_bits", "_Float16": "egc_f16_bits"}
LOAD_BITS = {"_Float16": "egc_h2f"}
PARALLEL_MIN = 1 << 15  # below this many elements, threads cost more than they save

SCALAR_OPS = {
    "exp": "egc_exp({0})", "log": "logf({0})", "tanh": "tanhf({0})", "erf": "erff({0})",
    "cos": "egc_cosf({0})", "sin": "egc_sinf({0})", "floor": "floorf({0})", "log1p": "log1pf({0})", "expm1": "expm1f({0})",
    "relu": "egc_relu({0})", "sigmoid": "(1.0f / (1.0f + egc_exp((-({0})))))", "neg": "(-({0}))",
    "abs": "std::fabs({0})", "sqrt": "sqrtf({0})", "rsqrt": "(1.0f / sqrtf({0}))",
    "silu": "(({0}) / (1.0f + egc_exp((-({0})))))",  # (exp's text of neg's: calls shared_calls finds alike)
    "gelu": "(0.5f * ({0}) * (1.0f + erff(({0}) * 0.7071067811865476f)))",
    "gelu_tanh": "(0.5f * ({0}) * (1.0f + tanhf(0.7978845608028654f * (({0}) + 0.044715f * ({0}) * ({0}) * ({0})))))",
    "cast": "egc_cast<{dtype}>({0})",
    "add": "(({0}) + ({1}))", "sub": "(({0}) - ({1}))", "mul": "(({0}) * ({1}))", "div": "(({0}) / ({1}))",
    "maximum": "egc_maximum({0}, {1})", "pow": "powf({0}, {1})",
    "gt": "(({0}) > ({1}))", "ge": "(({0}) >= ({1}))", "lt": "(({0}) < ({1}))", "le": "(({0}) <= ({1}))",
    "eq": "(({0}) == ({1}))", "ne": "(({0}) != ({1}))",
    "where": "egc_where({0}, {1}, {2})", "where_row": "egc_where_row({0}, {1}, {2})",
}

# A sum accumulates in double lanes: float lanes of a long row drift by ~sqrt(n) ulps
# of the running sum (torch sums float32 in cascade; 1e-6..1e-3 relative apart over
# 2k-128k terms, found by the soak).  A max reduction keeps a NaN flag beside the
# maximum (a NaN anywhere in the row makes the result NaN, as in torch), so that
# both stay plain vectorisable reductions.
_REDUCTIONS = {
    "sum": ("    double {acc}_d = 0.0;",
            "    #pragma omp simd reduction(+:{acc}_d)",
            "{{ {acc}_d += {v}; }}", "    const float {acc} = static_cast<float>({acc}_d);"),
    # a mean: the double sum divided before rounding, so a constant row's mean is exact (float lanes
    # where a layer norm's variance follows: `_centred`)
    "mean": ("    double {acc}_d = 0.0;",
             "    #pragma omp simd reduction(+:{acc}_d)",
             "{{ {acc}_d += {v}; }}", "    float {acc} = static_cast<float>({acc}_d / double({n}));"),
    "max": ("    float {acc} = -INFINITY; int {acc}_nan = 0;",
            "    #pragma omp simd reduction(max:{acc}) reduction(|:{acc}_nan)",
            "{{ const float v = {v}; {acc} = std::max({acc}, v); {acc}_nan |= (v != v); }}",
            "    if ({acc}_nan) {acc} = NAN;"),
    # integers (and bools) sum and compare exactly in their own type, as torch's
    "int sum": ("    {ctype} {acc} = 0;", "    #pragma omp simd reduction(+:{acc})",
                "{{ {acc} += static_cast<{ctype}>({v}); }}", ""),
    "int max": ("    {ctype} {acc} = std::numeric_limits<{ctype}>::lowest();", "    #pragma omp simd reduction(max:{acc})",
                "{{ {acc} = std::max({acc}, static_cast<{ctype}>({v})); }}", ""),
}


def _combiner(red) -> str:
    return red.combiner if red.dtype not in CTYPES or red.dtype.startswith("float") else f"int {red.combiner}"


def _expr(e, types: dict[str, str], acc=str) -> str:
    """`types`: the kernel's parameter -> dtype; narrow (fp16/bf16) loads are widened to float;
    `acc(name)`: an accumulator's text (its name; a column's element in `cpp_across.columns`)."""
    def load(e) -> str:
        index, ctype = render_index(e.index, TARGET), CTYPES.get(types.get(e.param))
        if ctype in LOAD_BITS:
            return f"{LOAD_BITS[ctype]}(reinterpret_cast<const uint16_t*>({e.param})[{index}])"
        return f"static_cast<float>({e.param}[{index}])" if ctype in NARROW_CTYPES else f"{e.param}[{index}]"
    return render_expr(e, TARGET, load, acc, types=types)


# bool buffers are read and written through uint8_t (torch stores them as bytes 0/1): g++ finds no
# vector type for a C++ bool load and leaves such a loop scalar (a causal mask's softmax: 1.36 ms
# for 262k elements)
POINTER_CTYPES = CTYPES | {"bool": "uint8_t"}


def render_kernel(k: LoopKernel) -> str:
    """One C++ function; a kernel over a concatenation runs one loop nest per operand's
    part of its domain (`pieces`), each in its own scope, under the whole kernel's signature
    (a piece may have lost the kernel's gather, and with it the error flag's parameter: soak,
    seed 12002)."""
    parts = pieces(k)
    if len(parts) == 1:
        return _render_loops(k)
    bodies = [_render_loops(part).split("\n")[1:-1] for part in parts]
    return "\n".join([_signature(k)] + [line for body in bodies for line in ["  {"] + body + ["  }"]] + ["}"])


def _signature(k: LoopKernel) -> str:
    params = ", ".join(
        f"{'const ' if p.role == 'in' else ''}{POINTER_CTYPES[p.dtype]}* __restrict__ {p.name}" for p in k.params)
    if has_gather(k):
        params += f", int32_t* {ERROR_FLAG}"
    return f'extern "C" void {k.name}({params}) {{'


def _render_loops(k: LoopKernel) -> str:
    parallel = k.outer > 1 and k.outer * k.inner >= PARALLEL_MIN
    types = {p.name: p.dtype for p in k.params}
    lines = [_signature(k)]
    if transposed_reads(k) and k.outer >= TILE and k.inner >= TILE:
        return "\n".join(lines + tiled(k, types, parallel, lambda e: _expr(e, types), CTYPES, STORE_BITS,
                                        lambda i: render_index(i, TARGET)))
    if column_reduction(k, _combiner):
        finish = lambda red: _REDUCTIONS[_combiner(red)][3].format(acc=red.acc, n=k.inner)
        store = lambda p, i, v, acc: _store(p, i, v, types, acc)
        return "\n".join(lines + columns(k, parallel, lambda e, acc: _expr(e, types, acc), finish, SUM_BLOCK, store))
    if parallel:
        lines.append("  #pragma omp parallel for schedule(static)")
    lines.append(f"  for (int64_t o = 0; o < {k.outer}; ++o) {{")
    if k.stash_last:
        lines.append(f"    alignas(64) float {STASH}[{k.inner}];")
    bounded, exps = _bounded_exps(k, types)
    split = None
    groups = _passes(k)
    centred = _centred(k, groups)
    for at, group in enumerate(groups):
        lines += _pass(k, group, types, bounded, centred, at)
        if any(red.acc == bounded for _, red in group):
            split = len(lines)
    stores = [(k.store_param, k.store_index, k.value, k.store_in_inner)] + list(k.extra_stores)
    written = {p.name for p in k.params if p.role == "out"}
    inner = shared_calls(" ".join(_store(p, i, v, types) for p, i, v, in_inner in stores if in_inner), written)
    strip = strips(k) if not has_gather(k) else None
    if strip:  # the row in runs of m, each read along without a division (pieces.strips)
        m, runs = strip
        text = shared_calls(" ".join(_store(p, i, v, types) for p, i, v, _ in
                                     [(runs.store_param, runs.store_index, runs.value, True)] + list(runs.extra_stores)),
                            written)
        lines += [f"    for (int64_t rh = 0; rh < {k.inner // m}; ++rh) {{", "      #pragma omp simd",
                  f"      for (int64_t rl = 0; rl < {m}; ++rl) {{ {text} }}", "    }"]
    elif inner:
        lines.append("    #pragma omp simd")
        lines.append(f"    for (int64_t r = 0; r < {k.inner}; ++r) {{ {inner} }}")
    lines += [f"    {_store(p, i, v, types)}" for p, i, v, in_inner in stores if not in_inner]
    if split is not None:
        rest = lines[split:]
        fast = [_replace_all(line, exps) for line in rest]
        lines[split:] = ([f"    if ({bounded}_lo - {bounded} >= -87.0f) {{  // every exp argument in [-87, 0]: inline"]
                         + ["  " + line for line in fast] + ["    } else {"] + ["  " + line for line in rest] + ["    }"])
    lines += ["  }", "}"]
    return "\n".join(_hoist_rows(k, types, lines))


SUM_BLOCK = 256  # a row's sum: float lanes within blocks of this many elements, the blocks' sums in double


def _pass(k: LoopKernel, group: list, types, bounded: str | None, centred: dict, at: int) -> list[str]:
    """One loop over the row for a group of reductions (`_passes`).  A group of sums runs in
    blocks of SUM_BLOCK: float lanes inside a block (as fast as torch's own vector sums; the
    double lanes they replaced cost a softmax kernel 16% on 16 cores), each block's sum added in
    double (accurate as a cascade over long rows: tests/test_regressions.py).  So does a layer
    norm's mean and variance (`_centred`); other means keep double lanes."""
    lines, steps, clauses = [], [], []
    squares = {red.acc for _, (g, reds) in centred.items() if g == at for red in reds}
    residues = {m: _centred_terms(reds) for m, (g, reds) in centred.items() if g == at}
    blocked = all(_combiner(red) == "sum" or red.acc in centred or red.acc in squares for _, red in group)
    for i, red in group:
        init, pragma, step, _ = _REDUCTIONS[_combiner(red)]
        body = _expr(red.body, types)
        lines.append(init.format(acc=red.acc, ctype=CTYPES.get(red.dtype, "float")))
        step = step.format(acc=red.acc, v=body, ctype=CTYPES.get(red.dtype, "float"))[2:-2]
        if red.acc == bounded:  # the row's minimum beside its maximum
            lines.append(f"    float {red.acc}_lo = INFINITY;")
            step = step.replace(f"{red.acc} = std::max({red.acc}, v); ",
                                f"{red.acc} = std::max({red.acc}, v); {red.acc}_lo = std::min({red.acc}_lo, v); ")
            pragma += f" reduction(min:{red.acc}_lo)"
        if k.stash_last and i == len(k.reductions) - 1:
            step = f"const float s = {body}; {STASH}[r] = s; " + \
                _REDUCTIONS[red.combiner][2].format(acc=red.acc, v="s")[2:-2]
        steps.append(step)
        clauses.append(pragma.format(acc=red.acc).split("simd ", 1)[1])
    for m, body in residues.items():  # the mean's residue, summed beside its squares
        lines.append(f"    double {m}_c = 0.0;")
        steps.append(f"{m}_q += ({_expr(body, types)}) - {m};")
        clauses.append(f"reduction(+:{m}_q)")
    loop = " ".join(clauses), " ".join(steps)
    if blocked:
        parts = [f"{red.acc}_p" for _, red in group] + [f"{m}_q" for m in residues]
        rename = lambda text: _replace_all(text, {f"{red.acc}_d": f"{red.acc}_p" for _, red in group})
        lines += [f"    for (int64_t rb = 0; rb < {k.inner}; rb += {SUM_BLOCK}) {{",
                  "      " + " ".join(f"float {p} = 0.0f;" for p in parts),
                  "      #pragma omp simd " + rename(loop[0]),
                  f"      for (int64_t r = rb; r < std::min<int64_t>(rb + {SUM_BLOCK}, {k.inner}); ++r) "
                  f"{{ {rename(loop[1])} }}",
                  "      " + " ".join([f"{red.acc}_d += {red.acc}_p;" for _, red in group]
                                      + [f"{m}_c += {m}_q;" for m in residues]), "    }"]
    else:  # (double lanes: a residue is summed into its double as it is; soak 33003, a mean beside it)
        direct = lambda text: _replace_all(text, {f"{m}_q": f"{m}_c" for m in residues})  # noqa: E731
        lines += ["    #pragma omp simd " + direct(loop[0]),
                  f"    for (int64_t r = 0; r < {k.inner}; ++r) {{ {direct(loop[1])} }}"]
    lines += [_REDUCTIONS[_combiner(red)][3].format(acc=red.acc, n=k.inner) for _, red in group
              if _REDUCTIONS[_combiner(red)][3] and red.acc not in squares]
    return lines + [line for m in residues for line in _corrected(k, m, centred[m][1], types)]


def _centred(k: LoopKernel, groups: list) -> dict[str, tuple[int, list]]:
    """A layer norm's mean m = mean(x) whose next pass sums only (x - m)^2 (and sums that do not
    read m): {m: (that pass's position, its square reductions)}.  m is then summed in float lanes
    (m0, ~1e-6 of the terms off), and the squares' pass also sums the residues x - m0, small and so
    summed with small error: m = m0 + mean(x - m0), within torch's rounding (float lanes alone
    made a layer norm over a row of 6.7e5 but one 0 1.5e-3 wrong: tests/test_means.py), and
    sum((x - m)^2) = sum((x - m0)^2) - n * (m - m0)^2.  Two float passes for what took two
    double ones (ln_relu's kernel 7% faster on 2 cores)."""
    found = {}
    for at, group in enumerate(groups[:-1]):
        following = groups[at + 1]
        for _, mean in group:
            if _combiner(mean) != "mean":
                continue
            residue = Call("sub", (mean.body, Acc(mean.acc)))
            readers = [red for _, red in following if contains(red.body, Acc(mean.acc))]
            if readers and all(_combiner(red) in ("sum", "mean") and isinstance(red.body, Call) and red.body.op == "mul"
                               and len(red.body.args) == 2 and all(_is_residue(a, residue) for a in red.body.args)
                               and not (k.stash_last and red is k.reductions[-1]) for red in readers):
                found[mean.acc] = (at + 1, readers)
    # each pass in float blocks throughout: its other means centred too, its others sums
    ok = lambda at, red: _combiner(red) == "sum" or red.acc in found or \
        any(g == at and red in reds for g, reds in found.values())
    return {m: (g, reds) for m, (g, reds) in found.items()
            if all(ok(at, red) for at in (g - 1, g) for _, red in groups[at])}


def _centred_terms(squares: list):
    """The mean's terms x, read off its squares (x - m) * (x - m)."""
    return squares[0].body.args[0].args[0]


def _is_residue(e, residue: Call) -> bool:
    return isinstance(e, Call) and e.op == "sub" and e.args == residue.args


def _corrected(k: LoopKernel, m: str, squares: list, types) -> list[str]:
    """After the squares' pass (`_centred`): m and its squares' sums corrected by the residue; a
    result that is not finite (an inf or NaN term, or a block's float sum that overflowed where the
    exact one does not) summed again in double lanes, m first."""
    n, body = k.inner, _expr(_centred_terms(squares), types)
    lines = [f"    const double {m}_r = {m}_c / double({n});"]
    for red in squares:  # (never below 0; 0 for a constant row, whose residues are a few ulps each, exact)
        total = f"std::max(0.0, {red.acc}_d - double({n}) * {m}_r * {m}_r)"
        lines.append(f"    float {red.acc} = static_cast<float>("
                     + (f"({total}) / double({n})" if red.combiner == "mean" else total) + ");")
    lines.append(f"    {m} = static_cast<float>(static_cast<double>({m}) + {m}_r);")
    bad = " || ".join(f"!std::isfinite({a})" for a in [m] + [red.acc for red in squares])
    lines += [f"    if ({bad}) {{", f"      double {m}_e = 0.0;", f"      #pragma omp simd reduction(+:{m}_e)",
              f"      for (int64_t r = 0; r < {n}; ++r) {{ {m}_e += {body}; }}",
              f"      {m} = static_cast<float>({m}_e / double({n}));"]
    for red in squares:
        lines += [f"      double {red.acc}_e = 0.0;", f"      #pragma omp simd reduction(+:{red.acc}_e)",
                  f"      for (int64_t r = 0; r < {n}; ++r) {{ {red.acc}_e += {_expr(red.body, types)}; }}",
                  f"      {red.acc} = static_cast<float>({red.acc}_e"
                  + (f" / double({n})" if red.combiner == "mean" else "") + ");"]
    return lines + ["    }"]


def _bounded_exps(k: LoopKernel, types) -> tuple[str | None, dict[str, str]]:
    """softmax's exp(x - max(x)): the guard in egc_exp (glibc's vector expf is 10x slower below
    -87, a mask's -inf) costs an exp-bound loop ~20% when no argument comes near -87.  Where a
    later expression takes exp(b - m) of a row maximum m of b, the max pass also takes b's
    minimum, and the rest of the row is rendered twice: for those calls, where min(b) - m >= -87
    (so is every b - m, and none is above 0: float subtraction is monotonic; a NaN takes the
    guarded copy), with the prelude's inline egc_exp_bounded (glibc's vector expf, a call per 8
    lanes, was 2/3 of a softmax kernel's time on 2 cores), and as before otherwise."""
    maxima = {red.acc: red.body for red in k.reductions if _combiner(red) == "max"}
    later = [red.body for red in k.reductions if red.combiner != "max"] + [k.value] + [s[2] for s in k.extra_stores]
    found: dict[str, dict[str, str]] = {}
    for e in (e for root in later for e in calls(root, "exp")):
        arg = e.args[0]
        if (isinstance(arg, Call) and arg.op == "sub" and isinstance(arg.args[1], Acc)
                and maxima.get(arg.args[1].name) == arg.args[0]):
            text = _expr(e, types)
            if text.startswith("egc_exp("):
                found.setdefault(arg.args[1].name, {})[text] = "egc_exp_bounded(" + text[len("egc_exp("):]
    first = next((acc for acc in maxima if acc in found), None)
    return first, found.get(first, {})


def _replace_all(line: str, texts: dict[str, str]) -> str:
    for old, new in texts.items():
        line = line.replace(old, new)
    return line


_TRANSCENDENTAL = re.compile(r"\b(?:egc_exp|expf|logf|tanhf|erff|egc_cosf|egc_sinf|log1pf|expm1f|powf|sqrtf)\(")


def shared_calls(body: str, written: set[str]) -> str:
    """A loop body's stores with each transcendental call that appears more than once taken
    once, into a local at the body's start (innermost first): g++ left both of a silu
    backward's exp(-x) calls (silu's and sigmoid's) as calls per 8 lanes, 678 us against 376
    for its kernel on 2 cores (BENCHMARKS.md).  A call reading a buffer the body writes stays
    where it is (its store may come first)."""
    names: list[tuple[str, str]] = []
    while True:
        text = " ".join(call for _, call in names) + " " + body
        repeated = [c for c in set(_calls(text)) if text.count(c) >= 2
                    and not any(f"{w}[" in c for w in written)]
        if not repeated:
            break
        call = min(repeated, key=lambda c: (len(c), c))
        name = f"egc_call{len(names)}"  # (not egc_sN: a sized template's sizes, codegen/sizes.py)
        names = [(n, c.replace(call, name)) for n, c in names] + [(name, call)]
        body = body.replace(call, name)
    return " ".join(f"const auto {n} = {c};" for n, c in names) + (" " if names else "") + body


def _calls(text: str):
    for match in _TRANSCENDENTAL.finditer(text):
        depth = 0
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                yield text[match.start():end + 1]
                break


def _hoist_rows(k: LoopKernel, types, lines: list[str]) -> list[str]:
    """A gather whose row depends on the outer index alone (an embedding: one token per row) takes
    its row once per outer index, before the inner loops: inside them, egc_row's branch on a bad
    index is control flow that keeps g++ from vectorising the loop."""
    rows = {}
    for g in (g for e in expressions(k) for g in gathers(e)):
        if _outer_only(g.row):
            text = TARGET.row.format(row=_expr(g.row, types), rows=TARGET.int_const(g.rows), err=ERROR_FLAG)
            rows.setdefault(text, f"egc_g{len(rows)}")
    if not rows:
        return lines
    at = next(i for i, line in enumerate(lines) if line.startswith("  for (int64_t o = 0;")) + 1
    body = lines[at:]
    for text, name in rows.items():
        body = [line.replace(text, name) for line in body]
    return lines[:at] + [f"    const int64_t {name} = {text};" for text, name in rows.items()] + body


def _outer_only(e) -> bool:
    """An expression of loads indexed by the outer index alone (no accumulator, gather or stash)."""
    if isinstance(e, Load):
        return e.param != STASH and variables(e.index) <= {"o"}
    if isinstance(e, Call):
        return all(_outer_only(a) for a in e.args)
    return isinstance(e, Const)


def _passes(k: LoopKernel) -> list[list]:
    """The reductions grouped into loops: consecutive sums that do not read each
    other's results share one pass over the row (layer_norm's centred sum and sum
    of squares); a max, and the reduction that fills the stash, get a loop of their own."""
    groups: list[list] = []
    for i, red in enumerate(k.reductions):
        last = groups[-1] if groups else None
        alone = red.combiner == "max" or (k.stash_last and i == len(k.reductions) - 1)
        if last and not alone and all(r.combiner != "max" and not contains(red.body, Acc(r.acc)) for _, r in last):
            last.append((i, red))
        else:
            groups.append([(i, red)])
        if alone:
            groups.append([])  # nothing joins it
    return [g for g in groups if g]


def _store(param, index, value, types, acc=str) -> str:
    bits = STORE_BITS.get(CTYPES[types[param]])
    if isinstance(value, Call) and value.op == "cast" and value.dtype == types[param] and bits:
        value = value.args[0]  # (rounded by the store itself: an fp16 cast's rounding was made twice)
    if bits:
        return f"reinterpret_cast<uint16_t*>({param})[{render_index(index, TARGET)}] = {bits}({_expr(value, types, acc)});"
    return f"{param}[{render_index(index, TARGET)}] = static_cast<{CTYPES[types[param]]}>({_expr(value, types, acc)});"


def render_program(kernels: list[LoopKernel]) -> str:
    return PRELUDE + "\n" + "\n\n".join(render_kernel(k) for k in kernels) + "\n"


TARGET = Target(
    name="cpu", language="generated C++", device="cpu", ops=SCALAR_OPS,
    const=lambda v: float_literal(v, "f", "INFINITY", "NAN"),
    pow_special={2.0: "(({0}) * ({0}))", 0.5: "std::sqrt({0})", 1.0: "({0})", 3.0: "(({0}) * ({0}) * ({0}))",
                 -1.0: "(1.0f / ({0}))"},
    floordiv="/", dtypes=frozenset({"float32", "float16", "bfloat16", "bool", "int64", "int32", "weak"}),
    dtype_names=CTYPES, int_const=lambda v: f"int64_t({v})", row="egc_row({row}, {rows}, {err})",
    render=render_program, kernel_source=render_kernel, load=load, exact_mean=True, sized=SIZED,
    narrow_reads=NARROW_INTEGERS,
)
