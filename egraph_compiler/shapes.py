"""Shapes of the op table's ops (ops.py): each op's result shape from its operands' shapes and
its attributes, or a ShapeError naming what it cannot accept."""
from __future__ import annotations

import math

from .library import gqa

Shape = tuple[int, ...]


class ShapeError(ValueError):
    """Operand shapes or attributes an op cannot accept."""



def broadcast(*shapes: Shape) -> Shape:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"shapes {list(map(list, shapes))} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def norm_dim(d: int, rank: int) -> int:
    if not -rank <= d < max(rank, 1):
        raise ShapeError(f"dim {d} out of range for rank {rank}")
    return d % rank if rank else 0


def reduce_shape(shapes, a):
    (s,) = shapes
    dims = {norm_dim(d, len(s)) for d in a["dims"]}
    if a["keepdim"]:
        return tuple(1 if i in dims else n for i, n in enumerate(s))
    return tuple(n for i, n in enumerate(s) if i not in dims)


def matmul_shape(shapes, a):
    x, y = shapes
    if len(x) < 1 or len(y) < 1:
        raise ShapeError("matmul needs operands of rank >= 1")
    x2 = x if len(x) > 1 else (1,) + x
    y2 = y if len(y) > 1 else y + (1,)
    if x2[-1] != y2[-2]:
        raise ShapeError(f"matmul: inner sizes differ ({list(x)} @ {list(y)})")
    out = broadcast(x2[:-2], y2[:-2]) + (x2[-2], y2[-1])
    if len(x) == 1:
        out = out[:-2] + out[-1:]
    if len(y) == 1:
        out = out[:-1]
    return out


def transpose_shape(shapes, a):
    (s,) = shapes
    d0, d1 = norm_dim(a["dim0"], len(s)), norm_dim(a["dim1"], len(s))
    out = list(s)
    out[d0], out[d1] = out[d1], out[d0]
    return tuple(out)


def permute_shape(shapes, a):
    (s,) = shapes
    if sorted(norm_dim(d, len(s)) for d in a["dims"]) != list(range(len(s))):
        raise ShapeError(f"permute dims {list(a['dims'])} are not a permutation of rank {len(s)}")
    return tuple(s[d] for d in a["dims"])


def reshape_shape(shapes, a):
    (s,) = shapes
    if math.prod(s) != math.prod(a["shape"]):
        raise ShapeError(f"cannot reshape {list(s)} to {list(a['shape'])}")
    return tuple(a["shape"])


def expand_shape(shapes, a):
    (s,) = shapes
    out = tuple(a["shape"])
    if broadcast(s, out) != out:
        raise ShapeError(f"cannot expand {list(s)} to {list(out)}")
    return out


def cat_shape(shapes, a):
    x, y = shapes
    d = norm_dim(a["dim"], len(x))
    if len(x) != len(y) or x[:d] + x[d + 1:] != y[:d] + y[d + 1:]:
        raise ShapeError(f"cat: {list(x)} and {list(y)} differ outside dim {a['dim']}")
    return x[:d] + (x[d] + y[d],) + x[d + 1:]


def slice_shape(shapes, a):
    (s,) = shapes
    d = norm_dim(a["dim"], len(s))
    n = len(range(a["start"], min(a["end"], s[d]), a["step"]))
    return s[:d] + (n,) + s[d + 1:]


def repeat_shape(shapes, a):
    (s,) = shapes
    d = norm_dim(a["dim"], len(s))
    return s[:d] + (s[d] * a["repeats"],) + s[d + 1:]


def same_shape(shapes, a):
    return broadcast(*shapes)


def first_shape(shapes, a):
    return shapes[0]


def sdpa_shape(shapes, a):
    q, k, v = shapes[:3]
    if q[-1] != k[-1] or k[-2] != v[-2]:
        raise ShapeError(f"sdpa: q {list(q)}, k {list(k)}, v {list(v)} do not agree")
    if gqa(q, k, v):  # grouped-query attention: k and v's heads serve groups of q's heads
        k, v = (x[:-3] + (q[-3],) + x[-2:] for x in (k, v))
    batch = broadcast(q[:-2], k[:-2], v[:-2])
    if len(shapes) > 3:  # the mask's batch dims broadcast with q, k and v's (as the primitive form does)
        m = shapes[3]
        if broadcast(m[-2:], (q[-2], k[-2])) != (q[-2], k[-2]):
            raise ShapeError(f"sdpa: mask {list(m)} does not broadcast to the scores {[q[-2], k[-2]]}")
        batch = broadcast(batch, m[:-2])
    return batch + (q[-2], v[-1])


def conv2d_shape(shapes, a):
    x, w, b = shapes
    if len(x) != 4 or len(w) != 4 or x[1] != w[1] * a["groups"] or w[0] % a["groups"] or len(b) not in (0, 1):
        raise ShapeError(f"conv2d: input {list(x)}, weight {list(w)}, groups {a['groups']} do not agree")
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1
           for n, k, s, p, d in zip(x[2:], w[2:], a["stride"], a["padding"], a["dilation"])]
    if min(out) < 1:
        raise ShapeError(f"conv2d: kernel {list(w[2:])} larger than the padded input {list(x[2:])}")
    return (x[0], w[0], *out)


def upsample_shape(shapes, a):
    (x,) = shapes
    if len(x) != 4 or len(a["size"]) != 2 or min(a["size"]) < 1:
        raise ShapeError(f"upsample_bilinear2d: input {list(x)} is not [N, C, H, W] or size {list(a['size'])} is not 2 sizes")
    return (*x[:-2], *a["size"])


def max_pool2d_shape(shapes, a):
    (x,) = shapes
    if len(x) not in (3, 4):
        raise ShapeError(f"max_pool2d: input {list(x)} is not [N,] C, H, W")
    out = []
    for n, k, s, p, d in zip(x[-2:], a["kernel"], a["stride"], a["padding"], a["dilation"]):
        span = n + 2 * p - d * (k - 1) - 1
        size = -(-span // s) + 1 if a["ceil"] else span // s + 1
        if a["ceil"] and (size - 1) * s >= n + p:  # torch's: the last window starts inside the input
            size -= 1
        if size < 1 or 2 * p > k:
            raise ShapeError(f"max_pool2d: kernel {list(a['kernel'])}, padding {list(a['padding'])} do not fit "
                             f"the input {list(x[-2:])}")
        out.append(size)
    return (*x[:-2], *out)


def conv2d_grad_shape(wrt: str):
    """The shape of conv2d's gradient with respect to `wrt` ("input" or "weight"): the attribute
    `shape`, checked against the output gradient's (operand 0) and the other operand's."""
    def shape(shapes, a):
        grad, other = shapes
        x, w = (tuple(a["shape"]), other) if wrt == "input" else (other, tuple(a["shape"]))
        if len(grad) != 4 or conv2d_shape([x, w, ()], a) != tuple(grad):
            raise ShapeError(f"conv2d's {wrt} gradient: output gradient {list(grad)} does not fit input {list(x)},"
                             f" weight {list(w)}")
        return tuple(a["shape"])
    return shape


def embedding_grad_shape(shapes, a):
    grad, ids = shapes
    if tuple(grad[:-1]) != tuple(ids) or not grad:
        raise ShapeError(f"embedding's gradient: gradient {list(grad)} does not fit ids {list(ids)}")
    return (a["rows"], grad[-1])


def linear_shape(shapes, a):
    x, w, b = shapes
    return matmul_shape([x, w[::-1]], a)


def embedding_shape(shapes, a):
    weight, ids = shapes
    if len(weight) != 2:
        raise ShapeError(f"embedding: the weight must be a matrix [rows, dim], got {list(weight)}")
    return tuple(ids) + (weight[1],)


def gather_shape(shapes, a):
    source, index = shapes
    if len(source) != len(index) or not -len(source) <= a["dim"] < len(source) or any(
            i > n for k, (n, i) in enumerate(zip(source, index)) if k != a["dim"] % len(source)):
        raise ShapeError(f"gather along {a['dim']}: index {list(index)} does not fit {list(source)}")
    return tuple(index)


def leaf_shape(shapes, a):
    return tuple(a.get("shape", ()))
