"""torch's own decompositions, for the ATen ops the op table does not map.

An op outside the converters' tables runs through ATen as an `extern` node, listed and warned.
Many such ops are sums of ops the table does map: `einsum` and `outer` (matmuls), the losses
(`cross_entropy` is `log_softmax` and `nll_loss`; `mse_loss`, `smooth_l1_loss`,
`binary_cross_entropy_with_logits`), `logsumexp`, `unbind`, `roll`, `tril`/`triu`, `lerp`,
`addcmul`, `cosine_similarity`, `std` over several dims.  torch's core ATen table (the one
torch.export and Inductor use) writes them out; capture and training take its entries for
exactly those ops, so that what the table maps (softmax, layer_norm, gelu, linear, ...) stays
whole for the rules, and random ops keep torch's random stream (dropout matches eager).
"""
from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions


def missing(table) -> dict:
    """{op: decomposition} for the ops of torch's core table that `table` does not map (capture's
    MISSING, computed once)."""
    return {op: fn for op, fn in core_aten_decompositions().items()
            if op not in table and isinstance(op, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in op.tags}
