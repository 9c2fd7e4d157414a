"""Converters for reads by integer index: embedding lookups, index_select,
torch.gather, and advanced indexing by integer tensors (`x[i, j]`, as
transformers builds its attention masks: `mask[batch_idx, kv_idx]`), all onto
the op table's gathers; and the running sum that makes position ids from a
padding mask.  capture.py reads them with converters.py's table."""
from __future__ import annotations

import math

import torch

from . import ops
from .converters import _reshape
from .graph import Node, const

aten = torch.ops.aten


def _embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if len(weight.shape) != 2 or ids.dtype not in ops.INTEGERS:  # (padding_idx and the rest: backward only)
        return None
    return Node.make("embedding", (weight, ids))


def _gather(x, dim, index, sparse_grad=False):
    if index.dtype not in ops.INTEGERS or len(x.shape) != len(index.shape) or not x.shape:
        return None
    return Node.make("gather", (x, index), {"dim": ops.norm_dim(dim, len(x.shape)) - len(x.shape)})


def wrapped(i, n: int):
    """Integer indices into n entries with negative ones counted from the end, as torch's."""
    return Node.make("where", (Node.make("lt", (i, const(0.0))), Node.make("add", (i, const(float(n)))), i))


def _index(x, indices, wrap: bool = True):
    """x[i0, i1, ...] with integer tensors for x's first dims: x's rows (those dims flattened) picked
    by the flat index i0 * (n1 * ...) + i1 * ... (negative indices wrapped, as torch's), an
    embedding; the index tensors broadcast together.  After full slices (x[:, i], Falcon's
    `qkv[..., [-2], :]`) the indexed dims are moved to the front and the picked ones back to
    where the first of them was, as torch places them.  An index outside its own dim's range
    makes the flat index one past all rows (the gather raises), never another row.  Bool masks,
    and indices with a full slice between them: ATen."""
    lead = next((k for k, i in enumerate(indices) if i is not None), len(indices))
    if lead:
        return _index_after_slices(x, list(indices[lead:]), lead, wrap)
    if (not indices or len(indices) > len(x.shape)
            or any(i is None or i.dtype not in ops.INTEGERS for i in indices)):
        return None
    dims, rest = x.shape[:len(indices)], x.shape[len(indices):]
    flat = flat_index(indices, dims, wrap)
    picked = Node.make("embedding", (_reshape(x, [math.prod(dims), math.prod(rest)]), flat))
    return _reshape(picked, list(flat.shape) + list(rest))


def flat_index(indices, dims, wrap: bool = True) -> Node:
    """The row of `dims` (flattened) that each entry of the index tensors names (they broadcast
    together): i0 * (n1 * ...) + i1 * ..., negatives wrapped where `wrap`.  With several, one
    outside its own dim's range names no row (one past them all), never another row."""
    flat, total = None, const(float(math.prod(dims)))
    for k, (i, n) in enumerate(zip(indices, dims)):
        i = wrapped(i, n) if wrap else i
        if len(indices) > 1:
            i = Node.make("where", (Node.make("lt", (i, const(0.0))), total,
                                    Node.make("where", (Node.make("lt", (i, const(float(n)))), i, total))))
        stride = math.prod(dims[k + 1:])
        term = i if stride == 1 else Node.make("mul", (i, const(float(stride))))
        flat = term if flat is None else Node.make("add", (flat, term))
    return flat


def _index_after_slices(x, indices, lead: int, wrap: bool):
    rank, count = len(x.shape), len(indices)
    if not indices or lead + count > rank or any(i is None for i in indices):
        return None
    order = tuple(range(lead, lead + count)) + tuple(range(lead)) + tuple(range(lead + count, rank))
    picked = _index(Node.make("permute", (x,), {"dims": order}), indices, wrap)
    if picked is None:
        return None
    k = len(picked.shape) - (rank - count)  # the index tensors' broadcast dims, now in front
    back = tuple(range(k, k + lead)) + tuple(range(k)) + tuple(range(k + lead, len(picked.shape)))
    return Node.make("permute", (picked,), {"dims": back})


def _index_select(x, dim, index):
    """x's entries along `dim` picked by a 1-d index (torch's core decomposition of `roll`, Swin's
    shifted windows, reads this way): x[:, ..., index] by `_index`; a negative index is out of
    range, as torch's index_select has it (x[index] counts it from the end)."""
    if not x.shape or len(index.shape) != 1 or index.dtype not in ops.INTEGERS:
        return None
    return _index(x, [None] * ops.norm_dim(dim, len(x.shape)) + [index], wrap=False)


def _cumsum(x, dim, dtype=None):
    """torch.cumsum: in `dtype` if given, else integers and bools summed in int64 (as torch's)."""
    if not x.shape:
        return None
    target = str(dtype).removeprefix("torch.") if dtype is not None else (
        "int64" if x.dtype.startswith(("int", "uint", "bool")) else x.dtype)
    if target != x.dtype:
        x = Node.make("cast", (x,), {"dtype": target})
    return Node.make("cumsum", (x,), {"dim": ops.norm_dim(dim, len(x.shape)) - len(x.shape)})


INDEXING = {
    aten.cumsum.default: _cumsum,
    aten.embedding.default: _embedding,
    aten.gather.default: _gather,
    aten.index_select.default: _index_select,
    aten.index.Tensor: _index,
}
