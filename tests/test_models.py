"""Real torch.nn models, compiled whole and checked against eager."""
import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc


def test_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True,
                                             dropout=0.0).eval()
    x = torch.randn(2, 10, 64)
    compiled = egc.compile(layer, [x])
    assert compiled.plan.count("sdpa") == 1 and compiled.plan.count("layer_norm") == 2, str(compiled.plan)
    assert not compiled.plan.fallbacks
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first,activation,target", [(False, "relu", "cpu"), (True, "gelu", "triton")])
def test_torch_transformer_encoder_fast_path_is_written_out(norm_first, activation, target):
    """In eval mode without gradients torch runs each layer as one ATen call
    (`_transformer_encoder_layer_fwd`, its "fast path"), which Dynamo hands over whole: it used
    to be one fallback per layer.  encoder.py writes it out: one sdpa per layer, no fallback."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    plans = _eval_through_dynamo(encoder, torch.randn(3, 7, 32), target)
    assert sum(p.count("sdpa") for p in plans) == 2 and sum(p.count("layer_norm") for p in plans) == 4


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_group_norm_is_a_layer_norm_per_group_then_each_channels_affine(target):
    """nn.GroupNorm (diffusion U-Nets, ConvNeXt-style blocks) was an ATen fallback."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(8, 12, 3, padding=1), torch.nn.GroupNorm(3, 12), torch.nn.SiLU(),
                                torch.nn.GroupNorm(1, 12, affine=False)).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 8, 10) * 3 + 1
    compiled = egc.compile(model, [x], target=target)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_weight_normed_layers_in_eval_are_written_out(target):
    """Weight norm's weight (`_weight_norm`: Wav2Vec2's and HuBERT's positional convolution) was an
    ATen fallback in eval: it is v * (g / ||v||), the norm over every dim but one."""
    torch.manual_seed(0)
    norm = torch.nn.utils.parametrizations.weight_norm
    model = torch.nn.Sequential(norm(torch.nn.Conv1d(8, 8, 5, padding=2, groups=2), name="weight", dim=2),
                                torch.nn.GELU(), norm(torch.nn.Conv1d(8, 4, 1), name="weight", dim=0)).eval()
    _eval_through_dynamo(model, torch.randn(2, 8, 11), target)


def _eval_through_dynamo(model, x, target) -> list:
    """The model through torch.compile against eager, without gradients; its plans, none with a fallback."""
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.no_grad():
        expected = model(x)
        got = torch.compile(model, backend="egraph", options={"target": target})(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plans = egc.last_plans()
    assert plans and not [f for p in plans for f in p.fallbacks], [p.fallbacks for p in plans]
    return plans


def test_model_with_an_unsupported_layer_lists_its_fallback():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 8, 3, padding="same"), torch.nn.GELU(), torch.nn.AdaptiveMaxPool1d(4),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 4, 10), torch.nn.LogSoftmax(-1)).eval()
    x = torch.randn(3, 4, 8)
    with pytest.warns(UserWarning, match="adaptive_max_pool"):
        compiled = egc.compile(model, [x])
    assert [f for f in compiled.plan.fallbacks if "adaptive_max_pool" in f] == compiled.plan.fallbacks  # (the
    # convolution with padding="same" is torch's decomposition: a library convolution)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


transformers = pytest.importorskip("transformers")


def _hf_models():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    return {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                                   bos_token_id=0, eos_token_id=0)),
        "llama_gqa": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                          num_key_value_heads=2, intermediate_size=128,
                                                          vocab_size=128)),
        "bert": lambda: BertModel(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=128)),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "bert"])
def test_transformers_model_through_torch_compile(name):
    torch.manual_seed(0)
    model = _hf_models()[name]().eval()
    ids = torch.randint(0, 128, (2, 16))
    compiled_graphs = []

    def backend(gm, example_inputs):
        run = egc.dynamo_backend(gm, example_inputs)
        compiled_graphs.append(run.compiled)
        return run
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids)
        got = torch.compile(model, backend=backend)(ids)
    key = "logits" if hasattr(expected, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(got, key), getattr(expected, key), atol=1e-4, rtol=1e-4)
    assert compiled_graphs and all(len(c.plan.kernels) for c in compiled_graphs)
    fallbacks = [f for c in compiled_graphs for f in c.plan.fallbacks]
    # every fallback names the model's own source line (transformers' modeling file), not a torch frame
    assert all(("<no source line>" not in f) and ("modeling_" in f or "cache_utils" in f) for f in fallbacks), fallbacks
    # attention is one library sdpa per layer: grouped-query attention (LLaMA's 2 of 4 KV heads) included
    assert sum(c.plan.count(op) for op in ("sdpa", "sdpa_mask", "softmax_attention") for c in compiled_graphs) == 2, \
        [str(c.plan) for c in compiled_graphs]
    assert not any("scaled_dot_product_attention" in f for f in fallbacks), fallbacks
    if name == "llama_gqa":  # repeat_kv seen through: K and V reach sdpa unrepeated, not copied per layer
        sdpas = [n for c in compiled_graphs for n in c.plan.graph.topo() if n.op in ("sdpa", "sdpa_mask", "softmax_attention")]
        assert all(n.args[1].shape[-3] * 2 == n.args[0].shape[-3] for n in sdpas), [str(c.plan) for c in compiled_graphs]
    # inside the transformer blocks nothing runs through ATen (rotary embeddings' cat, cos and sin, the
    # KV cache's cat are generated); only the embeddings before them do (lookups and position ids)
    embeddings = {"aten.embedding.default", "aten.arange.default", "aten.gather.default"}
    assert {f.split(" ")[0] for f in fallbacks} <= embeddings, fallbacks


def test_a_deep_llama_matches_eager_at_every_layer():
    """8 layers: a graph of 600+ nodes, where egglog's global names once collided and
    layer 6's rotary embedding read sin for rotate_half(q) (logits off by 4e-3)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=8, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                         use_cache=False)).eval()
    ids = torch.randint(0, 128, (2, 16))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True)
        got = torch.compile(model, backend="egraph")(ids, output_hidden_states=True)
    for layer, (g, e) in enumerate(zip(got.hidden_states, expected.hidden_states)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"hidden state {layer}: {m}")
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)


def _hf_layers():
    from transformers.activations import GELUActivation, NewGELUActivation, SiLUActivation
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    return {  # name: (module, the composite its written-out form must become)
        "gpt2_gelu_new_pow": (NewGELUActivation, "gelu_tanh"), "bert_gelu": (GELUActivation, "gelu"),
        "silu": (SiLUActivation, "silu"), "t5_rms_norm": (lambda: T5LayerNorm(32), "rms_norm"),
        "llama_rms_norm_in_fp32": (lambda: LlamaRMSNorm(32), "rms_norm"),
        "gemma_rms_norm_one_plus_w": (lambda: GemmaRMSNorm(32), "rms_norm"),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt2_gelu_new_pow", "bert_gelu", "silu", "t5_rms_norm",
                                  "llama_rms_norm_in_fp32", "gemma_rms_norm_one_plus_w"])
def test_hf_activations_and_norms_as_written_become_composites(name, dtype):
    """Each model family's own spelling (pow(x, 3) in GPT-2's gelu, norms computed in float32 on
    bf16 inputs and cast back with type_as, Gemma's (1 + w)) is recognised: one composite, no ATen."""
    make, composite = _hf_layers()[name]
    torch.manual_seed(0)
    layer = make().to(dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = (torch.randn(2, 5, 32) * 2).to(dtype)
    with torch.no_grad():
        compiled = egc.compile(layer, [x])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(compiled(x), layer(x), atol=tol, rtol=tol)
    assert compiled.plan.count(composite) == 1, str(compiled.plan)
    assert not compiled.plan.fallbacks


class _ConvNet(torch.nn.Module):
    """A small residual convolutional network, as torchvision writes them: conv, batch norm, relu,
    a residual block, adaptive average pooling to 1x1 and to 2x2, a linear head."""

    def __init__(self):
        super().__init__()
        bn = torch.nn.BatchNorm2d
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), bn(8),
                                        torch.nn.ReLU())
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), bn(8), torch.nn.ReLU(),
                                         torch.nn.Conv2d(8, 8, 3, padding=1, groups=2), bn(8, affine=False))
        self.head = torch.nn.Linear(8 + 32, 10)

    def forward(self, x):
        h = torch.relu(self.stem(x) + self.block(self.stem(x)))
        pooled = torch.cat((F.adaptive_avg_pool2d(h, 1).flatten(1), F.adaptive_avg_pool2d(h, (2, 1)).flatten(1)
                            .repeat(1, 2)), 1)
        return self.head(pooled)


def _convnet():
    torch.manual_seed(0)
    model = _ConvNet()
    for m in model.modules():  # running statistics and affine parameters other than the defaults
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            if m.affine:
                torch.nn.init.normal_(m.weight)
    return model


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convnet_inference_has_no_fallback(target, dtype):
    """Batch norm in eval mode becomes per-channel arithmetic (fused with the relu and residual
    add around it) and adaptive average pooling a mean over equal windows: no ATen fallback."""
    model = _convnet().eval().to(dtype)
    x = torch.randn(2, 3, 16, 12).to(dtype)
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.no_grad():
        got = torch.compile(model, backend="egraph", options={"target": target})(x)
        want = model(x)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    plans = egc.last_plans()
    assert plans and not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]
    assert sum(p.ops()["rsqrt"] for p in plans) == 3  # each batch norm's scale


def test_adaptive_pool_of_uneven_windows_falls_back_with_a_warning():
    x = torch.randn(2, 3, 7, 5)
    with pytest.warns(UserWarning, match="adaptive_avg_pool2d"):
        compiled = egc.compile(lambda x: F.adaptive_avg_pool2d(x, (3, 2)), [x])
    torch.testing.assert_close(compiled(x), F.adaptive_avg_pool2d(x, (3, 2)))


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_pooling_over_tiling_windows_is_generated(target):
    """Max pooling whose windows tile the input (a reshape and an amax, NaN kept as torch keeps
    it) and adaptive average pooling in 1-d and 2-d: generated; overlapping windows: a library call."""
    x = torch.randn(2, 3, 8, 6)
    x[0, 1, 2, 3] = float("nan")

    def fn(x):
        return (F.max_pool2d(x, 2) * 2, F.max_pool2d(x[0], (4, 3)), F.adaptive_avg_pool1d(x.flatten(2), 4),
                F.adaptive_avg_pool2d(x, (4, 2)))
    compiled = egc.compile(fn, [x], target=target)
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, equal_nan=True)
    assert not compiled.plan.fallbacks, compiled.plan.fallbacks
    overlapping = egc.compile(lambda x: F.max_pool2d(x, 3, 2, 1), [x], target=target)  # ResNet's: the library's
    torch.testing.assert_close(overlapping(x), F.max_pool2d(x, 3, 2, 1), equal_nan=True)
    assert overlapping.plan.ops() == {"max_pool2d": 1} and not overlapping.plan.fallbacks, overlapping.plan


def _padded_models():
    import transformers as tf
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100)
    return {
        "llama": lambda: tf.LlamaModel(tf.LlamaConfig(num_key_value_heads=2, **small)),
        "bert": lambda: tf.BertModel(tf.BertConfig(**small)),
        "gpt2_eager_attention": lambda: tf.GPT2Model(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100,
                                                                   attn_implementation="eager")),
    }


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2_eager_attention"])
def test_padded_batches_build_their_masks_without_fallback(name):
    """An attention_mask with padding: transformers builds the 4-d mask by advanced indexing
    (`mask[batch_idx, kv_idx]`), a gather now; results as eager's, padded rows included."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _padded_models()[name]().eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = torch.compile(model, backend="egraph")(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plans = egc.last_plans()
    assert plans and not any(p.fallbacks for p in plans), [p.fallbacks for p in plans]
