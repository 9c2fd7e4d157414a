"""The CUDA target on a GPU (skipped where there is none, as on CI; run on the
H200 through the device tool): forms the GPU soak found crashing, and random
programs compiled for CUDA against eager and float64 on the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given

import egraph_compiler as egc
from programs import check, failure_message, programs
from test_differential import fuzz_settings
from test_dtypes import BIG, INTEGER_ARITHMETIC
from test_graphs_emulated import _assert_lent, _one_address_two_layouts, _records_once, _training_steps
from test_masks import _Decoder, spy_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {
    # constants (a default weight, linear's zero bias) were made on the CPU
    "layer_norm_no_weight": (lambda x: F.layer_norm(x * 2, x.shape[-1:]), [(4, 33)]),
    "rms_norm_no_weight": (lambda x: F.rms_norm(x + 1, x.shape[-1:]), [(4, 33)]),
    "linear_no_bias": (lambda x, w: F.linear(torch.tanh(x), w), [(4, 8), (5, 8)]),
    # torch's fused attention refuses misaligned views and some masked head sizes
    "sdpa_transposed_view": (lambda x: F.scaled_dot_product_attention(*(x.transpose(-1, 2),) * 3, is_causal=True),
                             [(1, 2, 4, 1)]),
    "sdpa_head_33_float_mask": (lambda q, m: F.scaled_dot_product_attention(torch.log(q.abs() + 1), q, q, attn_mask=m),
                                [(1, 2, 3, 33), (1, 2, 3, 3)]),
    # a stored constant (the NaN mean of no elements) was a Python float to Triton
    "mean_of_nothing": (lambda x: torch.sqrt(x.mean().abs() + 0.5), [(0, 2, 3, 3)]),
    # a constant base of pow was given to tl.zeros_like, which Triton on a GPU refuses (the interpreter takes it)
    "pow_scalar_base": (lambda x: torch.pow(2.0, torch.tanh(x)), [(2, 8, 8)]),
    "nan_constant": (lambda x: torch.where(x > 0, x, float("nan")).sum(-1), [(4, 8)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_soak_regressions(name):
    fn, shapes = CASES[name]
    inputs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    expected = fn(*inputs)
    got = egc.compile(fn, [t.cuda() for t in inputs])(*[t.cuda() for t in inputs])
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4, equal_nan=True)


@fuzz_settings(100)
@given(programs())
def test_random_programs_on_cuda(program):
    outcome = check(program, device="cuda")
    if outcome.failed:
        raise AssertionError(failure_message(program, outcome))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_on_cuda(dtype):
    """Forward and backward graphs generated as Triton kernels: gradients against eager on the GPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64), torch.nn.LogSoftmax(-1)).cuda().to(dtype)
    x = torch.randn(8, 32, 64, device="cuda", dtype=dtype)
    weights = torch.randn(x.shape, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph")
    grads = []
    for fn in (compiled, model):
        model.zero_grad(set_to_none=True)
        (fn(x).float() * weights).sum().backward()
        grads.append([p.grad.float().clone() for p in model.parameters()])
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    scale = max(g.abs().max().item() for g in grads[1])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)
    plans = egc.last_plans()
    assert len(plans) == 2 and not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]


def test_cuda_graphs_replay_with_new_inputs_and_parameters():
    """cuda_graphs=True: recorded on the second call, replayed after; each call's inputs are copied
    in, outputs are the caller's own (a replay never overwrites a result already returned), and a
    reassigned parameter records the graph again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(128, 64)).cuda()
    xs = [torch.randn(4, 32, 64, device="cuda") for _ in range(4)]
    with torch.no_grad():
        compiled = egc.compile(model, [xs[0]], cuda_graphs=True)
        assert compiled.cuda_graph == "warming up"
        outs = [compiled(x) for x in xs]
        assert compiled.cuda_graph == "recorded"
        for x, out in zip(xs, outs):  # every earlier result intact after later replays
            torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
        model[1].weight = torch.nn.Parameter(torch.randn(128, 64, device="cuda"))
        torch.testing.assert_close(compiled(xs[0]), model(xs[0]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(compiled(xs[1]), model(xs[1]), atol=1e-4, rtol=1e-4)


def test_reduce_overhead_mode_through_torch_compile():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.LayerNorm(64)).cuda()
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert [c.cuda_graph for c in egc.last_compiled()] == ["recorded"]


def test_cuda_graphs_read_parameters_in_place_and_follow_moved_inputs():
    """Through Dynamo the parameters are arguments: a replay reads them where they are (no copy per
    parameter), sees in-place updates (an optimizer step), and an argument that moves is re-recorded
    and copied from then on; every result matches eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda()
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph", mode="reduce-overhead")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for step in range(6):
            if step == 3:
                model[0].weight.mul_(0.5)  # in place: same address, new values
            x.copy_(torch.randn(8, 64, device="cuda"))  # the same argument tensor, new values
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        graphed = egc.last_compiled()[-1]._executable.graphed
        assert graphed.recorded and graphed.copied_inputs == 0
        for _ in range(3):  # fresh argument tensors: recorded again once, then x is copied per replay
            y = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(compiled(y), model(y), atol=1e-4, rtol=1e-4)
        assert graphed.copied_inputs == 1


@pytest.mark.parametrize("mask_shape", [(1, 1, 128, 1), (2, 1, 128, 128), (2, 1, 1, 128)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_masks_through_the_fused_kernels(mask_shape, kind):
    """Masks that broadcast along the keys (BERT's `q_idx >= 0`) and boolean masks are handed to
    torch's fused kernels in a form they take; fully masked rows give 0 as torch's math kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(mask_shape, device="cuda") > 0.3
    if mask_shape[-2] > 1:
        keep[..., 3, :] = False  # a fully masked row
    mask = keep if kind == "bool" else torch.zeros(mask_shape, device="cuda", dtype=torch.bfloat16).masked_fill(
        ~keep, float("-inf"))

    def attention(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    compiled = egc.compile(attention, [q, k, v, mask])
    assert [k.output.op for k in compiled.plan.kernels if k.kind == "library"] == ["sdpa_mask"]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = attention(*(t.float() for t in (q, k, v)), mask if kind == "bool" else mask.float())
    got = compiled(q, k, v, mask)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", sorted(INTEGER_ARITHMETIC))
def test_integer_arithmetic_is_exact_on_the_gpu(name):
    fn, p = INTEGER_ARITHMETIC[name], BIG.cuda()
    compiled = egc.compile(fn, [p])
    assert {k.kind for k in compiled.plan.kernels} == {"generated"}, compiled.plan.fallbacks
    got, want = compiled(p), fn(p)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_one_mask_serves_every_layer():
    """Layers share one boolean mask: it is made additive once per run (also inside a CUDA graph,
    whose replays see each call's mask)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda") for _ in range(3))

    def two_layers(q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(a * 2, k, v, attn_mask=mask)
    masks = [torch.rand(2, 1, 64, 64, device="cuda") > p for p in (0.2, 0.5, 0.8)]
    compiled = egc.compile(two_layers, [q, k, v, masks[0]], cuda_graphs=True)
    for mask in masks * 2:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            want = two_layers(q, k, v, mask)
        torch.testing.assert_close(compiled(q, k, v, mask), want, atol=1e-4, rtol=1e-4)
    assert compiled.cuda_graph == "recorded"


def test_grouped_query_attention_with_a_mask():
    """transformers' repeat_kv and a mask: sdpa gets K and V unrepeated (attention_grouped_kv_masked) and
    runs each K/V head's query group on the query axis (ops.grouped_queries), inside a CUDA graph too."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda")
    k, v = (torch.randn(2, 2, 64, 32, device="cuda") for _ in range(2))

    def attend(q, k, v, mask):
        def repeat(x):
            return x[:, :, None].expand(2, 2, 4, 64, 32).reshape(2, 8, 64, 32)
        a = F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)
        return F.scaled_dot_product_attention(a * 2, repeat(k), repeat(v), attn_mask=mask)
    masks = [torch.rand(2, 1, 64, 64, device="cuda") > p for p in (0.2, 0.5)]
    compiled = egc.compile(attend, [q, k, v, masks[0]], cuda_graphs=True)
    assert all(n.args[1].shape[-3] == 2 for n in compiled.plan.graph.topo() if n.op == "sdpa_mask"), compiled.plan
    for mask in masks * 2:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            want = attend(q, k, v, mask)
        torch.testing.assert_close(compiled(q, k, v, mask), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("accumulate, set_to_none", [(1, True), (2, True), (1, False)])
def test_training_graphs_lend_saved_activations_and_gradients(accumulate, set_to_none):
    """reduce-overhead training: the forward's graph lends the activations it saves (no copy out), the
    backward's graph reads them in place and lends the gradients.  Two forwards before their backwards
    (gradient accumulation) hold lent buffers over a call, which then runs without the graph; the second
    time a new recording copies its results out.  Parameters match eager's in every variant."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64), torch.nn.LogSoftmax(-1)).cuda()
    batches = [(torch.randn(8, 32, 64, device="cuda"), torch.randn(8, 32, 64, device="cuda")) for _ in range(8)]
    got, want = _training_steps(model, batches, accumulate, set_to_none)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    _assert_lent(accumulate)


def test_training_graphs_record_once_when_other_work_runs_between_steps():
    """Keys repeated per head, saved by the forward, are the forward graph's own buffers; the incoming
    gradient is copied in from the start: allocations between steps record nothing again."""
    _records_once("cuda")


def test_cuda_graphs_take_strided_inputs_in_place():
    """A transposed argument is made contiguous inside the graph, reading the caller's tensor where it
    is: no copy per call when it stays put; the same address with other strides is not mistaken for it."""
    base = torch.randn(64, 32, device="cuda")

    def fn(a):
        return torch.softmax(a * 2, -1)
    compiled = egc.compile(fn, [base.t()], cuda_graphs=True)
    with torch.no_grad():
        for step in range(4):
            base.normal_()
            torch.testing.assert_close(compiled(base.t()), fn(base.t()), atol=1e-5, rtol=1e-5)
        graphed = compiled._executable.graphed
        assert graphed.recorded and graphed.copied_inputs == 0
        flat = torch.randn(64 * 32, device="cuda")
        for a in (flat.view(64, 32).t(), flat.view(32, 64), flat.view(64, 32).t()):  # one address, two layouts
            torch.testing.assert_close(compiled(a), fn(a), atol=1e-5, rtol=1e-5)


def test_cuda_graphs_under_dynamo_read_one_address_in_two_layouts_as_it_is():
    """Through torch.compile a replay checks addresses only: Dynamo's guards hold the strides."""
    _one_address_two_layouts("cuda")


def test_direct_launches_skip_triton_binding_and_respecialise_on_alignment(monkeypatch):
    """After a kernel's first launch its compiled kernel is launched directly (no
    JITFunction.run per call); a pointer of other alignment (a view one element in) goes
    back through Triton, which compiles that specialisation, and both results are right."""
    from triton.runtime.jit import JITFunction

    def fn(x, y):
        return torch.relu(x) * 2 + y.sum(-1, keepdim=True)
    big = torch.randn(64 * 128 + 1, device="cuda")
    x, y = big[:-1].view(64, 128), torch.randn(64, 128, device="cuda")
    compiled = egc.compile(fn, [x, y])
    calls = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for _ in range(3):
        torch.testing.assert_close(compiled(x, y), fn(x, y))
    first = len(calls)
    assert first <= len(compiled.plan.kernels)  # each kernel once at most, then direct
    for _ in range(3):
        torch.testing.assert_close(compiled(x, y), fn(x, y))
    assert len(calls) == first
    shifted = big[1:].view(64, 128)  # 4 bytes past a 16-byte boundary
    for _ in range(3):
        torch.testing.assert_close(compiled(shifted, y), fn(shifted, y))
    assert len(calls) > first  # the new specialisation went through Triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_masked_with_the_lowest_float_are_the_mean_of_v(dtype):
    """transformers' eager attention masks with finfo.min: a padded query row, masked everywhere,
    is the mean of v in softmax (and in torch's math kernel), but torch's fused CUDA kernels scale
    finfo.min past -inf and gave 0 (GPT-2's padded rows were off by 0.3 on the H200).  Written
    with primitives, and with grouped K/V heads; a row masked with -inf is softmax's NaN."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, 16, 64, device="cuda", dtype=dtype) for _ in range(2))
    m = torch.zeros(2, 1, 16, 16, device="cuda", dtype=dtype)
    m[1, :, :4] = torch.finfo(dtype).min  # rows 0-3 of batch 1 masked everywhere
    m[1, :, 4:, :2] = torch.finfo(dtype).min
    m[0, :, 5] = float("-inf")

    def written(q, k, v, m):
        k, v = (x[:, :, None].expand(2, 2, 2, 16, 64).reshape(2, 4, 16, 64) for x in (k, v))
        return torch.softmax(q @ k.transpose(-1, -2) / 8 + m, -1) @ v
    compiled = egc.compile(written, [q, k, v, m])
    assert [k.output.op for k in compiled.plan.kernels if k.kind == "library"] == ["softmax_attention"]
    want = written(*(t.double() for t in (q, k, v, m)))
    torch.testing.assert_close(compiled(q, k, v, m).double(), want, atol=2e-2, rtol=2e-2, equal_nan=True)


def test_a_cpu_scalar_made_in_forward_follows_the_inputs_to_the_gpu():
    """Mistral's sliding-window mask makes `torch.tensor(...)` scalars on the CPU inside forward;
    export lifts them as constants, which reached the CUDA program as CPU arguments (an
    InputError where eager mixes a CPU scalar with CUDA tensors)."""
    class Model(torch.nn.Module):
        def forward(self, x):
            return x * torch.tensor(3.0) + torch.tensor(1.0) + torch.zeros(0).sum()
    model, x = Model(), torch.randn(4, 8, device="cuda")
    torch._dynamo.reset()
    for compiled in (egc.compile(model, [x]), torch.compile(model, backend="egraph")):
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autotune", [False, True])
def test_layer_norm_moments_are_stable_on_the_gpu(dtype, autotune):
    """layer_norm's centred moments (rules/lowering.rules: the mean, then the centred sum and
    the sum of squared deviations) on rows of every length class, rows far from 0 (means up to
    1000 with deviations of 1) and a constant row, tuned block sizes and not, against float64
    on the same rounded inputs: no further off than eager's own rounding, and a constant row
    centred (its output is b, not b plus its mean's rounding times 1/sqrt(eps))."""
    torch.manual_seed(0)
    for rows, length in ((3, 5), (64, 1000), (16, 16384), (4, 32768), (2, 40000)):
        x = torch.randn(rows, length, dtype=torch.float64) + torch.linspace(-1000, 1000, rows, dtype=torch.float64)[:, None]
        x[0] = 7.3
        w, b = torch.randn(length, dtype=torch.float64), torch.randn(length, dtype=torch.float64)
        fn = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b).relu()  # noqa: E731
        args = [t.to("cuda", dtype) for t in (x, w, b)]
        want = fn(*[a.double().cpu() for a in args])
        got = egc.compile(fn, args, autotune=autotune)(*args).double().cpu()
        reference = fn(*args).double().cpu()
        ulp = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[0], want[0], atol=ulp * 4, rtol=ulp * 4)
        assert (got - want).abs().max() <= 2 * (reference - want).abs().max() + ulp, (rows, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_staged_and_templated_match_eager_on_the_gpu(dtype):
    """softmax over rows of 8k to 32k (bf16 32k: the staged loop over rows, one program per SM;
    from the second length a template whose power-of-two rows keep no mask) and rows of other
    lengths, with a NaN row, a row of -inf and one far from 0: each length right, twice."""
    softmax = lambda x: torch.softmax(x * 2, -1)  # noqa: E731
    staged = []
    for rows, length in ((300, 32768), (200, 8192), (7, 16384), (300, 32768), (5, 20000), (5, 30000)):
        x = torch.randn(rows, length, device="cuda").to(dtype)
        x[1, 7] = float("nan")
        x[2] = float("-inf")
        x[3] += 1000
        compiled = egc.compile(softmax, [x])
        for _ in range(2):
            torch.testing.assert_close(compiled(x).float(), softmax(x).float(), atol=1e-7, rtol=2e-2, equal_nan=True)
        staged.append("num_stages=" in compiled.source)
    assert staged == [dtype == torch.bfloat16, False, False, dtype == torch.bfloat16, False, False], staged


def test_template_kernels_serve_sizes_of_every_specialisation_class():
    """Sizes as arguments (codegen/sizes.py) on the GPU: after the second row count the kernels
    take sizes as ints, which Triton specialises (1, divisible by 16, otherwise); each class
    and each size of one class is right, launched directly after the first launch."""
    def fn(x, w):
        return torch.relu(F.layer_norm(x, x.shape[-1:], w)) + x.sum(-1, keepdim=True)
    w = torch.randn(100, device="cuda")
    seen = []
    for rows in (40, 56, 72, 64, 1, 3, 4096, 4097, 72):
        x = torch.randn(rows, 100, device="cuda")
        compiled = egc.compile(fn, [x, w])
        for _ in range(2):  # (the second call takes the direct launch)
            torch.testing.assert_close(compiled(x, w), fn(x, w), atol=1e-4, rtol=1e-4)
        seen.append(compiled.sizes)
    assert seen[0] is None and seen[1] == [56] and seen[2] == [72] and seen[-1] == [72]
    assert sum(s is not None for s in seen) >= 6


def test_dynamic_gpt2_on_the_gpu_matches_eager_at_each_length():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)).cuda().eval()
    compiled = torch.compile(net, backend="egraph", dynamic=True)
    with torch.no_grad():
        for seq in (12, 20, 28, 32, 1, 28):
            ids = torch.randint(0, 100, (2, seq), device="cuda")
            torch.testing.assert_close(compiled(ids).last_hidden_state, net(ids).last_hidden_state,
                                       atol=1e-4, rtol=1e-4)
    assert any(c.sizes is not None for c in egc.last_compiled())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_gradient_by_atomic_adds_matches_atens(dtype):
    """library.embedding_grad sums in float32 by index_add_ (atomic adds) where ATen sorts 4,096 ids."""
    from egraph_compiler import library
    grad = torch.randn(8, 512, 64, device="cuda", dtype=dtype)
    ids = torch.randint(0, 100, (8, 512), device="cuda")
    want = torch.ops.aten.embedding_dense_backward(grad.double(), ids, 100, 7, False)
    got = library.embedding_grad((grad, ids), {"rows": 100, "padding_idx": 7, "scale": False})
    assert got.dtype == dtype and not got[7].any()
    torch.testing.assert_close(got.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_programs_own_causal_mask_runs_causal_on_the_gpu(dtype, monkeypatch):
    """masks.py on CUDA: inference's masked sdpa (steps._masked_attention) and training's fused
    kernels both ways (cuDNN's in bf16), under CUDA graphs; against the float32 model in eager."""
    calls = spy_attention(monkeypatch)
    torch.manual_seed(0)
    model = _Decoder("lowest").cuda().to(dtype)
    exact = copy.deepcopy(model).float()
    x = torch.randn(2, 64, 32, device="cuda", dtype=dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        compiled = egc.compile(model.eval(), [x])
        torch.testing.assert_close(compiled(x).float(), exact(x.float()), **tol)
    assert calls and all(c[1:] == (True, False) for c in calls), calls
    calls.clear()
    torch._dynamo.reset()
    trained = torch.compile(model.train(), backend="egraph", mode="reduce-overhead")
    for _ in range(3):
        for m, fn, inp in ((model, trained, x), (exact, exact, x.float())):
            m.zero_grad(set_to_none=True)
            fn(inp).float().square().mean().backward()
    for (name, got), want in zip(model.named_parameters(), exact.parameters()):
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=name)
    fused = [c for c in calls if c[0] in ("forward", "backward")]
    assert {c[0] for c in fused} == {"forward", "backward"} and all(c[1:] == (True, False) for c in fused), fused


@pytest.mark.parametrize("train", [False, True])
def test_cuda_autocast_around_a_compiled_model_has_no_fallbacks(train):
    """`torch.autocast("cuda")` around the compiled model (test_autocast.py on the CPU): the region is
    written into Dynamo's graph, so its casts are generated, and results stay within twice eager's
    bf16 error from float32 (on a GPU Triton rounds to nearest, as eager does)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64)).cuda()
    eager, truth = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(32, 64, device="cuda")
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = torch.compile(model, backend="egraph")(x), eager(x)
    expected = truth(x)

    def error(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    assert got.dtype == want.dtype == torch.bfloat16
    assert error(got, expected) <= 2 * error(want, expected) + 1e-3
    plans = egc.last_plans()
    assert plans and not [f for p in plans for f in p.fallbacks], [p.fallbacks for p in plans]


def test_compile_workers_fill_the_cache_the_first_launches_read(monkeypatch, tmp_path):
    """A compile for the GPU starts the compile workers (codegen/triton_workers.py) before its
    e-graph work; they compile every kernel of the module into Triton's cache, so the program's
    first call compiles nothing more (the cache holds as many kernels after it as before), and
    the workers hold no CUDA context (eight would take some 4 GB of the GPU's memory)."""
    from egraph_compiler.codegen import triton_launch, triton_workers
    from egraph_compiler.codegen.triton_build import WARM_MIN_KERNELS
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "egc"))
    monkeypatch.setattr(triton_workers, "_POOL", [None])
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    pool = triton_workers.start(triton_launch.gpu_target())
    assert pool.compile("", [], len(pool.children)) == (0, 0)  # (when each has started and prewarmed)
    assert free - torch.cuda.mem_get_info()[0] < 2 ** 27, (free, torch.cuda.mem_get_info())

    def f(x, w):  # (nine layers of distinct kernels)
        for act in (torch.relu, torch.sigmoid, torch.tanh, F.gelu, F.silu, torch.abs, torch.neg, torch.square, torch.cos):
            x = F.layer_norm(torch.softmax(x @ w, -1) * 4.0 + act(x), x.shape[-1:])
        return x
    x, w = torch.randn(64, 96, device="cuda"), torch.randn(96, 96, device="cuda")
    compiled = egc.compile(f, [x, w])
    defined = [k for k in compiled.loop_kernels if f"def {k.name}(" in compiled.source]
    assert len(defined) >= WARM_MIN_KERNELS, compiled.plan  # (fewer compile in this process, without workers)
    assert triton_workers._POOL[0] is pool and all(child.poll() is None for child in pool.children)
    before = sorted(p.parent.name for p in (tmp_path / "triton").glob("*/*.cubin"))
    assert len(before) >= len(defined)
    torch.testing.assert_close(compiled(x, w), f(x, w), rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    assert sorted(p.parent.name for p in (tmp_path / "triton").glob("*/*.cubin")) == before
    pool.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head", [40, 64, 80, 128])
def test_attention_picks_torchs_kernel_once_and_matches_it_bitwise(dtype, head):
    """library._picked_once: torch's choice of a fused kernel made once per operand layout, the
    kernel then called directly; the outputs are F.scaled_dot_product_attention's, bit for bit,
    for dense and qkv-slice layouts, masks of every kind and causal attention, a second call
    included (the cached pick) and a call on other strides (a pick of its own)."""
    from egraph_compiler import library
    b, h, n = 2, 4, 77
    qkv = torch.randn(b, n, 3 * h * head, device="cuda", dtype=dtype)
    sliced = [t.view(b, n, h, head).transpose(1, 2) for t in qkv.split(h * head, -1)]
    dense = [torch.randn(b, h, n, head, device="cuda", dtype=dtype) for _ in range(3)]
    masks = {None: None, "float": torch.randn(b, 1, n, n, device="cuda", dtype=dtype),
             "bool": library.fused_kernel_mask(torch.rand(b, 1, n, n, device="cuda") > 0.3, n, dtype),
             "per key": library.fused_kernel_mask(torch.zeros(b, 1, 1, n, device="cuda", dtype=dtype), n, dtype)}
    with torch.no_grad():
        for kind, mask in masks.items():
            for causal in (False, True) if mask is None else (False,):
                chosen = {}
                call = library._picked_once(chosen, mask, causal, None)
                for q, k, v in (dense, sliced, dense):
                    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
                    assert torch.equal(library.on_cuda(call, q, k, v), want), (kind, causal)
                assert len(chosen) >= 2  # (a pick per layout; a layout the kernel refuses adds its copies' pick)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_rotary_outputs_stored_in_their_inputs_order_on_the_gpu(dtype, cuda_graphs):
    """orders.py: q and k rotated into buffers of [B, S, H, D] order, read by torch's fused attention."""
    from test_orders import STORED, operands, rotary_attention
    for shape in [(2, 16, 4, 2, 8), (1, 8, 2, 2, 64)]:
        args = [a.to("cuda", dtype) for a in operands(*shape)]
        compiled = egc.compile(rotary_attention, args, cuda_graphs=cuda_graphs)
        want = rotary_attention(*[a.float() for a in args])
        for _ in range(2):
            torch.testing.assert_close(compiled(*args).float(), want, rtol=2e-2, atol=2e-2)
        assert str(compiled.plan).count(STORED) == 2
