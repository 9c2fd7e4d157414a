"""A call's outputs as the caller gets them, assembled by steps made once per program.

A training program hands back ~40-80 tensors a call (gradients, saved
activations), each detached, copied or passed as it is.  One Python step per
output was a fifth of the host time of a CUDA-graph replay; here the outputs
are picked out of the run's env by `operator.itemgetter` and each group that
takes the same action is mapped at C speed (`map(torch.Tensor.detach, ...)`),
then put back in order by one more `itemgetter`.
"""
from __future__ import annotations

import functools
import operator

import torch

COPY = functools.partial(torch.Tensor.clone, memory_format=torch.contiguous_format)


def picker(positions) -> callable:
    """container -> tuple of its items at `positions` (a tuple for any count)."""
    positions = list(positions)
    if not positions:
        return lambda container: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda container: (container[only],)
    return operator.itemgetter(*positions)


class Assembly:
    """Output i is `act(env[key])` where the run's env holds it, else `act(read(env))`
    (a view made again from its source): `actions` are (key, read, act) per output,
    `env_keys` what the run's env holds on every call this assembly serves."""

    def __init__(self, actions: list[tuple], env_keys):
        groups: dict = {}
        reads = []
        for i, (key, read, act) in enumerate(actions):
            if key in env_keys:
                groups.setdefault(act, []).append((i, key))
            else:
                reads.append((i, read, act))
        self._groups = [(picker(key for _, key in members), act) for act, members in groups.items()]
        self._reads = [(read, act) for _, read, act in reads]
        made = [i for members in groups.values() for i, _ in members] + [i for i, _, _ in reads]
        position = {i: n for n, i in enumerate(made)}  # output i is the call's parts[position[i]]
        self._order = picker(position[i] for i in range(len(actions)))

    def __call__(self, env) -> tuple:
        parts = []
        for pick, act in self._groups:
            parts.extend(map(act, pick(env)))
        for read, act in self._reads:
            parts.append(act(read(env)))
        return self._order(parts)


def flat_sequence(results, literal_type) -> tuple | None:
    """(tuple or list, results -> its items) for a result structure that is one flat
    sequence, which a call then builds without walking the structure; else None."""
    if results is None:
        return None
    spec, leaves = results
    if spec.type not in (tuple, list) or not all(c.is_leaf() for c in spec.children()):
        return None
    leaves = tuple(leaves)
    if not any(isinstance(leaf, literal_type) for leaf in leaves):
        return spec.type, picker(leaves)
    return spec.type, lambda results: [leaf.value if isinstance(leaf, literal_type) else results[leaf]
                                       for leaf in leaves]


def whole_buffer(value: torch.Tensor) -> bool:
    """The tensor covers its whole storage from its start (with strides of a dense permutation,
    checked by the caller: no gaps, no repeats), not a part of a larger buffer."""
    return value.storage_offset() == 0 and value.untyped_storage().nbytes() == value.numel() * value.element_size()
