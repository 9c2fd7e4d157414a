"""torch's own transformer layer as the op table's ops.

`nn.TransformerEncoderLayer` (and `nn.TransformerEncoder`) in eval mode without gradients
takes torch's "fast path": the whole layer is one ATen call, `_transformer_encoder_layer_fwd`,
which Dynamo hands over as it is, so the layer ran through ATen as one fallback.  It is the
layer written out (aten/src/ATen/native/transformers/transformer.cpp): attention with the
packed q/k/v projection (`_native_multi_head_attention`), a residual, a layer norm before
(`norm_first`) or after, and the feed-forward block (relu, or exact gelu) with its residual.
Masks and nested (padded) batches stay with ATen.

capture.py reads this table with converters.py's."""
from __future__ import annotations

import torch

from .converters import _layer_norm, _linear, _reshape, _sdpa, _split, _transpose
from .graph import Node

aten = torch.ops.aten


def _attention(x, embed_dim, heads, qkv_weight, qkv_bias, proj_weight, proj_bias):
    """`_native_multi_head_attention(x, x, x, ...)` without a mask: [B, S, E] -> [B, S, E]."""
    if len(x.shape) != 3 or embed_dim % heads or x.shape[-1] != embed_dim:
        return None
    batch, seq, _ = x.shape
    q, k, v = (_transpose(_reshape(t, (batch, seq, heads, embed_dim // heads)), 1, 2)
               for t in _split(_linear(x, qkv_weight, qkv_bias), embed_dim, -1))
    out = _reshape(_transpose(_sdpa(q, k, v), 1, 2), (batch, seq, embed_dim))
    return _linear(out, proj_weight, proj_bias)


def _encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                   eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                   ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if mask is not None or not isinstance(src, Node):
        return None
    norm1 = lambda t: _layer_norm(t, (embed_dim,), norm_weight_1, norm_bias_1, eps)  # noqa: E731
    norm2 = lambda t: _layer_norm(t, (embed_dim,), norm_weight_2, norm_bias_2, eps)  # noqa: E731
    attended = _attention(norm1(src) if norm_first else src, embed_dim, num_heads, qkv_weight, qkv_bias,
                          proj_weight, proj_bias)
    if attended is None:
        return None
    x = Node.make("add", (src, attended))
    if not norm_first:
        x = norm1(x)
    hidden = _linear(norm2(x) if norm_first else x, ffn_weight_1, ffn_bias_1)
    hidden = Node.make("gelu" if use_gelu else "relu", (hidden,))
    x = Node.make("add", (x, _linear(hidden, ffn_weight_2, ffn_bias_2)))
    return x if norm_first else norm2(x)


ENCODER = {aten._transformer_encoder_layer_fwd.default: _encoder_layer}
