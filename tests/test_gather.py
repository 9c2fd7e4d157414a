"""Gathers in generated code (loopir.Gather): embedding lookups, torch.gather and
index_select read rows by index inside a kernel, fused with what consumes them;
an index out of range is an error, never a read out of bounds; on both targets."""
import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from concurrency import in_threads
from egraph_compiler.errors import IndexOutOfRange

TARGETS = ["cpu", "triton"]


def token_and_position(ids, table, positions, w, b):
    """GPT-2's input: token rows plus position rows, then the first layer norm."""
    h = F.embedding(ids, table) + F.embedding(torch.arange(ids.shape[-1]), positions)
    return F.layer_norm(h, (table.shape[1],), w, b)


def inputs(ids_dtype=torch.int64, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randint(0, 50, (2, 8), dtype=ids_dtype), torch.randn(50, 16, dtype=dtype),
            torch.randn(8, 16, dtype=dtype), torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embeddings_and_norm_are_one_kernel(target, ids_dtype):
    args = inputs(ids_dtype)
    compiled = egc.compile(token_and_position, args, target=target)
    assert [k.kind for k in compiled.plan.kernels] == ["generated"], str(compiled.plan)
    assert compiled.plan.count("embedding") == 2 and not compiled.plan.fallbacks
    torch.testing.assert_close(compiled(*args), token_and_position(*args))
    args[0] = torch.randint(0, 50, (2, 8), dtype=ids_dtype)  # other indices, same program
    torch.testing.assert_close(compiled(*args), token_and_position(*args))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [50, 1000, -1])
def test_an_index_out_of_range_is_an_error_not_a_read(target, bad):
    args = inputs()
    compiled = egc.compile(token_and_position, args, target=target)
    wrong = [a.clone() for a in args]
    wrong[0][1, 3] = bad
    with pytest.raises(IndexError, match="index out of range in embedding"):
        compiled(*wrong)
    with pytest.raises(IndexError):  # as torch itself says
        token_and_position(*wrong)
    torch.testing.assert_close(compiled(*args), token_and_position(*args))  # the flag was reset
    assert issubclass(IndexOutOfRange, IndexError)


@pytest.mark.parametrize("target", TARGETS)
def test_bf16_table(target):
    args = inputs(dtype=torch.bfloat16)
    compiled = egc.compile(token_and_position, args, target=target)
    assert not compiled.plan.fallbacks, str(compiled.plan)
    expected = token_and_position(*[a.float() if a.is_floating_point() else a for a in args])
    torch.testing.assert_close(compiled(*args).float(), expected, atol=5e-2, rtol=5e-2)


GATHERS = {
    "along_last": (lambda x, i: torch.gather(x, 1, i) * 2, [(3, 7), (3, 5, 7)]),
    "along_first": (lambda x, i: torch.gather(x, 0, i).exp(), [(3, 7), (2, 7, 3)]),
    "of_a_transposed_view": (lambda x, i: torch.gather(x.t(), 0, i) + 1, [(3, 7), (4, 3, 7)]),
    "index_select": (lambda x, i: torch.index_select(x, 0, i).relu(), [(9, 4), (6, 9)]),
    "a_single_row": (lambda x, i: F.embedding(i, x) - 1, [(1, 5), (4, 1)]),
    "no_indices": (lambda x, i: F.embedding(i, x) * 3, [(6, 5), (0, 6)]),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(GATHERS))
def test_gathers_match_eager(target, name):
    fn, (source, (*index, high)) = GATHERS[name]
    torch.manual_seed(1)
    args = [torch.randn(source), torch.randint(0, high, tuple(index))]
    compiled = egc.compile(fn, args, target=target)
    assert not compiled.plan.fallbacks, str(compiled.plan)
    torch.testing.assert_close(compiled(*args), fn(*args))


@pytest.mark.parametrize("target", TARGETS)
def test_gathered_indices_pick_rows(target):
    """BERT's token types: gather integer indices from a buffer, then look rows up by them."""
    def token_types(buffer, positions, table):
        return F.embedding(torch.gather(buffer, 1, positions), table) * 2
    args = [torch.tensor([[0, 1, 1, 0, 2]]), torch.tensor([[4, 3, 2, 1, 0, 0]]), torch.randn(3, 8)]
    compiled = egc.compile(token_types, args, target=target)
    assert [k.kind for k in compiled.plan.kernels] == ["generated"], str(compiled.plan)
    torch.testing.assert_close(compiled(*args), token_types(*args))


def test_gather_kernels_compile_for_an_h200_without_a_gpu():
    """Through Triton's GPU compiler (sm_90), with the device assert that debug keeps."""
    pytest.importorskip("triton")
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    modules = []
    for dtype in (torch.float32, torch.bfloat16):
        compiled = egc.compile(token_and_position, inputs(dtype=dtype), target="triton")
        modules.append((compiled.source, compiled.loop_kernels))
    fn, (source, (*index, high)) = GATHERS["of_a_transposed_view"]
    compiled = egc.compile(fn, [torch.randn(source), torch.randint(0, high, tuple(index))], target="triton")
    compile_for_gpu(modules + [(compiled.source, compiled.loop_kernels)])


def masked_rows(mask, x, table, rows, cols):
    """Advanced indexing by integer tensors as transformers builds its masks (`mask[batch, kv]`,
    broadcast index tensors, a bool source), with negative indices and trailing dims."""
    b = torch.arange(mask.shape[0])[:, None, None, None]
    kv = torch.arange(mask.shape[1])[None, None, None, :]
    return mask[b, kv] & (kv >= 0), x[rows, cols] * 2, table[rows[:, :1] - 5]


@pytest.mark.parametrize("target", TARGETS)
def test_advanced_indexing_is_a_gather(target):
    mask = torch.rand(3, 7) > 0.3
    x, table = torch.randn(4, 5, 6), torch.randn(5, 3, 2)
    rows, cols = torch.tensor([[0, -1], [3, 2]]), torch.tensor([4, -5])
    compiled = egc.compile(masked_rows, [mask, x, table, rows, cols], target=target)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks
    assert compiled.plan.count("embedding") == 3
    for got, want in zip(compiled(mask, x, table, rows, cols), masked_rows(mask, x, table, rows, cols)):
        torch.testing.assert_close(got, want)
    rows = torch.tensor([[0, -1], [4, 2]])  # 4 is past x's 4 rows; -5 is before them
    with pytest.raises(IndexError):
        compiled(mask, x, table, rows, cols)
    with pytest.raises(IndexError):
        masked_rows(mask, x, table, rows, cols)


@pytest.mark.parametrize("target", TARGETS)
def test_an_index_past_its_own_dim_is_an_error_even_where_the_flat_row_exists(target):
    """x[i, j] reads row i * n1 + j of x's rows: j = n1 (or i = -n0 - 1 after wrapping) would land
    on another row that exists.  Eager raises, and so does ours; in range (negatives too) it reads."""
    x = torch.randn(4, 5, 3)
    pick = lambda x, i, j: x[i, j] * 2  # noqa: E731
    compiled = egc.compile(pick, [x, torch.tensor([0, 1]), torch.tensor([2, 3])], target=target)
    i, j = torch.tensor([3, -4]), torch.tensor([-1, 4])
    torch.testing.assert_close(compiled(x, i, j), pick(x, i, j))
    for i, j in (([0, 1], [5, 0]), ([0, -5], [1, 2]), ([3, 0], [4, -6]), ([4, 0], [0, 0])):
        i, j = torch.tensor(i), torch.tensor(j)
        with pytest.raises(IndexError):
            pick(x, i, j)
        with pytest.raises(IndexError):
            compiled(x, i, j)


@pytest.mark.parametrize("target", TARGETS)
def test_index_select_along_any_dim_and_roll_are_gathers(target):
    """index_select along a middle or last dim, and `roll` (torch's core decomposition reads it by
    index_select: Swin's shifted windows); a negative index_select index is an error, as eager's."""
    x = torch.randn(2, 6, 5, 3)
    fn = lambda x, i: (x.index_select(2, i) + 1, x.roll((-3, 2), (1, 2)) * 2, x.roll(1))  # noqa: E731
    i = torch.tensor([4, 0, 0, 2])
    compiled = egc.compile(fn, [x, i], target=target)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks
    for got, want in zip(compiled(x, i), fn(x, i)):
        torch.testing.assert_close(got, want)
    for bad in ([0, 5, 1, 1], [-1, 2, 0, 0]):
        with pytest.raises((IndexError, RuntimeError)):
            fn(x, torch.tensor(bad))
        with pytest.raises(IndexError):
            compiled(x, torch.tensor(bad))


@pytest.mark.parametrize("target", TARGETS)
def test_threads_each_see_their_own_index_errors(target):
    """ctypes lets go of the GIL while a C++ kernel runs, and the gather's error flag was one per
    kernel: a thread with ids in range could read and clear the flag another thread's bad id had
    set, so one call raised for nothing and the other returned rows it never read.  Flags are per
    thread (cpp_load._checked; triton_launch.checked the same)."""
    torch.manual_seed(0)
    good = [torch.randint(0, 500, (64, 256)), torch.randn(500, 64), torch.randn(256, 64), torch.randn(64),
            torch.randn(64)]
    bad = [good[0].clone()] + good[1:]
    bad[0][5, 7] = 500
    compiled = egc.compile(token_and_position, good, target=target)
    want = token_and_position(*good)
    anomalies = []

    def calls(args, expect_error):
        for _ in range(40 if target == "cpu" else 4):
            try:
                got = compiled(*args)
            except IndexError:
                if not expect_error:
                    anomalies.append("raised for ids in range")
                continue
            if expect_error:
                anomalies.append("returned for an id out of range")
            elif not torch.allclose(got, want, atol=1e-5):
                anomalies.append("wrong values")
    in_threads(calls, [(a, a is bad) for a in (good, bad) * 2])
    assert not anomalies, anomalies[:5]
