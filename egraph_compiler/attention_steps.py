"""The steps of attention's library calls (steps.TorchSteps inherits them): torch's fused
kernels with what a run can share between layers and sibling results decided once per run
(a mask converted, the program's causal mask recognised, one fused call's several results)."""
from __future__ import annotations

import weakref

import torch

from . import cost, flash, library, masks, ops
from .errors import CodegenError
from .graph import Node

ATTENTION = cost.ATTENTION | {"sdpa_lse", "sdpa_lse_mask"}  # (the forward's logsumexp: a part of its call)


class AttentionSteps:
    """Attention's steps, on the `memo` (values one run shares) and `device` of TorchSteps."""

    def _attention(self, node: Node):
        """The torch function an attention node runs, on its argument list."""
        if node.op in ("sdpa_mask", "softmax_attention") and self.device == "cuda":
            return self._masked_attention(node)
        if node.op.removesuffix("_mask") in ("sdpa_fwd", "sdpa_lse", "sdpa_grad"):
            return self._fused_attention(node)
        attention = library.attention([a.shape for a in node.args], node.a, self.device == "cuda")  # (decided once)
        if node.op == "softmax_attention":  # sdpa, and NaN where the mask removes a whole row (once per run)
            def attention(args, masked=attention):
                return library.nan_rows(self._masked_rows(node, args[3], args[1].shape[-2]), masked(args))
        return attention if node.op == "sdpa" else self._causal_or(node, attention)

    def _fused_part(self, node: Node):
        """For a node of training's fused attention (`_fused_attention`), a function giving its
        part where this run made the call already (None before), so that its siblings read no
        operands again (k and v repeated per head are copies); None for other nodes."""
        if node.op.removesuffix("_mask") not in ("sdpa_fwd", "sdpa_lse", "sdpa_grad"):
            return None
        key, part, grad = self._fused_key(node)

        def known():
            got = self.memo.get(key)
            return None if got is None else _attention_part(got, part, grad)
        return known

    @staticmethod
    def _fused_key(node: Node):
        """(the memo's key of one fused attention call, which part `node` is, whether backward's)."""
        scale, causal, grad = node.attr("scale"), node.attr("causal"), node.op.startswith("sdpa_grad")
        key = (grad, scale, causal) + tuple(id(a) for a in node.args)
        return key, node.attr("which") if grad else int(node.op.startswith("sdpa_lse")), grad

    def _fused_attention(self, node: Node):
        """Training's attention (flash.py): the output and its logsumexp are two nodes of one
        forward call, dq, dk and dv three of one backward call; a run makes each call once
        (the first node read computes it, its siblings take their part from the memo), and
        converts each mask once for the layers that share it."""
        scale, causal = node.attr("scale"), node.attr("causal")
        key, part, grad = self._fused_key(node)
        operands = 6 if grad else 3
        masked = len(node.args) > operands
        mask_key = ("fused mask", id(node.args[-1]), node.args[1 if grad else 0].dtype)

        def run(args):  # (the call itself: a sibling whose call this run made reads `_fused_part`)
            mask = dead = None
            past = causal  # (the program's own causal mask: the kernels' causal form, masks.py)
            if masked:
                prepared = self.memo.get(mask_key)
                if prepared is None:
                    q, keys = args[1 if grad else 0], args[2 if grad else 1].shape[2]
                    kept = masks.kept(args[-1], q.shape[2], keys)
                    prepared = self.memo[mask_key] = (None, None, kept == masks.CAUSAL) if kept else (
                        *flash.prepare(args[-1], q, keys), False)
                mask, dead, past = prepared[0], prepared[1], causal or prepared[2]
            if grad:
                got = flash.backward(*args[:6], scale, past, mask)
            else:
                got = flash.forward(*args[:3], scale, past, mask, dead)
            self.memo[key] = got
            return _attention_part(got, part, grad)
        return run

    @staticmethod
    def attention_direct(node: Node):
        """A CPU `sdpa` or `sdpa_mask` on the operands the wrapper passes (wrapper.direct_attention):
        q, k, v (and the mask) as arguments, no environment.  What the mask keeps where it is the
        program's own (masks.kept: every key, or the causal past) is asked again only of another
        mask tensor than the last: the pair (mask, answer) is swapped whole, so that a run in
        another thread reads a consistent one.  A bool mask is given in its additive form
        (masks.additive), which torch's flash kernel takes as it is.
        LLaMA's attention step at --size test took 44 us a call through the environment, the
        flash kernel and its NaN check 25."""
        shapes = [a.shape for a in node.args]
        masked = library.attention(shapes, node.a, False)

        def checked(out):
            return plan_shaped(node, out)
        if node.op == "sdpa":
            return lambda q, k, v: checked(masked([q, k, v]))
        unmasked = {masks.CAUSAL: library.attention(shapes[:3], {**node.a, "causal": True}, False),
                    masks.EVERY: library.attention(shapes[:3], node.a, False)}
        queries, keys = shapes[0][-2], shapes[1][-2]
        last = [(lambda: None, None)]  # (the mask held weakly: a caller's tensor is not kept alive)

        def run(q, k, v, mask):
            seen = last[0]
            if seen[0]() is not mask:
                seen = last[0] = (weakref.ref(mask), masks.kept(mask, queries, keys))
            if seen[1]:
                return checked(unmasked[seen[1]]([q, k, v]))
            return checked(masked([q, k, v, masks.additive(mask, q.dtype)]))
        return run

    def _kept(self, node: Node, mask) -> str | None:
        """What this run's mask of `node` keeps where it is the program's own constant (masks.kept:
        every key, or the causal past), once per run."""
        key = ("kept", id(node.args[3]))
        if key not in self.memo:
            self.memo[key] = masks.kept(mask, node.args[0].shape[-2], node.args[1].shape[-2])
        return self.memo[key]

    def _causal_or(self, node: Node, masked):
        """sdpa over (q, k, v, mask): causal where the mask is the program's causal one, without it
        where it keeps every key."""
        shapes, cuda = [a.shape for a in node.args[:3]], self.device == "cuda"
        unmasked = {masks.CAUSAL: library.attention(shapes, {**node.a, "causal": True}, cuda),
                    masks.EVERY: library.attention(shapes, node.a, cuda)}
        return lambda args: unmasked[kept](args[:3]) if (kept := self._kept(node, args[3])) else masked(args)

    def _masked_attention(self, node: Node):
        """sdpa with a mask on CUDA: the mask converted once per run for the layers that share it
        (library.fused_kernel_mask), grouped query heads on the query axis with a mask grouped
        once as well (library.grouped_queries); what depends on shapes only, decided now."""
        q_shape, k_shape, v_shape, m_shape = (a.shape for a in node.args)
        keys, rows = k_shape[-2], q_shape[-2]
        key = ("mask", id(node.args[3]), node.args[0].dtype, keys)  # each layer's sdpa reads one mask
        m_dim = max(len(m_shape), 2)  # (as fused_kernel_mask leaves it)
        groups = q_shape[-3] // k_shape[-3] if ops.gqa(q_shape, k_shape, v_shape) else 0
        if not (groups and len(q_shape) == 4 and not node.attr("causal") and m_dim <= 4
                and (m_dim < 4 or m_shape[0] in (1, q_shape[0]))):
            groups = 0
        group_key = key + (groups, rows)
        prepared = library.attention([q_shape, k_shape, v_shape, m_shape], node.a, cuda=True)
        scale, nan = node.attr("scale"), node.op == "softmax_attention"
        causal = library.attention([q_shape, k_shape, v_shape], {**node.a, "causal": True}, cuda=True)
        unmasked = library.attention([q_shape, k_shape, v_shape], node.a, cuda=True)

        def run(args):
            memo = self.memo
            kept = self._kept(node, args[3])
            if kept:
                return (causal if kept == masks.CAUSAL else unmasked)(args[:3])
            mask = memo.get(key)
            if mask is None:
                mask = memo[key] = library.fused_kernel_mask(args[3], keys, args[0].dtype)
            if groups:  # grouped-query attention: the grouped mask, also once
                grouped = memo.get(group_key)
                if grouped is None:
                    grouped = memo[group_key] = library.query_group_mask(mask, groups, rows)
                out = library.grouped_queries(args[0], args[1], args[2], grouped, scale)
            else:
                out = prepared([args[0], args[1], args[2], mask])
            return library.nan_rows(self._masked_rows(node, mask, keys), out) if nan else out
        return run

    def _masked_rows(self, node: Node, mask, keys: int):
        key = ("masked rows", id(node.args[3]), keys)  # layers that share a mask share its rows
        if key not in self.memo:
            self.memo[key] = library.fully_masked_rows(mask, keys)
        return self.memo[key]


def plan_shaped(node: Node, out: torch.Tensor) -> torch.Tensor:
    """A step's result, checked to have its node's shape (generated kernels would read it as the
    plan's shape, out of bounds)."""
    if out.shape != node.shape:
        raise CodegenError(f"{node.op} gave a tensor of shape {list(out.shape)} where the plan has "
                           f"{list(node.shape)} (a bug in egraph_compiler's op table; please report it)")
    return out


def _attention_part(got: tuple, part: int, grad: bool) -> torch.Tensor:
    """One result of a fused attention call (flash.py): a gradient or the output as [B, H, S, D]
    from torch's [B, S, H, D], the logsumexp as it is."""
    return got[part] if part == 1 and not grad else got[part].transpose(1, 2)
