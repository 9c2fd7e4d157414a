"""Training through torch.compile(backend="egraph"): AOTAutograd's forward and
backward graphs both go through the pipeline; gradients are checked against eager."""
import copy
import warnings

import pytest
import torch

import egraph_compiler as egc


def _grads(model, loss_of, compiled_model, seed=None):
    """(compiled grads, eager grads), by parameter name, for one backward each."""
    out = {}
    for name, fn in (("compiled", compiled_model), ("eager", model)):
        model.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        loss_of(fn).backward()
        out[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out["compiled"], out["eager"]


def _assert_grads_close(got: dict, want: dict, rtol=1e-3):
    assert want and want.keys() <= got.keys()
    for name in got.keys() - want.keys():  # an output the loss ignores (BERT's pooler): AOTAutograd's backward
        assert not got[name].any(), name   # gives zeros where eager leaves None, as with Inductor
    scale = max(g.abs().max().item() for g in want.values())  # gradients that are 0 in exact arithmetic
    for name in want:                                           # (key biases) are compared at this scale
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


def _weights_for(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=t.dtype)


def _compile(model, **options):
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    return torch.compile(model, backend="egraph", options=options or None)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_mlp_trains_with_both_graphs_generated(target):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 16), torch.nn.LogSoftmax(-1))
    x = torch.randn(4, 8, 16)
    compiled = _compile(model, target=target)
    got, want = _grads(model, lambda fn: (fn(x) * _weights_for(x)).sum(), compiled)
    _assert_grads_close(got, want)
    plans = egc.last_plans()
    assert len(plans) == 2, "a forward and a backward plan"
    assert not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]
    backward = plans[1]
    assert all(k.kind in ("generated", "library") for k in backward.kernels)
    # the backward's composites (layer_norm, gelu, log_softmax backward) are fused primitives:
    # fewer kernels than ops
    assert len(backward.kernels) < sum(backward.ops().values())


def test_training_steps_update_like_eager():
    """An optimizer loop: the compiled model's weights follow eager's over several steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    compiled = _compile(model)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for net, fn in ((model, compiled), (twin, twin)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(fn(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_multi_output_random_op_draws_once_per_call():
    """native_dropout's output and mask come from one draw (each output ran the op on its own)."""
    fn = lambda x: torch.ops.aten.native_dropout(x, 0.5, True)  # noqa: E731
    x = torch.rand(64, 64) + 1
    compiled = egc.compile(fn, [x])
    for _ in range(3):
        out, mask = compiled(x)
        torch.testing.assert_close(out, x * mask * 2.0)


transformers = pytest.importorskip("transformers")


def _hf_training_models():
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              ViTConfig, ViTModel)
    off = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    return {
        "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0)), ids),
        "llama": (lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                       num_key_value_heads=2, intermediate_size=128,
                                                       vocab_size=128)), ids),
        "bert": (lambda: BertModel(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                              intermediate_size=128, vocab_size=128, **off)), ids),
        "vit": (lambda: ViTModel(ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           intermediate_size=128, image_size=32, patch_size=8, **off)),
                torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))),
    }


def _hidden(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# what may still run through ATen in training (none of it did on torch 2.13): lookups before the
# blocks, the causal mask's tril (built from constants), and the copies of int64 ids (GPT-2's
# position ids, BERT's token type ids) that the forward hands to the backward (integer results are
# never generated).  Embedding and convolution gradients are library calls, never fallbacks.
OUTSIDE_BLOCKS = {"aten.embedding.default", "aten.arange.default", "aten.gather.default", "aten.tril.default",
                  "reshape", "expand"}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_transformers_model_trains(name):
    make, inputs = _hf_training_models()[name]
    torch.manual_seed(0)
    model = make().train()
    compiled = _compile(model)
    got, want = _grads(model, lambda fn: (_hidden(fn(inputs)) * _weights_for(_hidden(model(inputs)))).sum(),
                       compiled)
    _assert_grads_close(got, want)
    plans = egc.last_plans()
    assert len(plans) >= 2
    fallbacks = {f.split(" ")[0] for p in plans for f in p.fallbacks}
    assert fallbacks <= OUTSIDE_BLOCKS, fallbacks
    # attention and its backward are the op table's library calls (flash.py), never ATen fallbacks
    assert not any("attention" in f.split(" ")[0] for p in plans for f in p.fallbacks)
    # the saved transposes (the weight gradients' operands) are views of the forward's buffers, not
    # the activation computed again into a transposed store; backward reads them in place
    forward, backward = plans[0], plans[1]
    assert sum(n for op, n in backward.ops().items() if op.startswith("sdpa_grad")) == 6, "2 layers' dq, dk, dv"
    again = [str(k) for k in forward.kernels if k.kind == "generated" and k.output.op in ("transpose", "permute")]
    assert not again, again
    assert backward.graph.orders, "backward reads its transposed inputs in their storage's order"


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_convolution_and_embedding_gradients_are_library_calls(target):
    """convolution_backward (input, weight and bias gradients, strided, padded, dilated, grouped) and
    embedding_dense_backward (padding_idx, scale_grad_by_freq, repeated ids) as the op table's
    library calls: gradients as eager's, including the input's, with no fallback."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)
            self.conv2 = torch.nn.Conv2d(6, 6, (3, 2), padding=(2, 1), dilation=(2, 1), groups=3, bias=False)
            self.embed = torch.nn.Embedding(10, 6, padding_idx=3, scale_grad_by_freq=True)

        def forward(self, x, ids):
            h = self.conv2(torch.relu(self.conv1(x)))
            return h.mean((2, 3))[:, None, :] + self.embed(ids)

    model = Net()
    x = torch.randn(2, 4, 9, 7, requires_grad=True)
    ids = torch.tensor([[5, 3, 5], [0, 5, 9]])
    compiled = _compile(model, target=target)
    weights = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))
    got, want = {}, {}
    for store, fn in ((got, compiled), (want, model)):
        model.zero_grad(set_to_none=True)
        x.grad = None
        (fn(x, ids) * weights).sum().backward()
        store.update({n: p.grad.clone() for n, p in model.named_parameters()}, x=x.grad.clone())
    _assert_grads_close(got, want)
    assert not got["embed.weight"][3].any()  # padding_idx's row gets no gradient
    plans = egc.last_plans()
    assert not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]
    ops = {op for p in plans for op in p.ops()}
    assert {"conv2d_input_grad", "conv2d_weight_grad", "embedding_grad"} <= ops, ops


def test_convnet_with_batch_norm_trains_like_eager():
    """Batch norm in train mode (batch statistics, running statistics updated and written back) and
    its backward, decomposed by torch into the op table's primitives: gradients, outputs and running
    statistics as eager's over two steps, with no ATen fallback in either graph."""
    from test_models import _convnet
    model = _convnet().train()
    reference = _convnet().train()
    x = torch.randn(4, 3, 16, 12, generator=torch.Generator().manual_seed(3))
    compiled = _compile(model)
    for step in range(2):
        for net, fn in ((model, compiled), (reference, reference)):
            net.zero_grad(set_to_none=True)
            (fn(x) * _weights_for(torch.empty(4, 10))).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        _assert_grads_close(got, {n: p.grad for n, p in reference.named_parameters()})
        for (name, mine), theirs in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}")
    plans = egc.last_plans()
    assert len(plans) >= 2 and not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]


class _Tracked(torch.nn.Module):
    """A step counter (`+=` on a buffer) and a running mean of activations, updated with or
    without `detach()` (the mistake: in eager, the buffer then requires grad)."""

    def __init__(self, detach: bool):
        super().__init__()
        self.detach = detach
        self.w = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(2)))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        y = x * self.w
        self.steps += 1
        mean = y.mean(0)
        self.ema.copy_(mean.detach() if self.detach else mean)
        return y.sum(-1)


@pytest.mark.parametrize("detach", [True, False])
def test_buffers_updated_in_training_never_take_the_outputs_place(detach):
    """torch 2.13's AOTAutograd traced the undetached form's forward with the step count where
    the model's output belongs (a 0-d tensor came back, under Inductor too).  Ours checks the
    forward graph's user outputs against Dynamo's and runs such a graph eagerly, warned; the
    detached form compiles.  Outputs, gradients and buffers as eager's over three steps."""
    model, reference = _Tracked(detach), _Tracked(detach)
    compiled = _compile(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            got, want = compiled(x * (step + 1)), reference(x * (step + 1))
            torch.testing.assert_close(got, want)
            got.sum().backward()
            want.sum().backward()
    eager = [w for w in caught if issubclass(w.category, egc.EagerFallbackWarning)]
    assert bool(eager) == (not detach), [str(w.message) for w in caught]
    if eager:
        assert "requires grad" in str(eager[0].message) and "runs eagerly" in str(eager[0].message)
    else:
        assert egc.last_plans()
    torch.testing.assert_close(model.w.grad, reference.w.grad)
    torch.testing.assert_close(model.ema, reference.ema)
    assert model.steps.item() == reference.steps.item() == 3


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_conv1d_and_group_norm_train_like_eager_without_fallbacks(target):
    """A 1-d convolution reaches training as torch's general `convolution` (and its backward)
    over 3-d tensors, and group norm as `native_group_norm` (and its backward): all four were
    ATen fallbacks.  The convolution is the 2-d one over a height of 1, group norm decomposed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 12, 3, stride=2, padding=2, dilation=2), torch.nn.GroupNorm(3, 12),
                                torch.nn.SiLU(), torch.nn.Conv1d(12, 6, 1, groups=3))
    x = torch.randn(2, 4, 11)
    loss = lambda fn: (fn(x) * _weights_for(torch.empty(2, 6, 6))).sum()  # noqa: E731
    got, want = _grads(model, loss, _compile(model, target=target))
    _assert_grads_close(got, want)
    plans = egc.last_plans()
    assert len(plans) == 2 and not [f for p in plans for f in p.fallbacks], [p.fallbacks for p in plans]


@pytest.mark.parametrize("dims", [1, 2])
def test_a_fallback_gets_the_layout_eager_gave_it(dims):
    """A silent wrong answer (Wav2Vec2 and HuBERT in train mode, found by the model-family probe):
    a convolution over a channels-last view (the model's transpose) gave its weight gradient
    channels-last, and torch's `_weight_norm_interface_backward`, an ATen fallback here, reads a
    gradient of that layout wrongly (eager's autograd only ever hands it a contiguous one).
    A fallback's tensor arguments are now contiguous wherever eager's were."""
    torch.manual_seed(0)
    conv = (torch.nn.Conv1d(32, 32, 16, padding=8, groups=4) if dims == 1 else
            torch.nn.Conv2d(16, 16, 3, padding=1, groups=4))
    conv = torch.nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2 if dims == 1 else 0)

    class ChannelsLast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):  # x: channels last, as a transformer's [batch, positions, channels]
            return self.conv(x.transpose(1, 2) if dims == 1 else x.permute(0, 3, 1, 2))
    model = ChannelsLast()
    x = torch.randn(2, 39, 32) if dims == 1 else torch.randn(2, 6, 7, 16)
    weights = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(1))
    got, want = _grads(model, lambda fn: (fn(x) * weights).sum(), _compile(model))
    _assert_grads_close(got, want)


def _net_trains_like_eager(*layers, shape):
    """A Sequential of copies of `layers` (the same weights in both) over a batch of `shape`:
    gradients as eager's, and both graphs without an ATen fallback; returns the plans."""
    def make():
        return torch.nn.Sequential(*(copy.deepcopy(layer) for layer in layers))
    model, reference = make(), make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    compiled = _compile(model)
    for net, fn in ((model, compiled), (reference, reference)):
        net.zero_grad(set_to_none=True)
        out = fn(x)
        (out * _weights_for(out.detach())).sum().backward()
    _assert_grads_close({n: p.grad for n, p in model.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})
    plans = egc.last_plans()
    assert len(plans) == 2 and not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]
    return plans


def test_tiling_average_pooling_trains_like_eager_without_fallbacks():
    """avg_pool2d whose windows tile the input (2x2, and 2x3 over a 4x6 map): a reshape and a mean,
    its gradient an expand, in both graphs."""
    torch.manual_seed(0)
    _net_trains_like_eager(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.AvgPool2d(2), torch.nn.Conv2d(4, 4, 1),
                                   torch.nn.AvgPool2d((2, 3)), torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 1, 5),
                                   shape=(2, 3, 8, 6))


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_resampling_trains_like_eager_without_fallbacks(mode):
    """AOTAutograd's tracing writes resampling as an advanced index x[:, :, rows, cols] (and
    arithmetic); its gradient, an accumulating index_put over two index tensors after two full
    slices, is an embedding's gradient of the flattened rows (no ATen fallback)."""
    torch.manual_seed(0)
    for up in (torch.nn.Upsample(scale_factor=2, mode=mode), torch.nn.Upsample(size=(7, 9), mode=mode)):
        _net_trains_like_eager(torch.nn.Conv2d(3, 4, 3, padding=1), up, torch.nn.Conv2d(4, 2, 3, padding=1),
                               shape=(2, 3, 4, 5))


def test_max_pooling_trains_like_eager():
    """ResNet's overlapping, padded 3x3 / 2 pooling and a tiling 2x2 one in training: the values, their
    positions and the gradient sent back to them are library calls (no ATen fallback)."""
    torch.manual_seed(0)
    plans = _net_trains_like_eager(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(8, 8, 3),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(48, 10), shape=(2, 3, 15, 14))
    assert "max_pool2d_grad" in plans[1].ops(), plans[1]


def test_gpt2_trains_with_dropout_when_seeds_are_fixed():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")).train()
    ids = torch.randint(0, 128, (2, 16))
    compiled = _compile(model)
    got, want = _grads(model, lambda fn: fn(ids, labels=ids).loss, compiled, seed=123)
    _assert_grads_close(got, want)
    assert any("native_dropout" in f for p in egc.last_plans() for f in p.fallbacks)  # torch's random stream


def test_compiled_model_follows_mode_dtype_and_weight_changes():
    """One torch.compile'd model through eval, train (with gradients), load_state_dict, parameter
    reassignment and .to(bfloat16): every call matches eager on the model as it is now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    compiled = _compile(model)

    def same(tol=1e-5):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=tol, rtol=tol)

    model.eval()
    same()
    model.train()  # dropout on: gradients under one seed, against eager's
    got, want = _grads(model, lambda fn: fn(x).square().sum(), compiled, seed=7)
    _assert_grads_close(got, want)
    model.eval()
    fresh = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(fresh)
    same()
    model[0].weight = torch.nn.Parameter(torch.randn(32, 16))
    same()
    model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    same(tol=3e-2)
    assert len(egc.last_plans()) >= 4  # eval; train forward and backward; bfloat16: each compiled


def test_forward_lends_only_what_it_computes():
    """Under CUDA graphs a training forward hands out its saved activations as the graph's own buffers
    (graphs.py).  Which ones: outputs after the user's that kernels compute or that are constants,
    never a view of a caller's tensor (a weight's transpose is returned as that view)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    compiled = _compile(model)
    got, want = _grads(model, lambda fn: (fn(torch.ones(4, 16)) ** 2).sum(), compiled)
    _assert_grads_close(got, want)
    forward = egc.last_compiled()[-2]._executable
    outputs = forward.graph.outputs
    assert forward._lent and min(forward._lent) >= 1, "the user's output is not lent"
    assert all(egc.graph.view_source(outputs[i]).op != "input" for i in forward._lent)
    assert any(egc.graph.view_source(o).op == "input" for o in outputs), "a saved weight (not lent)"


def test_training_graphs_are_read_as_they_are_not_exported_again(monkeypatch):
    """AOTAutograd's graphs are functional ATen graphs with every value's fake tensor already:
    capture reads them as they are (capture._exported_already) instead of tracing each again with
    torch.export (0.2-0.9 s a graph).  A graph that mutates an input (batch norm's running
    statistics) still goes through export, which turns the mutation into an output."""
    from egraph_compiler import capture
    exported = []
    real_export = capture.export_aten
    monkeypatch.setattr(capture, "export_aten", lambda *a, **k: exported.append(1) or real_export(*a, **k))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    got, want = _grads(mlp, lambda fn: (fn(x) * _weights_for(torch.empty(5, 4))).sum(), _compile(mlp))
    _assert_grads_close(got, want)
    assert len(egc.last_plans()) == 2 and exported == [], exported  # forward and backward, neither exported
    from test_models import _convnet
    net = _convnet().train()
    _compile(net)(torch.randn(4, 3, 16, 12)).sum().backward()
    assert len(exported) == 1  # the forward, which writes the running statistics


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):  # (sin(x) * scale: a generated kernel reading x as laid out)
        return self.l2(torch.relu(self.l1(torch.sin(x) * self.scale)))


def test_a_training_forward_follows_its_inputs_strides():
    """A training forward takes its arguments without checking them after its first call (its
    inputs are Dynamo's graph's, whose guards hold their sizes and strides): an input of other
    strides recompiles, and is never read through the first call's."""
    torch.manual_seed(0)
    model = _Scaled()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="egraph")
    for x in (torch.randn(5, 8), torch.randn(8, 5).t(), torch.randn(5, 8), torch.randn(8, 5).t(),
              torch.randn(5, 16)[:, ::2]):
        got, want = (x.clone().requires_grad_(True) for _ in range(2))
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        (compiled(got) * torch.arange(4.0)).sum().backward()
        (reference(want) * torch.arange(4.0)).sum().backward()
        torch.testing.assert_close(got.grad, want.grad)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")
