"""Training's fused attention (egraph_compiler/flash.py): the forward with its
logsumexp and the backward that reads it, as custom ops AOTAutograd keeps whole
and the op table runs as library calls.  Checked against attention written out
in float64 (`_safe_softmax`: a row with every key masked gives 0), through
torch's own op checker, and through torch.compile against eager."""
import pytest
import torch

import egraph_compiler as egc
from egraph_compiler import flash, training


def _reference(q, k, v, mask, causal, scale, dout):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = (q @ kk.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    out = torch.ops.aten._safe_softmax(s, -1) @ vv
    return (out,) + torch.autograd.grad(out, (q, k, v), dout.double())


def _mask(kind: str, b: int, s: int):
    tri = torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "causal bool":
        return tri.expand(b, 1, s, s)
    if kind == "padding float":  # the last batch's last keys removed (BERT's additive mask)
        m = torch.zeros(b, 1, 1, s)
        m[-1, ..., s - 3:] = float("-inf")
        return m
    if kind == "a dead row":  # query 3 of batch 0 sees no key at all
        m = tri.expand(b, 1, s, s).clone()
        m[0, 0, 3] = False
        return m
    if kind == "2-d random":
        return torch.rand(s, s, generator=torch.Generator().manual_seed(3)) > 0.3
    return None


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (2, 1)])
@pytest.mark.parametrize("kind", ["none", "causal", "causal bool", "padding float", "a dead row", "2-d random"])
def test_forward_and_backward_match_attention_written_out(backend, heads, kind, monkeypatch):
    monkeypatch.setattr(flash, "_backend", lambda q, masked: backend)
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 13, 8  # (13: no size a kernel's block divides)
    q = torch.randn(b, heads[0], s, d, generator=g)
    k, v = (torch.randn(b, heads[1], s, d, generator=g) for _ in range(2))
    dout = torch.randn(b, heads[0], s, d, generator=g)
    mask, causal = _mask(kind, b, s), kind == "causal"
    bias, dead = flash.prepare(mask, q, s)
    out, lse = flash.forward(q, k, v, 0.3, causal, bias, dead)
    grads = flash.backward(dout, q, k, v, out, lse, 0.3, causal, bias)
    want = _reference(q, k, v, mask, causal, 0.3, dout)
    for got, expected in zip((out,) + grads, want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
        assert got.stride() == flash._strides(got.shape), "laid out as the fake implementation says"
    assert lse.shape == (b, heads[0], s) and lse.dtype == torch.float32
    if kind == "a dead row":
        assert not out[0, :, 3].any() and torch.isinf(lse[0, :, 3]).all()


@pytest.mark.parametrize("mask", [None, "causal bool"])
def test_custom_ops_pass_torchs_op_checks(mask):
    """Schema, fake (meta) implementation and autograd registration as torch checks them."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=g, requires_grad=True) for _ in range(3))
    torch.library.opcheck(flash.attention, (q, k, v, _mask(mask, 2, 8) if mask else None, 0.35, mask is None))


def test_supported_refuses_what_the_kernels_do_not_take():
    q = torch.randn(2, 4, 8, 8)
    assert flash.supported(q, q, q, None, True)
    assert not flash.supported(q[0], q[0], q[0], None, False)  # 3-d
    assert not flash.supported(q, q[:, :, :5], q[:, :, :5], None, True)  # causal over fewer keys
    assert not flash.supported(q, q[:, :3], q[:, :3], None, False)  # 4 heads do not group over 3
    assert not flash.supported(q.double(), q.double(), q.double(), None, False)
    assert not flash.supported(q, q, q, torch.zeros(3, 1, 8, 8), False)  # a mask that widens the batch
    assert not flash.supported(q, q, q, torch.zeros(2, 1, 8, 8, dtype=torch.float64), False)
    assert not flash.supported(q[:, :, :0], q, q, None, False)  # no queries


def test_the_cuda_kernel_choice_never_drops_a_mask():
    """torch's CUDA flash kernel takes no mask: a masked call goes to cuDNN or the math."""
    from types import SimpleNamespace

    def q(dtype, d):
        return SimpleNamespace(device=SimpleNamespace(type="cuda"), is_cuda=True, dtype=dtype, shape=(2, 4, 8, d))
    for d in (64, 160):
        for dtype in (torch.bfloat16, torch.float32):
            assert flash._backend(q(dtype, d), masked=True) in ("cudnn", "math")
    assert flash._backend(q(torch.float32, 64), masked=False) == "math"
    assert flash._backend(q(torch.bfloat16, 160), masked=True) == "math"


class _Attention(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=4, dim=32, repeat_kv=False):
        super().__init__()
        self.heads, self.kv_heads, self.head, self.repeat_kv = heads, kv_heads, dim // heads, repeat_kv
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None, causal=False):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, self.head).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        group = self.heads // self.kv_heads
        if self.repeat_kv:  # (transformers' `repeat_kv`: each kv head expanded to its group of query heads)
            k, v = (t[:, :, None].expand(b, self.kv_heads, group, s, self.head).reshape(b, self.heads, s, self.head)
                    for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                             enable_gqa=group != 1 and not self.repeat_kv)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def _matching_gradients(model, args, weights, **options):
    """The model compiled (plans recorded afresh): its parameters' gradients of (out * weights).sum()
    against eager's."""
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph", options=options)
    grads = []
    for fn in (compiled, model):
        model.zero_grad(set_to_none=True)
        (fn(*args) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, want in grads[1].items():
        torch.testing.assert_close(grads[0][name], want, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    return compiled


# the Triton target: its interpreter on CPU tensors, or the GPU where there is one
GPU_TARGET = "cuda" if torch.cuda.is_available() else "triton"


@pytest.mark.parametrize("target", ["cpu", GPU_TARGET])
@pytest.mark.parametrize("case", ["causal", "bool mask, grouped heads", "bool mask, grouped heads written out"])
def test_training_runs_one_forward_and_one_backward_call_per_layer(target, case, monkeypatch):
    torch.manual_seed(0)
    device = "cuda" if target == "cuda" else "cpu"
    model = _Attention(kv_heads=4 if case == "causal" else 2, repeat_kv="written" in case).to(device)
    x = torch.randn(2, 12, 32, device=device)
    mask = None if case == "causal" else _mask("a dead row", 2, 12).to(device)
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        def counted(*a, _f=getattr(flash, name), _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)
        monkeypatch.setattr(flash, name, counted)
    weights = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1)).to(device)
    compiled = _matching_gradients(model, (x, mask, case == "causal"), weights, target=target)
    forward, backward = egc.last_plans()[:2]
    tail = "" if mask is None else "_mask"
    assert forward.ops()["sdpa_fwd" + tail] == 1 and forward.ops()["sdpa_lse" + tail] == 1
    assert backward.ops()["sdpa_grad" + tail] == 3
    assert not forward.fallbacks and not backward.fallbacks
    # the probabilities [B, H, S, S] are never saved: what backward reads is q, k, v, out and lse
    assert not [n for n in forward.graph.outputs if n.shape[-2:] == (12, 12) and n.op != "input"]
    # a training step: each of the two calls ran once (the nodes of one call share it), and k and
    # v repeated per head (copies) were made once each per call (flash.py repeats grouped heads
    # for torch's kernels that do not take them); written out, once each in all: not again for the call's sibling
    # results nor for the activations saved for backward (six copies a layer before)
    calls.update(forward=0, backward=0)
    # (torch's CPU kernels that take grouped heads as they are, flash.cpu_groups: no copies in the
    # forward; none in the backward either where it took them grouped faster, timed on its first call)
    forward_grouped = device == "cpu" and flash.cpu_groups()
    picks = [v for (qs, ks, *_), v in flash.PICKS.items() if (qs, ks) == ((2, 4, 12, 8), (2, 2, 12, 8))]
    assert bool(picks) == (forward_grouped and case != "causal"), flash.PICKS
    backward_grouped = forward_grouped and all(picks)
    grouped = (0 if forward_grouped else 2) + (0 if backward_grouped else 2)
    repeats = []

    def repeat_interleave(self, *a, _f=torch.Tensor.repeat_interleave, **k):
        repeats.append(self.shape)
        return _f(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", repeat_interleave)
    compiled(x, mask, case == "causal").sum().backward()
    assert calls == {"forward": 1, "backward": 1}, calls
    # (written out: attention on the unrepeated k and v, training._grouped_kv, where the kernels take them)
    written = grouped if forward_grouped else 2
    assert len(repeats) == {"causal": 0, "bool mask, grouped heads": grouped}.get(case, written), repeats


@pytest.mark.parametrize("pick", [True, False])
def test_the_cpu_backward_takes_grouped_heads_where_it_timed_them_faster(pick, monkeypatch):
    """flash._backward_pick: neither grouped nor repeated k and v is the faster CPU backward on every
    shape and machine, so the first call of each kind times both and keeps the faster; later calls
    of that kind repeat k and v only where repeated won.  Both give eager's gradients."""
    if not flash.cpu_groups():
        pytest.skip("this torch's CPU flash kernels do not take grouped heads")
    torch.manual_seed(0)
    q, dout = (torch.randn(3, 4, 7, 8) for _ in range(2))
    k, v = (torch.randn(3, 2, 7, 8) for _ in range(2))
    monkeypatch.setattr(flash, "PICKS", {})
    out, lse = flash.forward(q, k, v, 0.3, True)
    runs, kernel_backward = [], flash._kernel_backward

    def kernel(*a):
        runs.append(a[-1])
        return kernel_backward(*a)
    monkeypatch.setattr(flash, "_kernel_backward", kernel)
    first = flash.backward(dout, q, k, v, out, lse, 0.3, True)
    assert sorted(runs) == [False] * 3 + [True] * 3, runs  # (the result is the winner's last run: no seventh)
    monkeypatch.setattr(flash, "_kernel_backward", kernel_backward)
    (key, _), = flash.PICKS.items()
    assert key == ((3, 4, 7, 8), (3, 2, 7, 8), torch.float32, True, False, torch.get_num_threads())
    flash.PICKS[key] = pick
    repeats = []

    def repeat_interleave(self, *a, _f=torch.Tensor.repeat_interleave, **kw):
        repeats.append(self.shape)
        return _f(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", repeat_interleave)
    again = flash.backward(dout, q, k, v, out, lse, 0.3, True)
    assert len(repeats) == (0 if pick else 2), repeats
    want = flash.backward(dout, q, k, v, out, lse, 0.3, True, grouped=False)
    for a, b, c in zip(first, again, want):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b, c, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("kind", ["causal", "a dead row", "padding float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_given_to_the_cpu_kernels_as_they_are_match_repeated_ones(groups, kind, dtype):
    """flash.cpu_groups: torch's CPU flash kernels given k and v with fewer heads give what they give
    on k and v repeated, dk and dv summed over each group (bitwise or within rounding)."""
    if not flash.cpu_groups():
        pytest.skip("this torch's CPU flash kernels do not take grouped heads")
    torch.manual_seed(groups)
    q, dout = (torch.randn(2, 4, 9, 8, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 4 // groups, 9, 8, dtype=dtype) for _ in range(2))
    mask, dead = flash.prepare(None if kind == "causal" else _mask(kind, 2, 9), q, 9)
    causal = kind == "causal"
    got = flash.forward(q, k, v, 0.4, causal, mask, dead, grouped=True)
    want = flash.forward(q, k, v, 0.4, causal, mask, dead, grouped=False)
    grads = [flash.backward(dout, q, k, v, want[0], want[1], 0.4, causal, mask, grouped=g) for g in (True, False)]
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    for a, b in zip(got + grads[0], want + grads[1]):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a, b, **tolerance)


def test_a_learned_attention_bias_gets_its_gradient():
    """An additive mask that is a parameter (a relative position bias) is written out, so its
    gradient flows: the fused kernels give none."""
    torch.manual_seed(0)
    model = _Attention()
    bias = torch.nn.Parameter(torch.randn(1, 4, 12, 12) * 0.1)
    x = torch.randn(2, 12, 32)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(lambda x: model(x, bias), backend="egraph")
    grads = []
    for fn in (compiled, lambda x: model(x, bias)):
        model.zero_grad(set_to_none=True)
        bias.grad = None
        fn(x).square().sum().backward()
        grads.append(bias.grad.clone())
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert not any(op.startswith("sdpa_grad") for p in egc.last_plans() for op in p.ops())


class _Repeated(torch.nn.Module):
    """Attention on k and v of 2 heads made 4 by the program: `how` does it (transformers'
    repeat_kv, repeat_interleave, or forms that are not a repeat of each head in place)."""

    def __init__(self, how, dropout=0.0):
        super().__init__()
        self.how, self.dropout, self.q, self.kv = how, dropout, torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        if self.how in ("repeat_kv", "read again"):
            k, v = (t[:, :, None, :, :].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4) for t in (k, v))
        elif self.how == "unsqueeze":
            k, v = (t.unsqueeze(2).expand(b, 2, 2, s, 4).reshape(b, 4, s, 4) for t in (k, v))
        elif self.how == "repeat_interleave":
            k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        elif self.how == "tiled":  # heads 0 1 0 1: not grouped-query attention's 0 0 1 1
            k, v = (t[:, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4) for t in (k, v))
        elif self.how == "k only":
            k, v = k.repeat_interleave(2, dim=1), v.repeat(1, 2, 1, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return out + k.sum() if self.how == "read again" else out


@pytest.mark.parametrize("how", ["repeat_kv", "unsqueeze", "repeat_interleave", "read again", "tiled", "k only"])
def test_training_attention_on_repeated_heads_reads_the_unrepeated_ones(how):
    """training._grouped_kv: in training, attention on k and v whose heads the program repeated in
    place (as transformers does where it passes a mask) is attention with grouped heads where the
    CPU kernels take them: the backward's k and v gradients come with 2 heads, not summed from 4.
    Other repeats (tiled heads; v tiled, k interleaved) are left alone and match eager too; repeated k
    read again elsewhere ("read again") is still made for that reader."""
    torch.manual_seed(0)
    model = _Repeated(how)
    x = torch.randn(2, 6, 16)
    mask = _mask("a dead row", 2, 6)
    weights = torch.randn(2, 4, 6, 4)
    _matching_gradients(model, (x, mask), weights)
    backward = egc.last_plans()[1]
    heads = sorted(n.shape[2] for n in backward.graph.topo() if n.op == "sdpa_grad_mask")
    grouped = how in ("repeat_kv", "unsqueeze", "repeat_interleave", "read again") and flash.cpu_groups()
    assert heads == ([2, 2, 4] if grouped else [4, 4, 4]), heads


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_attention_with_dropout_on_repeated_heads_is_left_alone(dropout):
    """training._grouped_kv on Dynamo's graph: attention with dropout keeps its repeated k and v
    (torch's own kernel runs it, drawing its random numbers as eager does); without, it does not."""
    if not flash.cpu_groups():
        pytest.skip("this torch's CPU flash kernels do not take grouped heads")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    torch.compile(_Repeated("repeat_kv", dropout), backend=keep)(torch.randn(2, 6, 16), _mask("a dead row", 2, 6))
    training._grouped_kv(graphs[0])
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in training._SDPA_TARGETS]
    assert len(calls) == 1 and bool(calls[0].kwargs.get("enable_gqa")) is (dropout == 0.0), calls[0].kwargs


def test_kernel_times_repeat_the_fused_attention_call_itself(monkeypatch):
    """timing.kernel_times (Compiled.report(measure=...), benchmarks/cost_fidelity.py) repeats each step
    to time it.  The fused attention's first node repeats the call, not a read of the result it left
    in the run's memo for its sibling (which read as ~4 us for a call of a millisecond)."""
    from egraph_compiler import runtime
    torch.manual_seed(0)
    seen, call = {}, runtime.Executable.__call__

    def recording(self, *a):
        seen[id(self)] = a
        return call(self, *a)
    monkeypatch.setattr(runtime.Executable, "__call__", recording)
    _matching_gradients(_Attention(), (torch.randn(2, 12, 32), None, True), torch.ones(2, 12, 32))
    forward = egc.last_compiled()[0]._executable
    assert forward.plan.ops()["sdpa_fwd"] == 1 and forward.plan.ops()["sdpa_lse"] == 1
    calls = []

    def counted(*a, _f=flash.forward, **k):
        calls.append(1)
        return _f(*a, **k)
    monkeypatch.setattr(flash, "forward", counted)
    times = forward.kernel_times(*seen[id(forward)], reps=1, inner=5)
    assert len(calls) == 2 * (1 + 5), len(calls)  # (two runs, the first dropped: one call and five repeats each)
    steps = {k.kind + ":" + k.output.op: times[k.name] for k in forward.plan.kernels}
    assert steps["library:sdpa_fwd"] + steps["library:sdpa_lse"] > 0
