"""CUDA graphs: a compiled program's launches recorded once and replayed.

`compile(..., cuda_graphs=True)` (or `torch.compile(..., mode="reduce-overhead")`)
on the cuda target: the first call runs the straight-line wrapper as usual
(Triton compiles, cuBLAS initialises); the second records it into a CUDA graph
and replays it (one launch for the whole program, no Python per kernel), and
returns copies of the outputs (the next replay overwrites the graph's own).

Inputs are read in place when they stay put: parameters and buffers, and any
argument whose storage was the same on the two calls before recording (through
Dynamo a module's parameters are arguments; copying each one in per replay
would cost a launch per parameter, as Inductor's static inputs avoid). Their
addresses are checked per replay; one that moved records the graph again and
from then on is copied into a static buffer, so an argument that is a fresh
tensor per call costs one copy; a copied one that then stays put over two
calls records again reading it in place (once per input), so recordings are
bounded by the inputs.  A backward's incoming gradients (`tangents_*`) are new
tensors every step, at whatever address the allocator had free: they are copied
from the first recording on, never bet on to stay put.

A training forward's saved activations are lent, not copied (`lend`): the
caller gets the graph's own buffers (a saved value torch can only give as a
copy, such as keys repeated per head, is computed inside the recording too),
and the backward graph, called with them at the same addresses each step,
reads them in place (copying them out of one
graph and into the other was 1.4 of GPT-2's 4.4 ms step on the H200). A
replay would overwrite what it lent, so before each replay the lent buffers'
storages are counted (`torch._C._storage_Use_Count`, views included): while
anyone still holds one (backward not run yet, as in gradient accumulation),
the call runs without the graph; the second time, the holders keep those
buffers and a new recording copies its results out. Nothing the caller
holds is ever overwritten.

An input that is not contiguous (a transpose a forward saved) is made
contiguous by a copy inside the graph, which reads the caller's tensor in
place; addresses are compared with their strides.  Through `torch.compile`
(`strides_checked`, set by api._PerSize for a graph of fixed sizes) Dynamo's
guards already hold every argument's sizes and strides, so a replay compares
addresses only, in one list comparison; a training step's ~80 arguments and
outputs cost ~100 us of host time a call (it was ~200 us, twice Inductor's).

A program that cannot be recorded (an ATen fallback that synchronises with the
host or allocates outside the graph's pool) runs without a graph, with a
warning that names the reason: never a wrong answer, never silently slower.
"""
from __future__ import annotations

import operator
import os
import warnings

import torch

from .outputs import picker


EMULATE_ENV = "EGC_EMULATE_CUDA_GRAPHS"


class CudaRecorder:
    """Records a run into a CUDA graph and replays it."""

    @staticmethod
    def capture(run, static):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up on a side stream, as torch's graph recipe asks
            run(static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = run(static)
        return graph, out

    @staticmethod
    def replay(graph, run, env, static, out) -> None:
        graph.replay()

    @staticmethod
    def failed() -> None:
        torch.cuda.synchronize()


class EmulatedRecorder:
    """A CUDA graph's memory semantics on the CPU, for tests where there is no GPU
    (`EGC_EMULATE_CUDA_GRAPHS=1` with `cuda_graphs=True` on the cpu target): a replay
    runs the program on the inputs where the graph would read them (copied ones from
    their static buffers) and writes its results into the recorded buffers, as a
    replay rewrites them; so a runner that let a replay overwrite what a caller holds
    gives that caller wrong values, which the tests see."""

    @staticmethod
    def capture(run, static):
        # the "graph": each input's layout as recorded, which a replay reads at the input's storage
        layouts = {key: (t.shape, t.stride(), t.storage_offset()) for key, t in static.items()
                   if isinstance(t, torch.Tensor)}
        return layouts, run(dict(static))

    @staticmethod
    def replay(graph, run, env, static, out) -> None:
        inputs = {**env, **static}
        for key, layout in graph.items():  # (a graph reads the recorded addresses with the recorded strides)
            inputs[key] = inputs[key].as_strided(*layout)
        new = run(dict(inputs))
        for key, buffer in out.items():
            if key not in inputs and isinstance(buffer, torch.Tensor):
                buffer.data.copy_(new[key])  # (.data: as a replay, leaving autograd's version counters alone)

    @staticmethod
    def failed() -> None:
        pass


def recorder_for(device: str):
    """The recorder of a device's programs; None where there are no CUDA graphs."""
    if device == "cuda":
        return CudaRecorder()
    return EmulatedRecorder() if os.environ.get(EMULATE_ENV) == "1" else None


_use_count = torch._C._storage_Use_Count  # (a storage's owners: tensors and views, by its _cdata)


def _users(storage) -> int:
    return _use_count(storage._cdata)


class GraphedRunner:
    """Runs `run(env) -> env` (the wrapper) through a CUDA graph once warm.
    `lend(env) -> tensors`: the outputs handed out as the graph's own buffers."""

    def __init__(self, run, user_ids: list[int], name: str = "program", lend=None, recorder=None,
                 any_strides: frozenset = frozenset(), fresh: frozenset = frozenset()):
        """`any_strides`: the inputs that only torch's calls read, taken as they are; `fresh`: inputs
        that are new tensors on every call (a backward's incoming gradients), always copied in."""
        self._user_ids, self._name, self._lend = user_ids, name, lend
        self._recorder = recorder or CudaRecorder()
        must_be_dense = [key for key in user_ids if key not in any_strides]

        def dense(env):  # a strided input (a saved transpose) is made contiguous inside the graph,
            strided = [key for key in must_be_dense if not env[key].is_contiguous()]  # which reads it in place
            if strided:
                env = dict(env)  # (the caller's env keeps the strided tensor)
                for key in strided:
                    env[key] = env[key].contiguous()
            return run(env)
        self._run = dense
        self.lending = lend is not None  # off after a caller held lent buffers over two calls
        self._lent: list[tuple] = []  # (storage, its use count with nothing lent) of the recording's lent outputs
        self._handed = False  # whether the last replay's lent buffers went out
        self.held_runs = 0  # calls run without the graph because a caller still held lent buffers
        self.recordings = 0
        self._calls = 0
        self._last: dict[int, tuple] = {}  # user input -> (address, strides) on the previous call
        self._moved: set[int] = set(fresh)  # user inputs seen at two addresses: copied per replay
        self._settled: set[int] = set(fresh)  # copied inputs that later stayed put (promoted to in place once)
        self._copied: list[int] = []  # user inputs copied into static buffers by this recording
        self._in_place: list[tuple[int, tuple]] = []  # (user input, the address and strides the graph reads)
        self._graph = None
        self._static: dict[int, torch.Tensor] = {}
        self._out: dict[int, torch.Tensor] = {}
        self._bound_ptrs: list[tuple] = []
        self._bound_keys: list[int] | None = None
        self.disabled = ""  # why graphs are off for this program (empty while they are on)
        self.strides_checked = False  # whether every call's inputs have the strides of the first (Dynamo's guards)

    @property
    def recorded(self) -> bool:
        return self._graph is not None

    @property
    def copied_inputs(self) -> int:
        """How many user inputs each replay copies in (the rest are read in place)."""
        return len(self._copied)

    def __call__(self, env: dict[int, torch.Tensor]) -> tuple[dict[int, torch.Tensor], bool]:
        """(the wrapper's env, whether its tensors belong to the graph and must be copied)."""
        self._calls += 1
        if self.disabled:
            return self._run(env), False
        if self._graph is None:
            where = {key: (env[key].data_ptr(), env[key].stride()) for key in self._user_ids}
            last, self._last = self._last, where
            if self._calls < 2:
                return self._run(env), False
            if not self._record(env, last):
                return self._run(env), False
        else:  # a replay's checks: the inputs read in place, and copied ones that may settle
            now = self._positions(env)
            last, self._now = self._now, now
            start = len(self._expect)
            if now[:start] != self._expect or self._settling(now, last) or \
                    (self._bound_keys and self._bound_ptrs != self._pointers(env)):
                moved = [key for key, was, where in zip(self._watch, self._expect, now) if where != was]
                settled = [key for key, where, was in zip(self._watch[start:], now[start:], last[start:])
                           if where == was]
                self._moved.update(moved)
                self._moved.difference_update(settled)  # copied inputs that stayed put are read in place, once
                self._settled.update(settled)  # (a backward's saved activations settle a call after its forward's graph)
                if not self._record(env, {}):
                    return self._run(env), False
            elif self._handed and self._held():  # a replay would overwrite what the caller holds
                self.held_runs += 1
                if self.held_runs < 2:
                    return self._run(env), False
                self.lending = False  # held again: the holders keep those buffers, a new graph copies its results
                if not self._record(env, {}):
                    return self._run(env), False
        for key in self._copied:
            self._static[key].copy_(env[key])
        self._recorder.replay(self._graph, self._run, env, self._static, self._out)
        self._handed = self.lending and bool(self._lent)
        return env | self._own, True

    def _positions(self, env) -> list:
        """Where the watched inputs are: their addresses, with their strides unless the caller's
        guards hold those (api._PerSize under Dynamo: `strides_checked`)."""
        tensors = self._pick(env)
        if self.strides_checked:
            return list(map(torch.Tensor.data_ptr, tensors))
        return [(t.data_ptr(), t.stride()) for t in tensors]

    def _settling(self, now: list, last: list) -> bool:
        """Whether a copied input (not yet settled) is where it was on the previous call."""
        start = len(self._expect)
        return len(now) > start and any(map(operator.eq, now[start:], last[start:]))

    def in_place(self, key: int) -> bool:
        """Whether the recorded graph reads this user input where the caller has it."""
        return self._graph is not None and key not in self._moved

    def _held(self) -> bool:
        """Whether anyone besides this runner holds a buffer the last replay lent."""
        self._handed = any(map(operator.gt, map(_use_count, self._lent_cdata), self._lent_alone))
        return self._handed

    def _pointers(self, env) -> list[tuple]:
        """Where the bound tensors (parameters of an `egc.compile`d module) are now."""
        if self._bound_keys is None:
            users = set(self._user_ids)
            self._bound_keys = [k for k in env if k not in users]
        return [(env[k].data_ptr(), env[k].shape, env[k].stride()) for k in self._bound_keys]

    def _record(self, env, last: dict[int, tuple]) -> bool:
        if self._graph is None and not self._in_place:  # the first recording: who stayed put since the last call
            self._moved.update(key for key in self._user_ids if (env[key].data_ptr(), env[key].stride()) != last.get(key))
        static = dict(env)
        copied = [key for key in self._user_ids if key in self._moved]
        for key in copied:
            static[key] = env[key].clone()
        try:
            graph, out = self._recorder.capture(self._run, static)
        except Exception as exc:  # noqa: BLE001 - any failure to record means: run without a graph
            self._recorder.failed()
            self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._graph = None
            warnings.warn(f"egraph-compiler: CUDA graphs are off for this {self._name} ({self.disabled}); it runs "
                          f"kernel by kernel", stacklevel=4)
            return False
        self._in_place = [(key, (env[key].data_ptr(), env[key].stride())) for key in self._user_ids
                          if key not in self._moved]
        # keep no tensor of the caller's (nor a view of one): a forward's lent buffers are free once
        # backward is done; a replay's env gets this call's inputs, and views of them are made again
        callers = {env[key].untyped_storage().data_ptr() for key, _ in self._in_place} - {0}
        self._out = {key: t for key, t in out.items()
                     if not (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in callers)}
        self._graph, self._static, self._copied = graph, {key: static[key] for key in copied}, copied
        self.recordings += 1
        self._lent, self._handed = [], False  # (what an earlier graph lent stays with its holders)
        if self.lending:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self._lend(self._out)}
            self._lent = [(storage, _users(storage)) for storage in storages.values()]
        self._lent_cdata = [storage._cdata for storage, _ in self._lent]  # (kept alive by self._lent)
        self._lent_alone = [alone for _, alone in self._lent]
        self._bound_ptrs = self._pointers(env)
        # what a replay checks (the inputs read in place, then copied ones not settled yet), and the
        # graph's buffers a replay hands back (the caller's env gives those inputs read in place)
        in_place = {key for key, _ in self._in_place}
        self._watch = [key for key, _ in self._in_place] + [key for key in copied if key not in self._settled]
        self._pick = picker(self._watch)
        self._now = self._positions(env)
        self._expect = self._now[:len(self._in_place)]
        self._own = {key: t for key, t in self._out.items() if key not in in_place}
        return True
