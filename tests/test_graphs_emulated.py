"""CUDA graphs' bookkeeping on the CPU (CI has no GPU): `EGC_EMULATE_CUDA_GRAPHS=1`
makes a replay rerun the program and write its results into the recorded buffers,
as a real replay rewrites them (graphs.EmulatedRecorder).  The runner's logic is the
one the GPU runs: inputs read in place or copied, training's lent activations and
gradients, held buffers.  The same tests run on the H200 in test_cuda.py."""
import copy

import pytest
import torch

import egraph_compiler as egc
from egraph_compiler.graphs import EMULATE_ENV, GraphedRunner


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 32), torch.nn.LogSoftmax(-1))


def _training_steps(model, batches, accumulate: int, set_to_none: bool = True):
    """AdamW steps, compiled (reduce-overhead) and eager from the same start: parameters after them."""
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(model, backend="egraph", mode="reduce-overhead")
    results, start = [], copy.deepcopy(model.state_dict())
    for fn in (compiled, model):
        model.load_state_dict(start)
        for p in model.parameters():
            p.grad = None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(0, len(batches), accumulate):
            opt.zero_grad(set_to_none=set_to_none)
            losses = [(fn(x) * w).sum() for x, w in batches[i:i + accumulate]]  # forwards first
            for loss in losses:
                loss.backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def _batches(n=8):
    return [(torch.randn(4, 8, 32), torch.randn(4, 8, 32)) for _ in range(n)]


@pytest.mark.parametrize("accumulate, set_to_none", [(1, True), (2, True), (1, False), (3, True)])
def test_training_lends_activations_and_gradients_without_overwriting_them(accumulate, set_to_none):
    model = _model()
    got, want = _training_steps(model, _batches(12), accumulate, set_to_none)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    _assert_lent(accumulate)


def _assert_lent(accumulate: int) -> None:
    """The last forward and backward programs recorded, lent, and (accumulating) held."""
    programs = egc.last_compiled()[-2:]
    forward, backward = (c._executable.graphed for c in programs)
    assert forward.recorded and backward.recorded
    assert programs[0]._executable._lent and programs[1]._executable._lent
    if accumulate == 1:  # nothing held over a call: every replay lends, backward reads in place
        assert forward.held_runs == backward.held_runs == 0 and forward.lending and backward.lending
        assert backward.copied_inputs < len(backward._user_ids) - len(programs[0]._executable._lent)
    else:  # a second forward while the first's activations wait for backward: run without the graph
        assert forward.held_runs >= 1


def test_the_emulation_sees_a_replay_that_overwrites_held_buffers(monkeypatch):
    """The check that makes lending safe, switched off: gradient accumulation then reads activations a
    later replay overwrote, and the parameters differ from eager's.  (What the tests above rely on.)"""
    monkeypatch.setattr(GraphedRunner, "_held", lambda self: False)
    got, want = _training_steps(_model(), _batches(12), accumulate=2)
    assert any(not torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))


def test_inputs_read_in_place_follow_their_values_and_moved_ones_are_copied():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled = egc.compile(model, [x], cuda_graphs=True)
        for step in range(5):
            x.copy_(torch.randn(4, 16))  # the same tensor, new values
            torch.testing.assert_close(compiled(x), model(x))
        graphed = compiled._executable.graphed
        assert graphed.recorded and graphed.copied_inputs == 0
        outs = [(y, compiled(y)) for y in (torch.randn(4, 16) for _ in range(4))]
        for y, out in outs:  # every earlier result intact after later replays
            torch.testing.assert_close(out, model(y))
        assert graphed.copied_inputs == 1
        model[0].weight.data = torch.randn(32, 16)  # a new parameter tensor: recorded again
        torch.testing.assert_close(compiled(x), model(x))


def test_strided_inputs_are_made_contiguous_inside_the_graph():
    base = torch.randn(48, 32)

    def fn(a):
        return torch.softmax(a * 2, -1)
    compiled = egc.compile(fn, [base.t()], cuda_graphs=True)
    with torch.no_grad():
        for _ in range(4):
            base.normal_()
            torch.testing.assert_close(compiled(base.t()), fn(base.t()))
        assert compiled._executable.graphed.copied_inputs == 0
        flat = torch.randn(48 * 32)
        for a in (flat.view(48, 32).t(), flat.view(32, 48), flat.view(48, 32).t()):  # one address, two layouts
            torch.testing.assert_close(compiled(a), fn(a))


def test_under_dynamo_one_address_in_two_layouts_is_not_read_as_the_first():
    """Through torch.compile a replay checks addresses only (Dynamo's guards hold strides and
    shapes): a square input at the same address but transposed must still be read as it is."""
    _one_address_two_layouts("cpu")


def _one_address_two_layouts(device: str) -> None:
    flat = torch.randn(32 * 32, device=device)

    def fn(a, w):
        return torch.relu(a @ w) + a
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    compiled = torch.compile(fn, backend="egraph", mode="reduce-overhead")
    w = torch.randn(32, 32, device=device)
    with torch.no_grad():
        for a in [flat.view(32, 32)] * 4 + [flat.view(32, 32).t()] * 3 + [flat.view(32, 32)] * 2:
            torch.testing.assert_close(compiled(a, w), fn(a, w), atol=1e-4, rtol=1e-4)
        w.t_()  # a weight transposed in place: same address, same shape, new strides
        for _ in range(3):
            torch.testing.assert_close(compiled(flat.view(32, 32), w), fn(flat.view(32, 32), w), atol=1e-4, rtol=1e-4)
    assert all(c._executable.graphed.recorded for c in egc.last_compiled())


class _GroupedAttention(torch.nn.Module):
    """LLaMA's attention as `transformers` writes it: keys and values repeated per head by
    expand + reshape (`repeat_kv`) before sdpa, which the forward then saves for backward."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 8).transpose(1, 3).unbind(1)  # [b, 2 kv heads, s, 8] each

        def repeat_kv(t):
            return t[:, :, None].expand(b, 2, 2, s, 8).reshape(b, 4, s, 8)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, s, 32))


def test_training_graphs_record_once_when_other_work_runs_between_steps():
    """A saved activation torch can only give as a copy (keys repeated per head) is the forward
    graph's own buffer, and the incoming gradient is copied in from the start: other tensors
    allocated between steps (eager models timed beside this one) move neither into a new recording."""
    _records_once("cpu")


def _records_once(device: str) -> None:
    torch.manual_seed(0)
    model = _GroupedAttention().to(device)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="egraph", mode="reduce-overhead")
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, reference)]
    held, x = [], torch.empty(2, 16, 32, device=device)
    for step in range(8):
        x.normal_()  # (a batch in a fresh tensor per step is copied in: it moves by design)
        for fn, m, opt in ((compiled, model, opts[0]), (reference, reference, opts[1])):
            opt.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
            opt.step()
        held.append(torch.randn(1 + 37 * step, 5, device=device))  # the allocator's state differs at every step
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    forward, backward = (c._executable.graphed for c in egc.last_compiled()[-2:])
    assert forward.recordings == 1 and forward.held_runs == 0
    assert backward.recordings <= 2  # (the saved activations settle one call after the forward's graph)
    assert backward.copied_inputs == 1  # the incoming gradient; every saved activation read in place
