"""Multi-output kernels (egraph_compiler/sharing.py): a residual stream's running
sum is stored once by the kernel that first computes it, not recomputed from
all its terms by every later norm kernel."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from egraph_compiler.cost import PROFILES
from egraph_compiler.plan import verify_plan

LAYERS = 4


def residual_stream(x, w_attn, w_mlp, norm):
    """A pre-norm decoder's skeleton: each layer adds two branches to the stream."""
    h = x
    for i in range(LAYERS):
        h = h + F.rms_norm(h, (x.shape[-1],), norm, 1e-6) @ w_attn[i]
        h = h + torch.relu(F.rms_norm(h, (x.shape[-1],), norm, 1e-6) @ w_mlp[i])
    return F.rms_norm(h, (x.shape[-1],), norm, 1e-6)


def gpt2_stream(x, w, b, proj):
    """GPT-2's form: layer_norm of the stream, flattened to rows for the linear."""
    h = x
    for i in range(LAYERS):
        rows = F.layer_norm(h, (x.shape[-1],), w, b).reshape(-1, x.shape[-1])
        h = h + (rows @ proj[i]).reshape(x.shape)
    return F.layer_norm(h, (x.shape[-1],), w, b)


def inputs(dtype=torch.float32):
    torch.manual_seed(0)
    d = 32
    return [torch.randn(2, 8, d, dtype=dtype), torch.randn(LAYERS, d, d, dtype=dtype) / d ** 0.5,
            torch.randn(LAYERS, d, d, dtype=dtype) / d ** 0.5, torch.rand(d, dtype=dtype) + 0.5]


def activations_read(kernel, x):
    """The stream-shaped tensors a kernel reads (weights and norms left out)."""
    return sum(1 for i in kernel.inputs if i.numel == x.numel())


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_residual_stream_is_stored_once_and_read_by_later_norms(target):
    if target == "triton":
        pytest.importorskip("triton")
    args = inputs()
    compiled = egc.compile(residual_stream, args, target=target)
    verify_plan(compiled.plan)
    generated = [k for k in compiled.plan.kernels if k.kind == "generated"]
    assert sum(len(k.extra_outputs) for k in generated) >= LAYERS, str(compiled.plan)
    assert "also stores add" in str(compiled.plan)
    # without the stores the last norm kernel would read all 2 * LAYERS + 1 terms of the stream
    assert max(activations_read(k, args[0]) for k in generated) <= 3, str(compiled.plan)
    torch.testing.assert_close(compiled(*args), residual_stream(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_stored_value_of_another_shape_than_the_kernel_output(target):
    """GPT-2's norm kernels end in a reshape to rows: the stream ([2, 8, 32]) is
    stored in the loop nest of a [16, 32] output, element k at index k."""
    if target == "triton":
        pytest.importorskip("triton")
    x, proj, _, w = inputs()
    b = torch.randn(32)
    compiled = egc.compile(gpt2_stream, [x, w, b, proj], target=target)
    shapes = [tuple(n.shape) for k in compiled.plan.kernels for n in k.extra_outputs]
    assert (2, 8, 32) in shapes and any(tuple(k.output.shape) == (16, 32) and k.extra_outputs
                                         for k in compiled.plan.kernels), str(compiled.plan)
    torch.testing.assert_close(compiled(x, w, b, proj), gpt2_stream(x, w, b, proj), atol=1e-5, rtol=1e-5)


def test_bfloat16_stream_is_stored_rounded_as_eager_rounds_it():
    args = inputs(torch.bfloat16)
    compiled = egc.compile(residual_stream, args)
    assert any(k.extra_outputs for k in compiled.plan.kernels), str(compiled.plan)
    ref = residual_stream(*[a.float() for a in args])
    eager_error = (residual_stream(*args).float() - ref).abs().max()
    assert (compiled(*args).float() - ref).abs().max() <= 2 * eager_error + 1e-2


def test_a_value_computed_by_one_later_kernel_only_is_not_stored():
    """Storing costs a write and a read: for one later reader of two terms it saves nothing."""
    def two_norms(x, y, w):
        h = x + y
        return F.rms_norm(h, (16,), w), (h * 2).sum(-1)
    x, y, w = torch.randn(4, 16), torch.randn(4, 16), torch.rand(16)
    compiled = egc.compile(two_norms, [x, y, w])
    # (the row sums are per-row values of the norm's row kernel, which stores them: share_row_values)
    assert not any(n.numel == x.numel() for k in compiled.plan.kernels for n in k.extra_outputs), str(compiled.plan)
    for got, want in zip(compiled(x, y, w), two_norms(x, y, w)):
        torch.testing.assert_close(got, want)


def test_stored_streams_compile_for_an_h200_without_a_gpu():
    """The row kernels with an extra store go through Triton's GPU compiler (sm_90)."""
    pytest.importorskip("triton")
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    modules = []
    for dtype in (torch.float32, torch.bfloat16):
        compiled = egc.compile(residual_stream, inputs(dtype), target="triton")
        assert any(k.extra_outputs for k in compiled.plan.kernels)
        modules.append((compiled.source, compiled.loop_kernels))
    compile_for_gpu(modules)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_repeated_layers_kernels_are_compiled_once(target):
    """Kernels equal up to their names (each layer's norm) are rendered once; every step runs that code
    on its own tensors (codegen.walker.unique_kernels)."""
    import re
    if target == "triton":
        pytest.importorskip("triton")
    args = inputs()
    compiled = egc.compile(residual_stream, args, target=target)
    generated = [k for k in compiled.plan.kernels if k.kind == "generated"]
    defined = re.findall(r"(?:void|def) (k\d+)\(", compiled.source)
    assert len(generated) == 2 * LAYERS + 1 and len(defined) <= len(generated) - LAYERS, defined  # 9 kernels, 5 codes
    assert {lk.name for lk in compiled.loop_kernels} >= {k.name for k in generated}  # the loop IR of every kernel
    torch.testing.assert_close(compiled(*args), residual_stream(*args), atol=1e-5, rtol=1e-5)
    other = inputs()[:1] + args[1:]
    torch.testing.assert_close(compiled(*other), residual_stream(*other), atol=1e-5, rtol=1e-5)



def test_gpt2s_training_forward_stores_its_stream_after_the_first_norms_statistics():
    """A training forward decomposes layer_norm (its mean and rstd are saved for backward), so the
    first readers of the stream are the statistics' reductions, which cannot store it (their outputs
    are per row); the first reader that can (the norm's pointwise kernel) stores it, and every later
    norm reads it instead of gathering both embeddings again (15 such kernels of 4 layers before)."""
    tf = pytest.importorskip("transformers")
    import copy
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=16,
                                             use_cache=False, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    torch.compile(model, backend="egraph")(ids).logits.square().mean().backward()
    forward = egc.last_plans()[0]
    gathering = [k.name for k in forward.kernels if k.kind == "generated" and
                 sum(n.op == "embedding" for n in k.ops) >= 2]
    assert len(gathering) <= 3, str(forward)
    reference(ids).logits.square().mean().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


def _norm_module(norm: str, d: int) -> torch.nn.Module:
    return torch.nn.LayerNorm(d) if norm == "layer_norm" else torch.nn.RMSNorm(d, eps=1e-6)


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(2, 8, 32), (3, 5, 7), (16, 16), (1, 1, 1)])
def test_a_training_forward_saves_the_norms_statistics_from_the_normalising_kernel(target, norm, shape):
    """A training forward saves a norm's per-row statistics (layer_norm's mean and rstd, rms_norm's rstd)
    for backward; extraction leaves them to kernels of their own before the kernel that normalises the row
    (three kernels for layer_norm), which computes them anyway: it stores them itself
    (sharing.share_row_values), so the forward is one kernel, and the gradients are eager's."""
    if target == "triton":
        pytest.importorskip("triton")
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(_norm_module(norm, shape[-1]))
    with torch.no_grad():  # weights (and bias) away from their initial values, so that backward reads them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    reference = copy.deepcopy(model)
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    out = torch.compile(model, backend="egraph", options={"target": target})(x)
    out.square().sum().backward()
    want = reference(x_ref)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for got, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)
    forward = egc.last_plans()[0]
    verify_plan(forward)
    if shape[-1] > 1:  # (a row of one element: the statistics fold to constants)
        generated = [k for k in forward.kernels if k.kind == "generated"]
        assert len(generated) == 1, str(forward)
        # the statistics the partitioner saved (it may recompute them in backward instead)
        saved = [o for o in forward.graph.outputs if o.op != "input" and o.numel == x.numel() // shape[-1]]
        assert len(generated[0].extra_outputs) == len(saved), str(forward)
        if shape == (2, 8, 32):  # (saved at this size by torch 2.11-2.13's partitioner)
            assert len(saved) == (2 if norm == "layer_norm" else 1), str(forward)


def test_a_value_with_as_many_elements_as_the_kernel_has_rows_is_not_stored_per_row():
    """LLaMA's rotary angles cat(freqs, freqs) [1, S, D] have as many elements as the kernel that
    rotates q [B, H, S, D] has rows when B * H == D (8 * 8 and 64 on the H200): they are no row's
    statistics, and storing them from that kernel's rows corrupted its output on the GPU."""
    def rotate(q, freqs):
        emb = torch.cat((freqs, freqs), dim=-1)  # [1, S, D]
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * emb.cos() + rotated * emb.sin(), emb
    q, freqs = torch.randn(2, 4, 16, 8), torch.randn(1, 16, 4)  # rows 2 * 4 * 16 = 128 = 16 * 8
    compiled = egc.compile(rotate, [q, freqs])
    assert not any(n.numel < k.output.numel for k in compiled.plan.kernels for n in k.extra_outputs), \
        str(compiled.plan)
    for got, want in zip(compiled(q, freqs), rotate(q, freqs)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_reduction_over_fewer_elements_than_the_kernels_rows_is_not_stored_per_row(target):
    """x.sum() of x [2] beside layer_norm(x.repeat(2)), one row of 4: the sum is one value for the
    kernel's one row, but of 2 elements, and the lowering of stored values (not probed as the
    output is) summed it over the row's 4, reading past x (a random program's heap corruption
    under the Triton interpreter).  x sits at the head of a NaN-filled storage: a read past it shows."""
    def f(x):
        return F.layer_norm(x.repeat(2), (4,)) * 2.0, x.sum()
    storage = torch.full((8,), float("nan"))
    x = storage[:2]
    x.copy_(torch.tensor([0.5, -1.25]))
    compiled = egc.compile(f, [x], target=target)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_kernel_keeps_the_inputs_of_the_values_it_stores_beside_its_output(target):
    """Soak 19004:3:36 (H200 box), made by hand: `(x * w).amax` is taken beside relu(v) * w, which
    reads x for v = x * y + z; share_results then had that kernel read v from softmax's kernel
    instead, and recomputed its inputs from its output alone: x went, and the amax read a buffer
    the kernel was not passed (C++: a compile error; Triton: KeyError 'in0')."""
    def f(x, y, z, w):
        v = x * y + z
        return torch.softmax(v, -1), torch.relu(v) * w, (x * w).amax(-1, keepdim=True)
    args = [torch.randn(8, 32) for _ in range(4)]
    compiled = egc.compile(f, args, target=target)
    for got, want in zip(compiled(*args), f(*args)):
        torch.testing.assert_close(got, want)


def test_a_kernel_that_takes_in_row_values_stays_within_the_expression_limit(monkeypatch):
    """Soak 32003 (a `deep` program of 0-d steps): make_plan cut a chain whose written-out
    expression passed expression_size.MAX_EXPRESSION into kernels of their own, and
    share_row_values took 45 of them back into one row kernel, each computed inline from the
    row: 17 MB of C++ that g++ did not build in minutes.  A value is taken in only while the
    kernel's lowered expressions, as written (expression_size.written_size), stay within the
    limit; here a limit between the row kernel's size with one and with both row values."""
    from egraph_compiler import expression_size
    from egraph_compiler.loopir import expressions

    def fn(x):
        y = x
        for _ in range(3):
            y = y * y + y
        return torch.exp(y).sum(-1), torch.tanh(y).amax(-1), y * 2.0
    x = torch.randn(64, 128) * 0.1
    taken = lambda c: sum(len(k.extra_outputs) for k in c.plan.kernels)  # noqa: E731
    unlimited = egc.compile(fn, [x])
    assert taken(unlimited) == 2, str(unlimited.plan)
    monkeypatch.setattr(expression_size, "MAX_EXPRESSION", 20)
    limited = egc.compile(fn, [x])
    assert taken(limited) == 1, str(limited.plan)
    monkeypatch.setattr(expression_size, "MAX_EXPRESSION", 12)
    for compiled in (limited, egc.compile(fn, [x])):
        assert all(expression_size.written_size(expressions(lk)) <= 40 for lk in compiled.loop_kernels)
        for got, want in zip(compiled(x), fn(x)):
            torch.testing.assert_close(got, want)
    assert taken(egc.compile(fn, [x])) == 0


def gelu_backward_for_gemm_and_bias(grad, x, w):
    """BERT's backward through GELU: the value goes to a GEMM as rows and to the bias's column sum."""
    cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
    pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
    d = grad * (cdf + x * pdf)
    return d.reshape(-1, x.shape[-1]) @ w, d.sum((0, 1))


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("shape, stored", [((4, 32, 64), True), ((3, 5, 5), True), ((1, 1, 8), False)])
def test_a_value_both_kernels_compute_at_equal_bytes_is_stored_where_it_costs_less(target, shape, stored, monkeypatch):
    """Storing it moves as many bytes as recomputing it from its two inputs, but the column sum
    then no longer evaluates erf and exp per element: stored where transcendentals cost what they
    cost on a 2-core Xeon (3 FLOPs of arithmetic a FLOP), recomputed where they cost no more
    than arithmetic (the fixed table) or where the launches cost more than both (8 elements)."""
    if target == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    args = [torch.randn(shape), torch.randn(shape), torch.randn(shape[-1], 16)]
    for factor, kernels in ((1.0, 2), (3.0, 1 if stored else 2)):
        monkeypatch.setitem(PROFILES, "cpu", replace(PROFILES["cpu"], exp_cost=factor, tanh_cost=factor))
        compiled = egc.compile(gelu_backward_for_gemm_and_bias, args, target=target, profile="cpu-default")
        verify_plan(compiled.plan)
        with_erf = [k for k in compiled.plan.kernels if any(n.op == "erf" for n in k.ops)]
        assert len(with_erf) == kernels and bool(with_erf[0].extra_outputs) == (kernels == 1), str(compiled.plan)
    for got, want in zip(compiled(*args), gelu_backward_for_gemm_and_bias(*args)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
