"""The wrapper's buffers (egraph_compiler/wrapper.py): a value released during a call hands its
buffer to a later value of as many elements of its dtype (viewed in the new shape), never one an
ATen fallback may have viewed; a CPU linear writes a buffer of the wrapper's (steps.linear_into)."""
import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc

TAKEN = "(its buffer, free now)"


def chain(x):
    a = torch.softmax(x * 2, -1)
    b = torch.softmax(a, 0)
    c = torch.softmax(b * 3, -1)
    d = torch.softmax(c, 0)
    return torch.softmax(d * 5, -1) * 2


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_released_buffers_are_taken_over_and_outputs_stay_the_callers(target):
    x = torch.randn(48, 40)
    compiled = egc.compile(chain, [x], target=target)
    wrapper = compiled.levels.wrapper
    assert wrapper.count(TAKEN) >= 3, wrapper
    first = compiled(x)
    kept = first.clone()
    torch.testing.assert_close(first, chain(x))
    second = compiled(torch.randn(48, 40))  # a second call writes no buffer the first one returned
    assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr()


def reshaped(x):
    a = torch.softmax(x * 2, -1)  # [48, 40]
    b = torch.softmax(a.reshape(40, 48), 0)  # a's last reader
    c = torch.softmax(b * 3, -1)  # [40, 48]: a's 1,920 elements, in another shape
    return torch.softmax(c.reshape(48, 40) + 1, 0) * 2


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_buffer_is_taken_over_by_a_value_of_another_shape_with_as_many_elements(target):
    """A released buffer viewed in the new value's shape: ~2,500 page faults of a LLaMA training
    step at --size cpu went when buffers were pooled by element count instead of shape."""
    x = torch.randn(48, 40)
    compiled = egc.compile(reshaped, [x], target=target)
    wrapper = compiled.levels.wrapper
    assert any("= _as_" in line and TAKEN in line for line in wrapper.splitlines()), wrapper
    for _ in range(2):
        torch.testing.assert_close(compiled(x), reshaped(x))
        x = torch.randn(48, 40)


def viewed_by_a_fallback(x, y):
    a = torch.softmax(x * 2, -1)
    d = a.unfold(1, 64, 64)[:, 0, :]  # outside the vocabulary: ATen hands out a contiguous view of a's buffer
    b = torch.softmax(d.t() * y, -1)  # of a's shape, after a's last reader, reading the view
    return torch.softmax(b * 3, -1)


def test_a_buffer_an_aten_fallback_read_is_never_taken_over():
    """b's kernel would write a's buffer while reading the view of it: wrong values, silently
    (0.0012 off when the fallback's reads were pooled)."""
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    with pytest.warns(UserWarning, match="unfold.*runs through ATen"):
        compiled = egc.compile(viewed_by_a_fallback, [x, y])
    assert TAKEN not in compiled.levels.wrapper, compiled.levels.wrapper
    torch.testing.assert_close(compiled(x, y), viewed_by_a_fallback(x, y))


def mlp(x, w1, b1, w2, w3, b3):
    h = F.gelu(F.linear(x, w1, b1))
    h = torch.relu(F.linear(h, w2))  # no bias: `mm`
    return F.linear(h * 2, w3, b3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(2, 7), (5,), (), (0, 3)])
def test_cpu_linears_write_into_the_wrappers_buffers(dtype, lead):
    torch.manual_seed(0)
    d, h = 24, 40
    args = [torch.randn(*lead, d), torch.randn(h, d) / 5, torch.randn(h), torch.randn(h, h) / 6,
            torch.randn(d, h) / 6, torch.randn(d)]
    args = [a.to(dtype) for a in args]
    compiled = egc.compile(mlp, args)
    wrapper = compiled.levels.wrapper
    assert wrapper.count("linear, into") == 3, wrapper
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):  # the second call's buffers are taken over from values released in it
        torch.testing.assert_close(compiled(*args), mlp(*args), atol=tol, rtol=tol)


def test_a_linear_of_a_transposed_input_or_a_size_zero_weight():
    x = torch.randn(5, 8)
    fn = lambda x, w: F.linear(x.t(), w)  # noqa: E731  (x read through a transposed view)
    for w in (torch.randn(6, 5), torch.randn(0, 5)):
        compiled = egc.compile(fn, [x, w])
        torch.testing.assert_close(compiled(x, w), fn(x, w))


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linears_take_the_operands_the_wrapper_holds(target, dtype):
    """A linear whose operands are values the wrapper holds is called on them directly (no
    environment, no getters): into a buffer of the wrapper's for float32 and bf16 on a CPU, as
    F.linear otherwise (float16, the Triton target); one whose input is a view goes through
    its step, which takes the view."""
    if target == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(1)
    args = [torch.randn(3, 5, 24), torch.randn(40, 24) / 5, torch.randn(40), torch.randn(40, 40) / 6,
            torch.randn(24, 40) / 6, torch.randn(24)]
    args = [a.to(dtype) for a in args]
    compiled = egc.compile(mlp, args, target=target)
    wrapper = compiled.levels.wrapper
    assert wrapper.count("library: linear") == 3 and wrapper.count(", direct") >= 2, wrapper
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        torch.testing.assert_close(compiled(*args), mlp(*args), atol=tol, rtol=tol)

    def viewed(x, w, b):  # x read through a transposed view: the step's own getters
        return F.linear(x.transpose(0, 1), w, b)
    x, w, b = torch.randn(24, 3).to(dtype), args[1], args[2]
    compiled = egc.compile(viewed, [x, w, b], target=target)
    assert ", direct" not in compiled.levels.wrapper, compiled.levels.wrapper
    torch.testing.assert_close(compiled(x, w, b), viewed(x, w, b), atol=tol, rtol=tol)


def products(a, b, x3, w):
    p = (a * 2) @ b  # a buffer of the wrapper's and an input, as they are
    q = a.t() @ torch.relu(p)  # a transposed input: a view with fixed strides
    r = x3.reshape(6, x3.shape[-1]) @ w  # an input only torch reads (any strides): its reshape per call
    return p, q, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(8, 8, 8), (1, 5, 3), (6, 0, 4), (0, 5, 3), (7, 3, 1)])
def test_cpu_products_of_matrices_write_into_the_wrappers_buffers(dtype, m, k, n):
    """A 2-d matmul (a training backward's products) is one `mm` into a buffer of the wrapper's,
    on operands it passes directly or as views of values it holds; called again with an input
    of other strides, the view made per call follows them."""
    torch.manual_seed(2)
    a, b, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype), torch.randn(k, n).to(dtype)
    x3 = torch.randn(2, 3, k).to(dtype)
    compiled = egc.compile(products, [a, b, x3, w])
    wrapper = compiled.levels.wrapper
    assert wrapper.count("library: matmul, into") == 3 and wrapper.count("matmul, into t") == 3, wrapper
    assert wrapper.count("matmul, into") == wrapper.count("direct"), wrapper
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    strided = torch.randn(2, k, 3).to(dtype).transpose(1, 2)  # (not contiguous: the reshape copies)
    for args in ([a, b, x3, w], [a, b, strided, w], [a * 3, b, x3 + 1, w]):
        for got, want in zip(compiled(*args), products(*args)):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# -- buffers kept between calls (wrapper.KeptBuffers) -------------------------------------

def staged(x, w):
    return torch.relu(torch.softmax(x * 2, -1) @ w) + 1  # the softmax's buffer lives within a call


@pytest.mark.parametrize("target", ["cpu", "triton"])  # (Triton's interpreter: CPU memory too)
def test_a_cpu_programs_buffers_are_written_again_once_nothing_else_holds_them(target):
    x, w = torch.randn(64, 48), torch.randn(48, 32)
    compiled = egc.compile(staged, [x, w], target=target)
    assert "_keep(_new)" in compiled.levels.wrapper
    first = compiled(x, w)
    kept = first.clone()
    held = compiled._executable.kept.sets[0]
    transient = {name: t.data_ptr() for name, t in held.items() if t.data_ptr() != first.data_ptr()}
    assert transient, compiled.levels.wrapper  # the softmax's buffer
    xs = [torch.randn(64, 48) for _ in range(3)]
    second = compiled(xs[0], w)  # the caller holds `first`: a fresh buffer for the result
    assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr()
    again = compiled._executable.kept.sets[0]
    assert {name: again[name].data_ptr() for name in transient} == transient  # the same memory, taken again
    pointer = second.data_ptr()
    del second  # nothing holds the second result now: the third call writes its buffer
    third = compiled(xs[1], w)
    assert third.data_ptr() == pointer and torch.equal(first, kept)
    torch.testing.assert_close(third, staged(xs[1], w))
    torch.testing.assert_close(first, staged(x, w))
    results = [compiled(xs[2], w) for _ in range(3)]  # results held in a list: each its own
    assert len({r.data_ptr() for r in results}) == 3 and third.data_ptr() not in {r.data_ptr() for r in results}
    for r in results:
        torch.testing.assert_close(r, staged(xs[2], w))


def returned_views(x):
    a = torch.softmax(x * 2, -1)
    return a.t(), a[1:3], torch.softmax(a, 0) * 3  # views of a buffer, handed out


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_buffer_a_handed_out_view_holds_is_never_written_again(mode):
    x = torch.randn(24, 20)
    compiled = egc.compile(returned_views, [x])
    with getattr(torch, mode)():
        first = compiled(x)
        copies = [t.clone() for t in first]
        for _ in range(3):
            compiled(torch.randn(24, 20))  # later calls write none of the first call's results
    for got, want, ref in zip(first, copies, returned_views(x)):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_result_whose_storage_was_resized_away_is_never_written_again(target):
    x, w = torch.randn(64, 48), torch.randn(48, 32)
    compiled = egc.compile(staged, [x, w], target=target)
    for _ in range(3):  # as FSDP2 frees the gradients it has reduced: storage resized to 0 bytes
        result = compiled(x, w)
        torch.testing.assert_close(result, staged(x, w))
        result.untyped_storage().resize_(0)
        del result


def test_calls_from_several_threads_each_take_their_own_buffers():
    from concurrent.futures import ThreadPoolExecutor
    w = torch.randn(48, 32)
    compiled = egc.compile(staged, [torch.randn(64, 48), w])
    xs = [torch.randn(64, 48) for _ in range(16)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda x: [compiled(x, w) for _ in range(20)][-1], xs))
    for x, got in zip(xs, results):
        torch.testing.assert_close(got, staged(x, w))
    assert len(compiled._executable.kept.sets) <= compiled._executable.kept.LIMIT


def test_keep_buffers_false_gives_them_back_every_call():
    x, w = torch.randn(64, 48), torch.randn(48, 32)
    off = egc.compile(staged, [x, w], keep_buffers=False)
    assert off._executable.kept is None and "_keep" not in off.levels.wrapper
    torch.testing.assert_close(off(x, w), staged(x, w))
    model = torch.compile(lambda x, w: staged(x, w), backend="egraph", options={"keep_buffers": False})
    torch.testing.assert_close(model(x, w), staged(x, w))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 64), torch.nn.Linear(64, 24)

    def forward(self, x):
        return self.down(F.gelu(self.up(torch.softmax(x, -1)))) + x


def test_saved_activations_are_written_again_only_once_backward_lets_them_go():
    torch.manual_seed(0)
    eager = Block()
    ours = Block()
    ours.load_state_dict(eager.state_dict())
    compiled = torch.compile(ours, backend="egraph")
    for step in range(3):
        xs = [torch.randn(8, 24) for _ in range(3)]
        # three forwards before one backward (gradient accumulation in one graph): each forward's
        # saved activations stay held by autograd while the next forward runs
        for model, fn in ((eager, eager), (ours, compiled)):
            model.zero_grad(set_to_none=True)
            loss = sum((fn(x) * (i + 1)).square().mean() for i, x in enumerate(xs))
            loss.backward(retain_graph=True)
            loss.backward()  # (a second backward through the same saved activations)
        for (name, a), b in zip(ours.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at step {step}")


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return F.gelu(self.lin(torch.softmax(x, -1)))


def test_a_result_is_a_new_tensor_each_call_with_its_own_hooks():
    """A buffer taken again is handed out as a new tensor: the one handed out before carries
    what autograd gave it (its step's grad_fn and hooks).  Handed out as the same object, the
    later steps' hooks never ran (and FSDP2's unsharded weights were read at 0 bytes)."""
    torch.manual_seed(0)
    compiled = torch.compile(Small(), backend="egraph")
    x = torch.randn(8, 16)
    calls = []
    for step in range(3):
        out = compiled(x)
        out.register_hook(lambda g, step=step: calls.append(step))
        out.square().mean().backward()
        del out
    assert calls == [0, 1, 2]


def test_only_the_programs_that_kept_last_hold_buffers():
    from egraph_compiler.wrapper import KeptBuffers
    programs = [egc.compile(staged, [torch.randn(8 + i, 48), torch.randn(48, 32)]) for i in range(KeptBuffers.HOLDERS + 3)]
    for i, compiled in enumerate(programs):
        x, w = torch.randn(8 + i, 48), torch.randn(48, 32)
        torch.testing.assert_close(compiled(x, w), staged(x, w))
    holding = [bool(c._executable.kept.sets and c._executable.kept.sets[0]) for c in programs]
    assert holding == [False] * 3 + [True] * KeptBuffers.HOLDERS  # (the first three gave theirs back)
    x, w = torch.randn(8, 48), torch.randn(48, 32)
    torch.testing.assert_close(programs[0](x, w), staged(x, w))  # one that gave them back runs as before
    assert programs[0]._executable.kept.sets[0] and not programs[3]._executable.kept.sets
