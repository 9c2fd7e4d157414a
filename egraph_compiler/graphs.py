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
tensor per call costs one copy, and recordings are bounded by the inputs.

A program that cannot be recorded (an ATen fallback that synchronises with the
host or allocates outside the graph's pool) runs without a graph, with a
warning that names the reason: never a wrong answer, never silently slower.
"""
from __future__ import annotations

import warnings

import torch


class GraphedRunner:
    """Runs `run(env) -> env` (the wrapper) through a CUDA graph once warm."""

    def __init__(self, run, user_ids: list[int], name: str = "program"):
        self._run, self._user_ids, self._name = run, user_ids, name
        self._calls = 0
        self._last: dict[int, int] = {}  # user input -> its data_ptr on the previous call
        self._moved: set[int] = set()  # user inputs seen at two addresses: copied per replay
        self._copied: list[int] = []  # user inputs copied into static buffers by this recording
        self._in_place: list[tuple[int, int]] = []  # (user input, the address the graph reads)
        self._graph = None
        self._static: dict[int, torch.Tensor] = {}
        self._out: dict[int, torch.Tensor] = {}
        self._bound_ptrs: list[tuple] = []
        self._bound_keys: list[int] | None = None
        self.disabled = ""  # why graphs are off for this program (empty while they are on)

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
        if self._calls < 2:
            self._last = {key: env[key].data_ptr() for key in self._user_ids}
            return self._run(env), False
        moved = [key for key, ptr in self._in_place if env[key].data_ptr() != ptr]
        if self._graph is None or moved or self._bound_ptrs != self._pointers(env):
            self._moved.update(moved)
            if not self._record(env):
                return self._run(env), False
        for key in self._copied:
            self._static[key].copy_(env[key])
        self._graph.replay()
        return self._out, True

    def _pointers(self, env) -> list[tuple]:
        """Where the bound tensors (parameters of an `egc.compile`d module) are now."""
        if self._bound_keys is None:
            users = set(self._user_ids)
            self._bound_keys = [k for k in env if k not in users]
        return [(env[k].data_ptr(), env[k].shape, env[k].stride()) for k in self._bound_keys]

    def _record(self, env) -> bool:
        if self._graph is None and not self._in_place:  # the first recording: who stayed put since the last call
            self._moved.update(key for key in self._user_ids if env[key].data_ptr() != self._last.get(key))
        static = dict(env)
        copied = [key for key in self._user_ids if key in self._moved]
        for key in copied:
            static[key] = env[key].clone()
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a warm-up on a side stream, as torch's graph recipe asks
                self._run(static)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out = self._run(static)
        except Exception as exc:  # noqa: BLE001 - any failure to record means: run without a graph
            torch.cuda.synchronize()
            self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._graph = None
            warnings.warn(f"egraph-compiler: CUDA graphs are off for this {self._name} ({self.disabled}); it runs "
                          f"kernel by kernel", stacklevel=4)
            return False
        self._graph, self._static, self._out, self._copied = graph, static, out, copied
        self._in_place = [(key, env[key].data_ptr()) for key in self._user_ids if key not in self._moved]
        self._bound_ptrs = self._pointers(env)
        return True
