"""Sizes as kernel arguments (codegen/sizes.py): a program that differs from an earlier one
only in sizes runs on one template build, with its own sizes passed at each call; never where
its source differs otherwise, and never with a size where the language needs a constant."""
import random

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from egraph_compiler import cache
from egraph_compiler.codegen import cpp, cpp_load
from egraph_compiler.codegen.sizes import Templates

from tests.test_random_programs import random_program


def ln_relu_sum(x, w, b):
    return torch.relu(F.layer_norm(x, (x.shape[-1],), w, b)) * 2 + x.sum(-1, keepdim=True)


def test_third_size_reuses_the_template_build():
    w, b = torch.randn(96), torch.randn(96)
    seen = []
    for rows in (40, 56, 72, 3, 17):  # below the threshold for threads: one loop form throughout
        x = torch.randn(rows, 96)
        before = cache.builds
        compiled = egc.compile(ln_relu_sum, [x, w, b])
        torch.testing.assert_close(compiled(x, w, b), ln_relu_sum(x, w, b))
        seen.append((compiled.sizes, cache.builds - before))
    assert seen[0][0] is None  # the first of its form: literals
    assert seen[1] == ([56], 1)  # the second: the row count becomes an argument, built once
    assert seen[2] == ([72], 0) and seen[3] == ([3], 0) and seen[4] == ([17], 0)  # the rest: that build
    assert "egc_s0 = 17" in compiled.levels.source and "o < egc_s0" in compiled.levels.source


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_dynamic_model_builds_once_for_later_sizes(model):
    """`dynamic=True` on a transformers model (GPT-2's and BERT's position gathers read `o % seq`):
    a third sequence length compiles no C++, and every length matches eager.  (LLaMA's rotary
    kernels divide the row index inside their row loops: each length keeps its own build.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if model == "gpt2":
        net = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                                             bos_token_id=0, eos_token_id=0)).eval()
    else:
        net = transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=64)).eval()
    compiled = torch.compile(net, backend="egraph", dynamic=True)
    with torch.no_grad():
        for seq in (12, 20, 28):
            ids = torch.randint(0, 100, (2, seq))
            before = cache.builds
            torch.testing.assert_close(compiled(ids).last_hidden_state, net(ids).last_hidden_state,
                                       atol=1e-4, rtol=1e-4)
    assert cache.builds == before and egc.last_compiled()[-1].sizes is not None


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_at_other_sizes(seed):
    """Random programs of views, reductions and row composites at four batch and row counts,
    each against eager (whether it ran on a template or its own build)."""
    rng = random.Random(seed)
    program, steps = random_program(rng)
    cols = rng.choice([6, 16])
    for n, (batch, rows) in enumerate([(2, 4), (3, 4), (3, 6), (5, 9)]):
        x = torch.randn(batch, rows, cols, generator=torch.Generator().manual_seed(seed * 10 + n))
        compiled = egc.compile(program, [x])
        torch.testing.assert_close(compiled(x), program(x), atol=1e-4, rtol=1e-4, equal_nan=True,
                                   msg=lambda m: f"{m}\nsteps: {steps}\nsizes: {compiled.sizes}\n{compiled.plan}")


def _program(rows: int, stash: int = 8) -> str:
    return (f'extern "C" void k0(const float* __restrict__ in0, float* __restrict__ buf0) {{\n'
            f"  for (int64_t o = 0; o < {rows}; ++o) {{\n    const int64_t g = ((o) % {rows // 2});\n"
            f"    alignas(64) float stash[{stash}];\n"
            f"    #pragma omp simd\n    for (int64_t r = 0; r < 8; ++r) {{ buf0[r + 8*o] = in0[r + 8*g]; }}\n"
            f"  }}\n}}\n")


def test_templates_generalise_only_where_programs_differ():
    templates = Templates()
    assert templates.source("cpu", _program(4), cpp_load.SIZED) == (_program(4), None)
    assert templates.source("cpu", _program(4), cpp_load.SIZED) == (_program(4), None)  # the same again
    source, sizes = templates.source("cpu", _program(6), cpp_load.SIZED)
    assert sizes == [6, 3] and templates.built == 1
    assert "o < egc_s0" in source and "% egc_s1" in source and "r < 8" in source and "8*o" in source
    assert "const int64_t egc_s0 = egc_sz[0];" in source and "egc_sz) {" in source
    assert templates.source("cpu", _program(10), cpp_load.SIZED) == (source, [10, 5])  # served by it


@pytest.mark.parametrize("line", ["    #pragma omp simd simdlen({n})", "    alignas({n}) float stash[8];",
                                  "    double acc_c[{n}] = {{}};", "    egc_cast<egc_vec<{n}>>(x);",
                                  "    for (int64_t r = 0; r < 8; ++r) {{ buf0[r] = in0[r % {n}]; }}"])
def test_a_size_where_cpp_needs_a_constant_is_never_an_argument(line):
    templates = Templates()

    def text(n: int) -> str:
        return _program(4).replace("    #pragma omp simd\n", line.format(n=n) + "\n")
    templates.source("cpu", text(16), cpp_load.SIZED)
    assert templates.source("cpu", text(32), cpp_load.SIZED) == (text(32), None)
    assert templates.built == 0


def test_a_stash_takes_a_variable_length():
    templates = Templates()
    templates.source("cpu", _program(4, stash=16), cpp_load.SIZED)
    source, sizes = templates.source("cpu", _program(4, stash=32), cpp_load.SIZED)
    assert sizes == [32] and "stash[egc_s0]" in source


def test_sizes_that_agreed_split_when_a_program_separates_them():
    """Two literals equal in every program seen share one argument; a program where they differ
    is not served by that template (a new one reads them apart)."""
    def text(a: int, b: int) -> str:
        return f'extern "C" void k0(float* __restrict__ buf0) {{\n  for (int64_t o = 0; o < {a}; ++o) {{ buf0[o] = {b}; }}\n}}\n'
    templates = Templates()
    templates.source("cpu", text(4, 4), cpp_load.SIZED)
    first, sizes = templates.source("cpu", text(6, 6), cpp_load.SIZED)
    assert sizes == [6] and first.count("egc_s0") == 3  # declared, bound, stored
    second, sizes = templates.source("cpu", text(8, 9), cpp_load.SIZED)
    assert second != first and sizes == [8, 9] and templates.built == 2


def test_template_builds_compile_and_run():
    """A template's source as g++ builds it: each kernel reads its sizes from the array."""
    templates = Templates()
    templates.source("cpu", _program(4), cpp_load.SIZED)
    source, sizes = templates.source("cpu", _program(6), cpp_load.SIZED)
    kernel = _loop_kernel()
    calls, _ = cpp_load.load(cpp.PRELUDE + source, [kernel], sizes=[10, 5])
    x, out = torch.randn(5 * 8), torch.empty(10 * 8)
    calls["k0"](x, out)
    torch.testing.assert_close(out, x.view(5, 8).repeat(2, 1).view(-1))


def _loop_kernel():
    from egraph_compiler.loopir import LoopKernel, Param
    return LoopKernel("k0", [Param("in0", "float32", "in"), Param("buf0", "float32", "out")], outer=4, inner=8)


# --- the Triton target (the interpreter here; the H200 in tests/test_cuda.py) --------------------

def test_triton_later_sizes_run_the_template_module():
    """Under the Triton target the second row count makes a template whose kernels take the sizes
    they read as int arguments; later counts import nothing new and match eager, and the
    template compiles for an H200 (without one)."""
    from egraph_compiler.codegen import triton_load
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    w, b = torch.randn(80), torch.randn(80)
    seen = []
    for rows in (40, 56, 72, 3, 17, 1):
        x = torch.randn(rows, 80)
        modules = len(triton_load._MODULES)
        compiled = egc.compile(ln_relu_sum, [x, w, b], target="triton")
        torch.testing.assert_close(compiled(x, w, b), ln_relu_sum(x, w, b))
        seen.append((compiled.sizes, len(triton_load._MODULES) - modules, compiled))
    assert seen[0][:2] == (None, 1) and seen[1][:2] == ([56], 1), seen
    assert [s[:2] for s in seen[2:5]] == [([72], 0), ([3], 0), ([17], 0)]
    template = seen[4][2]
    assert "omask = o < egc_s0" in template.source and ", egc_s0, XBLOCK: tl.constexpr" in template.source
    assert set(triton_load.size_params(template.source)) == {lk.name for lk in template.loop_kernels}
    compile_for_gpu([(template.source, template.loop_kernels)])


def test_triton_rows_that_fill_their_block_keep_no_mask_in_a_template():
    """softmax over row lengths that are powers of two: the template (the row length an argument)
    masks its columns by `r < RBLOCK`, which Triton folds away, not by `r < egc_s0`; lengths that
    are not powers of two render another form, whose template keeps the literal mask.  Each
    matches eager, NaN rows included (the row max keeps a NaN)."""
    softmax = lambda x: torch.softmax(x, -1) * 2  # noqa: E731
    built = {}
    for length in (64, 128, 256, 48, 80, 112):
        x = torch.randn(5, length)
        x[1, 3] = float("nan")
        compiled = egc.compile(softmax, [x], target="triton")
        torch.testing.assert_close(compiled(x), softmax(x), equal_nan=True)
        built[length] = compiled
    even, odd = built[256], built[112]
    assert even.sizes and odd.sizes, (even.sizes, odd.sizes)
    assert "rmask = r < RBLOCK" in even.source and "r < egc_s" not in even.source, even.source
    assert "rmask = r < egc_s" in odd.source, odd.source


@pytest.mark.parametrize("line", ["    s = tl.arange(0, {n})[None, :]", "    v = tl.full([{n}], 0.0, tl.float32)",
                                  "    a = tl.sum(v, axis={n})", "    p = tl.program_id({n})"])
def test_a_size_where_triton_needs_a_constant_is_never_an_argument(line):
    from egraph_compiler.codegen import triton_load

    def text(n: int) -> str:
        return (f"@triton.jit\ndef k0(in0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):\n"
                f"    omask = o < {n * 3}\n{line.format(n=n)}\n")
    templates = Templates()
    templates.source("cuda", text(1), triton_load.SIZED)
    assert templates.source("cuda", text(2), triton_load.SIZED) == (text(2), None) and templates.built == 0


def test_a_float_exponent_is_not_a_size():
    """`1e-05` against `1e-06`: a different constant, never a slot (`1e-egc_s0` is no number)."""
    from egraph_compiler.codegen import triton_load
    templates = Templates()

    def text(n: int, eps: str) -> str:
        return f"@triton.jit\ndef k0(in0, XBLOCK: tl.constexpr):\n    omask = o < {n}\n    e = ({eps})\n"
    templates.source("cuda", text(4, "1e-05"), triton_load.SIZED)
    assert templates.source("cuda", text(8, "1e-06"), triton_load.SIZED) == (text(8, "1e-06"), None)
    source, sizes = templates.source("cuda", text(8, "1e-05"), triton_load.SIZED)
    assert sizes == [8] and "(1e-05)" in source and "o < egc_s0" in source


@pytest.mark.parametrize("seed", range(4))
def test_random_programs_at_other_sizes_on_triton(seed):
    rng = random.Random(seed + 100)
    program, steps = random_program(rng)
    for n, (batch, rows) in enumerate([(2, 4), (3, 4), (3, 6)]):
        x = torch.randn(batch, rows, 16, generator=torch.Generator().manual_seed(seed * 10 + n))
        compiled = egc.compile(program, [x], target="triton")
        torch.testing.assert_close(compiled(x), program(x), atol=1e-4, rtol=1e-4, equal_nan=True,
                                   msg=lambda m: f"{m}\nsteps: {steps}\nsizes: {compiled.sizes}\n{compiled.plan}")
