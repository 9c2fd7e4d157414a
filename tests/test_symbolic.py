"""A Dynamo graph of symbolic sizes is exported once (egraph_compiler/symbolic.py): later sizes
take the exported ATen graph run on fake tensors of their shapes, never another export, and
every size matches eager; where the exported graph does not hold for a size (outside its range
constraints, a failed fake run), capture exports at that size as before."""
import random

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from egraph_compiler import symbolic

from tests.test_random_programs import random_program


@pytest.fixture
def exports(monkeypatch):
    """Counts torch.export.export calls."""
    calls = []
    original = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(k.get("dynamic_shapes")) or original(*a, **k))
    return calls


def block(x, w, b):
    h = F.layer_norm(x, x.shape[-1:], w, b)
    return torch.softmax(h @ h.transpose(-1, -2) * 0.125, -1) @ h + x


def test_later_sizes_take_the_export_of_the_first(exports):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="egraph", dynamic=True)
    w, b = torch.randn(32), torch.randn(32)
    for n in (9, 13, 17, 30):
        x = torch.randn(2, n, 32)
        torch.testing.assert_close(compiled(x, w, b), block(x, w, b), atol=1e-4, rtol=1e-4)
    assert len(exports) == 1 and exports[0] is not None  # one export, with its sizes dynamic


def test_a_model_with_float_arguments_is_exported_once(exports):
    """GPT-2 under `dynamic=True`: Dynamo passes its dropout rates and embedding norms as floats
    read by `.item()`; they are bound into the graph exported once, and each length matches eager."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100,
                                                         bos_token_id=0, eos_token_id=0)).eval()
    compiled = torch.compile(net, backend="egraph", dynamic=True)
    with torch.no_grad():
        for seq in (12, 20, 27):
            ids = torch.randint(0, 100, (2, seq))
            torch.testing.assert_close(compiled(ids).last_hidden_state, net(ids).last_hidden_state,
                                       atol=1e-4, rtol=1e-4)
    assert len(exports) == 1


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_through_dynamic_sizes(seed, exports):
    """Random programs of views, reductions and row composites at three (batch, rows) sizes
    through `dynamic=True`, each against eager, all on the one export."""
    rng = random.Random(seed + 500)
    program, steps = random_program(rng)
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="egraph", dynamic=True)
    for n, (batch, rows) in enumerate([(2, 4), (3, 6), (5, 9)]):
        x = torch.randn(batch, rows, 16, generator=torch.Generator().manual_seed(seed * 10 + n))
        torch.testing.assert_close(compiled(x), program(x), atol=1e-4, rtol=1e-4, equal_nan=True,
                                   msg=lambda m: f"{m}\nsteps: {steps}")
    assert len(exports) == 1, steps


def test_a_size_outside_the_exported_range_is_not_served():
    """The exported graph holds for its range constraints only: a size outside them gets None
    (capture exports at that size); one inside gets the graph at that size."""
    n = torch.export.Dim("n", min=4, max=16)
    program = torch.export.export(_Relu(), (torch.randn(8, 3),), dynamic_shapes=({0: n},)).run_decompositions({})
    assert symbolic._at_sizes(program, [torch.randn(20, 3)]) is None
    assert symbolic._at_sizes(program, [torch.randn(8, 4)]) is None  # a static size that differs
    served = symbolic._at_sizes(program, [torch.randn(12, 3)])
    shapes = [tuple(node.meta["val"].shape) for node in served.graph_module.graph.nodes
              if node.op in ("placeholder", "call_function")]
    assert shapes[0] == (12, 3) and all(isinstance(d, int) for s in shapes for d in s)


def test_a_failed_fake_run_falls_back_to_an_export_per_size(monkeypatch, exports):
    def broken(program, tensors):
        raise RuntimeError("no fake kernel")
    monkeypatch.setattr(symbolic, "_at_sizes", broken)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="egraph", dynamic=True)
    w, b = torch.randn(32), torch.randn(32)
    for n in (9, 13):
        x = torch.randn(2, n, 32)
        torch.testing.assert_close(compiled(x, w, b), block(x, w, b), atol=1e-4, rtol=1e-4)
    assert len(exports) == 3  # the dynamic export, then one per size


def test_fallback_warnings_name_the_source_line_of_a_dynamic_graph():
    def fn(x, w):
        return torch.sign(x @ w).sum(-1) + torch.softmax(x, -1).sum(-1)  # sign: outside the vocabulary
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="egraph", dynamic=True)
    w = torch.randn(16, 16)
    with pytest.warns(UserWarning, match=r"aten\.sign.*test_symbolic\.py.*torch\.sign"):
        x = torch.randn(5, 16)
        torch.testing.assert_close(compiled(x, w), fn(x, w))
    x = torch.randn(7, 16)
    torch.testing.assert_close(compiled(x, w), fn(x, w))
    assert any("sign" in str(f) for f in egc.last_compiled()[-1].plan.fallbacks)


class _Relu(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).sum(0)


def test_sizes_in_cycles_longer_than_the_cache_keep_some_and_free_the_rest(monkeypatch):
    """`generate()` meets each sequence length once per call.  With the per-size cache smaller than
    the cycle, least-recently-used eviction dropped each size just before it came again (a second
    30-token generation compiled all 29 lengths again), and the record behind `last_compiled` kept
    every evicted program alive.  Random eviction keeps some; evicted programs are freed."""
    import gc
    from egraph_compiler import api
    monkeypatch.setattr(api._PerSize, "LIMIT", 4)
    compiles = []
    real = api.compile
    monkeypatch.setattr(api, "compile", lambda *a, **k: compiles.append(1) or real(*a, **k))
    torch._dynamo.reset()
    egc.last_compiled(clear=True)
    fn = torch.compile(lambda x: torch.softmax(x * 2.0, -1) + 1.0, backend="egraph", dynamic=True)
    lengths = [5, 6, 7, 8, 9, 10]
    for _ in range(3):
        for n in lengths:
            x = torch.randn(3, n)
            torch.testing.assert_close(fn(x), torch.softmax(x * 2.0, -1) + 1.0)
    assert len(lengths) < len(compiles) < 3 * len(lengths), len(compiles)  # (every call a compile under LRU)
    gc.collect()
    assert len(egc.last_compiled()) <= 4
