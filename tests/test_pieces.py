"""Kernels over a concatenation run one loop nest per operand (egraph_compiler/pieces.py): on
the C++ target one function of loop nests, on Triton a reduction's bodies chosen by the grid's
third axis.  Each against eager, and the split ones with no `where` left to choose an operand."""
import pytest
import torch
import torch.nn.functional as F

import egraph_compiler
from egraph_compiler.loopir import Affine, Call, Const, Index, Load, LoopKernel, Param
from egraph_compiler.pieces import MAX_PIECES, pieces


def _heads(a, b, c):
    """Attention's q/k/v gradients back to [tokens, 3 * hidden] (a training backward's cat)."""
    q = a.permute(0, 2, 1, 3).reshape(-1, a.shape[1] * a.shape[3])
    k = b.permute(0, 3, 1, 2).reshape(-1, b.shape[1] * b.shape[2])
    v = c.permute(0, 2, 1, 3).reshape(-1, c.shape[1] * c.shape[3])
    return torch.cat([q, k, v], 1)


def _f(*shape):
    return lambda: torch.randn(*shape)


CATS = {  # name: (fn, input makers, pieces of the split kernel or 0 for a kernel left whole)
    "rows_three_widths": (lambda a, b, c: torch.cat([a, b, c], 1) * 2.0, [_f(6, 3), _f(6, 5), _f(6, 7)], 3),
    "along_dim0": (lambda a, b: torch.cat([a.exp(), b], 0) + 1.0, [_f(5, 40), _f(9, 40)], 2),
    "column_sums": (lambda a, b: torch.cat([a, b * 3.0], 1).sum(0), [_f(300, 24), _f(300, 40)], 2),
    # a qkv bias's gradient over token rows, long enough that each piece alone would split its rows
    "column_sums_of_many_rows": (lambda a, b, c: torch.cat([a, b, c], 1).sum(0), [_f(1100, 16)] * 3, 3),
    "row_sums_of_dim0_cat": (lambda a, b: torch.cat([a, b], 0).sum(-1), [_f(3, 64), _f(70, 64)], 2),
    "attention_grads": (lambda a, b, c: _heads(a, b, c) * 0.5,
                        [_f(2, 4, 32, 16), _f(2, 4, 16, 32), _f(2, 4, 32, 16)], 3),
    "attention_grads_bias_sum": (lambda a, b, c: _heads(a, b, c).sum(0),
                                 [_f(2, 4, 32, 16), _f(2, 4, 16, 32), _f(2, 4, 32, 16)], 3),
    "int_cast_beside_float": (lambda a, b: torch.cat([a.float(), b], 1) * 2, [lambda: torch.arange(12).reshape(4, 3),
                                                                           _f(4, 5)], 2),
    "ints": (lambda a, b: torch.cat([a, b + 1], 1), [lambda: torch.arange(12).reshape(4, 3),
                                                     lambda: torch.arange(8).reshape(4, 2)], 2),
    "bf16": (lambda a, b: torch.cat([a, b], 1) * 2.0, [lambda: torch.randn(8, 24).bfloat16(),
                                                       lambda: torch.randn(8, 40).bfloat16()], 2),
    "one_wide_operand": (lambda a, b: torch.cat([a, b], 1) - 1.0, [_f(7, 1), _f(7, 9)], 2),
    "many_operands": (lambda *xs: torch.cat([x * 2.0 for x in xs], 1), [_f(4, 3)] * (MAX_PIECES + 4), 0),
    "softmax_of_a_cat": (lambda a, b: torch.softmax(torch.cat([a, b], 1), -1), [_f(6, 10), _f(6, 7)], 0),
    "middle_dim": (lambda a, b: torch.cat([a, b], 1) * 2.0, [_f(3, 4, 8), _f(3, 5, 8)], 0),
}


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("name", sorted(CATS))
def test_kernels_over_a_cat(name, target):
    fn, makers, expected = CATS[name]
    torch.manual_seed(0)
    xs = [m() for m in makers]
    compiled = egraph_compiler.compile(fn, xs, target=target)
    assert not compiled.plan.fallbacks, str(compiled.plan)
    got, want = compiled(*xs), fn(*xs)
    torch.testing.assert_close(got, want, rtol=1e-2 if want.dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    (kernel,) = [k for k in compiled.loop_kernels if "lt(index" in str(k)]  # the kernel computing the cat
    split = pieces(kernel)
    assert len(split) == max(expected, 1), [str(p) for p in split]
    if expected:  # every piece reads one operand: no position test left
        assert all("where" not in str(p) for p in split), [str(p) for p in split]
        if target == "triton" and kernel.reductions:  # (a pointwise cat keeps its `where` there)
            assert f"tl.program_id(2) == {expected - 1}" in compiled.source, compiled.source
            # a column sum down many rows: the pieces split the rows too (triton_split.split_pieces)
            assert ("_part(" in compiled.source) == (name == "column_sums_of_many_rows"), compiled.source


def test_pieces_cover_the_domain_once():
    """The pieces of a kernel tile its domain: their stores, enumerated, are the whole kernel's."""
    a, b, c = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8, 4)
    compiled = egraph_compiler.compile(lambda a, b, c: _heads(a, b, c) + 0.5, [a, b, c])
    (kernel,) = compiled.loop_kernels

    def written(k):
        at = set()
        for o in range(k.outer):
            for r in range(k.inner):
                at.add(_evaluate(k.store_index, {"o": o, "r": r}))
        return at
    parts = pieces(kernel)
    sets = [written(p) for p in parts]
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == len(written(kernel)) == 16 * 36


def _evaluate(index, env) -> int:
    total = index.const
    for term, c in index.terms:
        if term[0] == "var":
            total += c * env[term[1]]
        else:
            inner = _evaluate(term[1], env)
            total += c * (inner // term[2] if term[0] == "div" else inner % term[2])
    return total


def test_a_piece_keeps_the_cats_dtype():
    """A side whose dtype is not the cat's is cast to it once the `where` is gone (torch.cat promotes;
    the Graph IR casts first today, so this is the loop IR's own guarantee)."""
    r, o = Affine.var("r", 5), Affine.var("o", 4)
    value = Call("where", (Call("lt", (Index(r), Const(2.0)), "bool"), Load("a", r.mod(2) + o.scale(2)),
                           Load("b", (r + Affine.of(1)).mod(3) + o.scale(3))), "float32")
    kernel = LoopKernel("k", [Param("a", "int64", "in"), Param("b", "float32", "in"), Param("out", "float32", "out")],
                        4, 5, store_param="out", store_index=r + o.scale(5), value=value)
    first, second = pieces(kernel)
    assert first.value == Call("cast", (Load("a", Affine.var("r", 2) + o.scale(2)),), "float32")
    assert second.value == Load("b", Affine.var("r", 3) + o.scale(3))
    assert (first.inner, second.inner, second.store_index.const) == (2, 3, 2)


def test_triton_pieces_compile_for_an_h200_without_a_gpu():
    """Reductions over a cat in pieces (a column sum, row sums, a bias's gradient) through Triton's
    GPU compiler (sm_90), and a transposing pointwise kernel in tiles."""
    pytest.importorskip("triton")
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    modules = []
    for name in ("column_sums", "row_sums_of_dim0_cat", "attention_grads_bias_sum", "attention_grads",
                 "column_sums_of_many_rows"):
        fn, makers, _ = CATS[name]
        compiled = egraph_compiler.compile(fn, [m() for m in makers], target="triton")
        assert ("tl.program_id(2) == 1" in compiled.source) == ("sum" in name), compiled.source
        modules.append((compiled.source, compiled.loop_kernels))
    compile_for_gpu(modules)


STRIPS = {  # name: (fn, input shape, the run length the row loop takes or 0)
    "heads_merged": (lambda x: x.permute(0, 2, 1, 3).reshape(x.shape[0] * x.shape[2], -1) * 2.0, (2, 4, 8, 16), 16),
    "heads_merged_bf16": (lambda x: x.permute(0, 2, 1, 3).reshape(x.shape[0] * x.shape[2], -1).sigmoid(),
                          (2, 3, 8, 32), 32),
    "short_runs": (lambda x: x.permute(0, 2, 1, 3).reshape(x.shape[0] * x.shape[2], -1) + 1.0, (2, 4, 8, 4), 0),
    "rows_in_order": (lambda x: x * 3.0, (6, 40), 0),
    # a rotary embedding's rotate_half on merged heads: reads ((r % 64) % 32) + 64 * (r / 64), in runs of 32
    "rotate_half_merged": (lambda x: (x * 2.0 + torch.cat([-x[..., 32:], x[..., :32]], -1)).reshape(x.shape[0], -1),
                           (6, 4, 64), 32),
}


@pytest.mark.parametrize("name", sorted(STRIPS))
def test_rows_read_in_runs(name):
    """A row read in runs of m (a head's dims) loops over the runs, each read in order with no
    division (pieces.strips); the others as before.  Each against eager."""
    from egraph_compiler.pieces import strips
    fn, shape, m = STRIPS[name]
    x = torch.randn(shape, dtype=torch.bfloat16 if "bf16" in name else torch.float32)
    compiled = egraph_compiler.compile(fn, [x])
    (kernel,) = compiled.loop_kernels
    found = strips(kernel)
    assert (found[0] if found else 0) == m, str(kernel)
    if m:
        assert f"rl < {m}" in compiled.source and "%" not in str(found[1].value), compiled.source
    torch.testing.assert_close(compiled(x), fn(x))


def test_tiles_read_a_divided_index_in_order():
    """A transposing kernel whose reads divide the outer index (`o % 128`: heads) reads each tile's
    row in order: the division is the tile's, not the element's."""
    b = torch.randn(2, 4, 16, 128)
    fn = lambda b: b.permute(0, 3, 1, 2).reshape(256, 64) * 0.5  # noqa: E731
    compiled = egraph_compiler.compile(fn, [b])
    body = compiled.source[compiled.source.index("tile0[rl * 32 + ol] = "):].split("\n")[0]
    assert "ol)" not in body and "% " in body, body  # ((ob) % 4): per tile
    torch.testing.assert_close(compiled(b), fn(b))


@pytest.mark.parametrize("shape", [(64, 32), (70, 45), (33, 200)])
def test_triton_transposes_in_tiles(shape):
    """Triton runs a transposing pointwise kernel in 64x32 blocks (ragged edges masked)."""
    from egraph_compiler.codegen.triton import _Kernel
    x = torch.randn(shape)
    fn = lambda x: torch.nn.functional.gelu(x).t().contiguous() + 1.0  # noqa: E731
    compiled = egraph_compiler.compile(fn, [x], target="triton")
    from egraph_compiler.loopir import transposed_reads
    (kernel,) = [k for k in compiled.loop_kernels if transposed_reads(k)]
    assert (_Kernel(kernel).xblock, _Kernel(kernel).rblock) == (64, 32), str(kernel)
    torch.testing.assert_close(compiled(x), fn(x))


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_piece_without_the_kernels_gather(target):
    """A cat of a plain operand and an embedding's rows: the first piece reads no gathered row, yet
    the function keeps the error flag's parameter the second piece needs (C++ named an undeclared
    flag: soak, seed 12002); an index out of range still raises."""
    table, ids, x = torch.randn(10, 8), torch.tensor([[1, 9, 0], [4, 4, 2]]), torch.randn(2, 3, 5)
    fn = lambda table, ids, x: torch.cat([x, F.embedding(ids, table)], -1) * 2.0  # noqa: E731
    compiled = egraph_compiler.compile(fn, [table, ids, x], target=target)
    torch.testing.assert_close(compiled(table, ids, x), fn(table, ids, x))
    with pytest.raises(IndexError):
        compiled(table, torch.tensor([[1, 10, 0], [4, 4, 2]]), x)


def _class_token_and_patches(cls, conv, pos):
    """ViT's embeddings under its first layer norm: a cat along the rows' dim (one operand per row,
    so a `where` of the row index chooses it) of a transposed convolution output."""
    patches = conv.flatten(2).transpose(1, 2)
    x = torch.cat([cls.expand(conv.shape[0], -1, -1), patches], 1) + pos
    return F.layer_norm(x, (x.shape[-1],))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cat_chosen_per_row_is_selected_on_bits_and_keeps_every_value(dtype):
    """A `where` whose condition is the same along a row renders as `egc_where_row` (a select on
    the bits, which g++ vectorises; its `c ? a : b` ran ViT's kernel scalar).  The values chosen
    keep NaN and infinities as the operand had them."""
    torch.manual_seed(0)
    cls, conv, pos = torch.randn(1, 1, 64), torch.randn(3, 64, 5, 5), torch.randn(1, 26, 64)
    cls[0, 0, :4] = torch.tensor([float("inf"), float("nan"), -0.0, 1e-40])  # (a row of NaN's layer norm)
    conv[1, :, 2, 3] = float("-inf")
    args = [t.to(dtype) for t in (cls, conv, pos)]
    compiled = egraph_compiler.compile(_class_token_and_patches, args, target="cpu")
    assert "egc_where_row(" in compiled.source and len(compiled.plan.kernels) == 1, str(compiled.plan)
    torch.testing.assert_close(compiled(*args), _class_token_and_patches(*args), equal_nan=True,
                               **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    select = lambda c, a, b: torch.where(c.reshape(-1, 1) > 0, a, b).sum(1)  # a chosen value as it is
    c, a, b = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([[-0.0, float("inf")]] * 3), torch.full((3, 2), float("nan"))
    chosen = egraph_compiler.compile(select, [c, a, b], target="cpu")
    assert "egc_where_row(" in chosen.source
    torch.testing.assert_close(chosen(c, a, b), select(c, a, b), equal_nan=True)
