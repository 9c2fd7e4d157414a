"""layer_norm's moments over a long row kept in registers, by chunks (Chan's pairwise form).

A row's sum, its centred sum and its sum of squared deviations (layer_norm's centred moments,
rules/lowering.rules) take a sum over the row and then two more that wait for it: two trees across
the program's warps, each a round through shared memory and a barrier.  On long rows an SM holds
one or two programs, and those rounds leave its loads idle.  Here the row, viewed as [C, K] chunks
of K = CHUNK elements (one warp's share of a block: the reshape moves nothing), gives each chunk's
mean and squared deviations about it within its warp, the deviations' own sum correcting both, and
one reduction across the warps combines the C (mean, squares, count) triples pairwise as Chan et al.
do: one tree across warps instead of two (BENCHMARKS.md, twenty-fourth session).  The mean travels
as hi + lo, lo keeping what each combine rounds off hi (a chunk's starts as its deviations' mean),
so the three accumulators keep the centred form's meaning and accuracy: the sum is n * hi, the
centred sum n * lo (about hi) and the squares are about hi; a store reads hi itself (not
n * hi / n, which a GPU's approximate division rounds).  A constant row centres exactly, and rows
with a mean of 1000 and deviations of 1 come out nearer float64 than eager's (tests/test_triton.py)."""
from __future__ import annotations

from egraph_compiler.loopir import Acc, Call, Const, LoopKernel, calls, contains, substitute

CHUNK = 256  # elements of a chunk: 8 bf16 (16 bytes) a lane, 32 lanes
MIN_ROW = 16384  # rows at least this long: where the three sums stay under 85% of the copy bandwidth on an H200

COMBINE = '''
@triton.jit
def _egc_chan(h1, l1, q1, n1, h2, l2, q2, n2):  # two parts' (mean as hi + lo, squared deviations, count)
    n = n1 + n2
    w = n2 / n
    d = (h2 - h1) + (l2 - l1)
    t = d * w
    h = h1 + t
    return h, l1 + (t - (h - h1)), q1 + q2 + d * d * n1 * w, n  # (the low part keeps what h rounded off)
'''


def centred_moments(k: LoopKernel, rblock: int) -> tuple[int, int, int] | None:
    """The positions of three float32 sums over a row that fills its block, sum(x), sum(x - m) and
    sum((x - m)^2) with m = sum(x) / n, where no other reduction reads them between."""
    if not (k.inner == rblock >= MIN_ROW and rblock % CHUNK == 0):
        return None
    sums = [i for i, red in enumerate(k.reductions) if red.combiner == "sum" and red.dtype == "float32"]
    for i in sums:
        total = k.reductions[i]
        mean = (Acc(total.acc), Const(float(k.inner)))
        j = next((j for j in sums if j > i and _is_call(b := k.reductions[j].body, "sub")
                  and b.args[0] == total.body and _is_call(b.args[1], "div") and b.args[1].args == mean), None)
        centred = k.reductions[j].body if j is not None else None
        q = next((q for q in sums if q > i and _is_call(b := k.reductions[q].body, "mul")
                  and b.args == (centred, centred)), None)
        if j is None or q is None or (k.stash_last and len(k.reductions) - 1 in (i, j, q)):
            continue
        later = [red.body for m, red in enumerate(k.reductions) if m > i and m not in (j, q)]
        if any(contains(body, Acc(r.acc)) for body in later for r in (total, k.reductions[j], k.reductions[q])):
            continue  # (another reduction reads them: keep the order)
        return i, j, q
    return None


def render(expr, total, centred, squares, rblock: int) -> list[str]:
    """The lines computing the three sums' accumulators (`expr` renders a loop-IR expression)."""
    t, c, n = total.acc, rblock // CHUNK, float(rblock)
    return [f"    {t}_v = ({expr(total.body)}) + tl.zeros([XBLOCK, RBLOCK], tl.float32)",
            f"    {t}_c = tl.reshape(tl.where(mask, {t}_v, 0.0), [XBLOCK, {c}, {CHUNK}])",
            f"    {t}_cm = tl.sum({t}_c, axis=2) / {float(CHUNK)!r}",
            f"    {t}_cd = {t}_c - {t}_cm[:, :, None]",
            f"    {t}_cs, {t}_cq = tl.reduce(({t}_cd, {t}_cd * {t}_cd), 2, _egc_add2)",
            f"    {t}_m, {t}_l, {t}_q, {t}_n = tl.reduce(({t}_cm, {t}_cs / {float(CHUNK)!r}, "
            f"{t}_cq - {t}_cs * {t}_cs / {float(CHUNK)!r}, tl.full([XBLOCK, {c}], {float(CHUNK)!r}, tl.float32)), "
            f"1, _egc_chan, keep_dims=True)",
            f"    {t} = {t}_m * {n!r}",
            f"    {centred.acc} = {t}_l * {n!r}",
            f"    {squares.acc} = {t}_q + {t}_l * {t}_l * {n!r}"]


def stored(value, k: LoopKernel, total) -> object:
    """A store's value reading the row as kept (`{acc}_v`) and the mean as the reduction gave it."""
    mean = (Acc(total.acc), Const(float(k.inner)))
    value = substitute(value, total.body, Acc(f"{total.acc}_v"))
    for div in {e for e in calls(value, "div") if e.args == mean}:  # (of any node's dtype)
        value = substitute(value, div, Acc(f"{total.acc}_m"))
    return value


def _is_call(e, op: str) -> bool:
    return isinstance(e, Call) and e.op == op
