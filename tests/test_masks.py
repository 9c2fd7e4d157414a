"""Masks the program makes itself (masks.py): attention runs a causal one as `is_causal`, and one
that keeps every key without a mask, in inference and in training's forward and backward; any
other mask, and any mask the caller passes in, runs as a mask.  Every case is checked against
eager."""
import copy
import weakref

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from concurrency import in_threads
from egraph_compiler import flash, library, masks


def _positions_mask(s: int, kind: str, device="cpu", dtype=torch.float32):
    """A mask built from positions, as `transformers` builds a decoder's (folded at compile time)."""
    i = torch.arange(s, device=device)
    keep = i[None, :] <= i[:, None]
    if kind == "window":  # a sliding window: not causal
        keep = keep & (i[None, :] > i[:, None] - 3)
    if kind == "shifted":  # one key short of causal on the diagonal
        keep = i[None, :] < i[:, None]
        keep[0, 0] = True
    if kind in ("every", "zeros"):  # keeps every key (transformers 5.17 hands an encoder such a mask)
        keep = (i[None, :] <= i[:, None]) | (i[None, :] > i[:, None])
    if kind in ("bool", "every") or kind in ("window", "shifted"):
        return keep[None, None]
    fill = torch.finfo(dtype).min if kind == "lowest" else float("-inf")
    return torch.zeros(s, s, device=device, dtype=dtype).masked_fill(~keep, fill)[None, None]


class _Decoder(torch.nn.Module):
    def __init__(self, kind: str, width: int = 32, heads: int = 4):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        mask = _positions_mask(s, self.kind, x.device, x.dtype)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, w))


@pytest.fixture
def calls(monkeypatch):
    return spy_attention(monkeypatch)


def spy_attention(monkeypatch) -> list:
    """(kind, is_causal, masked) of every attention call made: library.attention's, flash's forward
    and backward."""
    seen = []
    made = library.attention

    def attention(shapes, a, cuda):
        run = made(shapes, a, cuda)
        return lambda t: (seen.append(("sdpa", a["causal"], len(t) > 3)), run(t))[1]
    monkeypatch.setattr(library, "attention", attention)
    for name in ("forward", "backward"):
        fn = getattr(flash, name)

        def spy(*args, fn=fn, name=name):
            seen.append((name, args[-3 if name == "forward" else -2], args[-2 if name == "forward" else -1] is not None))
            return fn(*args)
        monkeypatch.setattr(flash, name, spy)
    return seen


@pytest.mark.parametrize("kind, causal", [("bool", True), ("inf", True), ("lowest", True), ("window", False),
                                          ("shifted", False)])
def test_inference_runs_the_programs_causal_mask_as_causal(kind, causal, calls):
    model = _Decoder(kind).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        compiled = egc.compile(model, [x])
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert calls and all(c == ("sdpa", causal, not causal) for c in calls), calls


def test_a_causal_mask_the_caller_passes_stays_a_mask(calls):
    """Its values could change between calls: only the program's own constants are trusted."""
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    mask = _positions_mask(9, "bool")
    compiled = egc.compile(fn, [q, k, v, mask])
    torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))
    mask = ~mask  # the same shapes, other values: still right
    mask[..., 0] = True
    torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))
    assert calls and all(masked and not causal for _, causal, masked in calls), calls


@pytest.mark.parametrize("kind", ["every", "zeros"])
def test_a_mask_of_the_programs_that_keeps_every_key_is_dropped(kind, calls):
    model = _Decoder(kind).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        compiled = egc.compile(model, [x])
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert calls and all(c == ("sdpa", False, False) for c in calls), calls


@pytest.mark.parametrize("kind", ["every", "window"])
def test_a_callers_bool_mask_reaches_the_flash_kernel_in_its_additive_form(kind, monkeypatch):
    """As torch's sdpa converts it (0 where kept, -inf elsewhere), once per mask tensor and version: a
    caller's mask is never trusted to keep everything, and its in-place change is seen."""
    flashed = []
    made = library._FLASH_CPU
    monkeypatch.setattr(library, "_FLASH_CPU", lambda *a, **k: (flashed.append(k["attn_mask"]), made(*a, **k))[1])

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    mask = _positions_mask(9, kind).expand(2, 1, 9, 9).clone()
    with torch.no_grad():
        compiled = egc.compile(fn, [q, k, v, mask])
        torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))
        mask[0, 0, 3] = False  # a row of one batch masked whole, in place
        mask[1, 0, 5, :4] = False
        torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask), equal_nan=True)
    assert len(flashed) == 2 and all(m.dtype == q.dtype and m.shape == mask.shape for m in flashed), flashed
    assert torch.equal(flashed[1], torch.zeros(mask.shape).masked_fill(~mask, float("-inf")))


def test_a_callers_bool_mask_made_under_inference_mode_is_converted_every_call():
    """An inference tensor keeps no version counter: its in-place change could not be seen."""
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with torch.inference_mode():
        q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
        mask = _positions_mask(9, "window").expand(2, 1, 9, 9).clone()
        compiled = egc.compile(fn, [q, k, v, mask])
        torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))
        mask[1, 0, 5, :4] = False
        mask[0, 0, 2] = True
        torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))


def test_a_noted_constant_is_known_to_keep_every_key():
    every, causal = _positions_mask(5, "every"), _positions_mask(5, "bool")
    zeros = torch.zeros(1, 1, 5, 5)
    assert masks.kept(every, 5, 5) is None  # never folded: a caller's tensor
    for value in (every, causal, zeros):
        masks.note(value)
    assert masks.kept(every, 5, 5) == masks.kept(zeros.expand(2, 3, 5, 5), 5, 5) == masks.EVERY
    assert masks.kept(causal, 5, 5) == masks.CAUSAL and masks.kept(every, 5, 4) is None


@pytest.mark.parametrize("kind, causal", [("bool", True), ("lowest", True), ("window", False), ("every", False)])
def test_training_runs_the_forwards_causal_mask_as_causal_both_ways(kind, causal, calls):
    """The backward gets the forward's folded mask as a saved activation, the very constant: causal too."""
    torch.manual_seed(0)
    model = _Decoder(kind)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="egraph")
    x = torch.randn(2, 9, 32)
    for m, fn in ((model, compiled), (reference, reference)):
        fn(x).square().mean().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)
    fused = [c for c in calls if c[0] in ("forward", "backward")]
    assert {c[0] for c in fused} == {"forward", "backward"}, calls
    masked = kind == "window"  # (causal or every key: no mask)
    assert all(c[1:] == (causal, masked) for c in fused), fused


def test_only_masks_of_the_programs_own_are_noted():
    value = _positions_mask(5, "bool")
    assert not masks.causal(value, 5, 5)  # never folded: a caller's tensor
    masks.note(value)
    assert masks.causal(value, 5, 5) and masks.causal(value.expand(3, 2, 5, 5), 5, 5)
    assert not masks.causal(value, 5, 6) and not masks.causal(value.transpose(-1, -2), 5, 5)


def test_a_constant_its_program_let_go_is_trusted_no_more():
    """Noted weakly: once the constant is gone its address may become another tensor's."""
    value = _positions_mask(6, "bool").clone()
    masks.note(value)
    view = value.detach()  # (keeps the storage, not the noted tensor: as a lent constant)
    assert masks.causal(view, 6, 6)
    del value
    assert not masks.causal(view, 6, 6)


def test_threads_calling_one_program_get_their_own_masks_dead_rows():
    """Two threads calling one compiled program with masks whose dead rows differ (attention's NaN
    rows, found once per run for the layers that read the mask).  The values a run shares between
    its steps were one dict per program: a run read the rows the other thread's run had found
    (226 wrong results of 600 calls).  They are per thread now."""
    torch.manual_seed(0)
    w = torch.randn(32, 32) * 0.1

    def f(q, k, v, m):
        x = q
        for _ in range(4):
            x = torch.softmax((x @ k.transpose(-1, -2)) * 0.125 + m, -1) @ v @ w + x
        return x
    q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
    open_mask = torch.zeros(128, 128)
    dead_rows = torch.zeros(128, 128)
    dead_rows[5:9] = float("-inf")
    compiled = egc.compile(f, [q, k, v, open_mask])
    assert "softmax_attention" in compiled.plan.ops(), str(compiled.plan)
    wrong = []

    def calls(mask):
        want = f(q, k, v, mask)
        for _ in range(60):
            got = compiled(q, k, v, mask)
            if not torch.allclose(got, want, atol=1e-4, equal_nan=True):
                wrong.append(mask is dead_rows)
    runs = [(m,) for m in (open_mask, dead_rows) * 2]
    in_threads(calls, runs)
    assert not wrong, f"{len(wrong)} wrong results of {60 * len(runs)}"



def test_attention_math_fallbacks_in_threads_leave_torchs_kernel_choice_alone():
    """A non-finite q takes torch's math kernel (library.on_cpu).  It was chosen with
    `sdpa_kernel(MATH)`, which sets process-wide flags: threads entering and leaving it at once left
    the whole process on the math kernel, which refuses a mask with `is_causal`, and the sdpa
    tests that ran after the threaded test failed.  The math kernel is called directly now, with
    the causal mask added to the caller's (a row that meets a NaN is NaN, as eager's math kernel)."""
    from egraph_compiler import library
    flags = (torch._C._get_flash_sdp_enabled(), torch._C._get_math_sdp_enabled(),
             torch._C._get_mem_efficient_sdp_enabled())
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    q[0, 0, 1, 2] = float("nan")
    mask = torch.randn(5, 7)
    for causal in (False, True):
        got = library.sdpa([q, k, v, mask], {"scale": 0.3, "causal": causal})
        scores = q @ k.transpose(-2, -1) * 0.3 + mask
        if causal:
            scores = scores.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(got, torch.softmax(scores, -1) @ v, equal_nan=True)
    errors = []

    def calls():
        try:
            for _ in range(200):
                library.sdpa([q, k, v, mask], {"scale": 0.3, "causal": False})
        except Exception as exc:  # (a failure in a thread is not the test's unless kept)
            errors.append(exc)
    in_threads(calls, [()] * 4)
    assert not errors, errors
    assert (torch._C._get_flash_sdp_enabled(), torch._C._get_math_sdp_enabled(),
            torch._C._get_mem_efficient_sdp_enabled()) == flags


def _attention_program(case: str):
    """(fn, inputs): attention as a program writes it, in the layouts and dtypes of `case`."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    s = 1 if case == "one query" else 7
    kv_heads = 2 if case == "grouped" else 4
    q = torch.randn(2, 4, s, 8, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, s, 8, dtype=dtype) for _ in range(2))
    if case == "transposed q":  # (a last dim not contiguous: torch's math kernel, as eager picks)
        q = torch.randn(2, 4, 8, s).transpose(-1, -2)
    if case in ("no mask", "transposed q", "one query", "bf16"):
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), [q, k, v]
    if case == "caller's mask":
        mask = torch.rand(2, 1, s, s) > 0.3
        mask[..., 0] = True
        return (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), [q, k, v, mask]

    def fn(q, k, v):  # the program's own causal mask (grouped: as transformers' sdpa with enable_gqa)
        mask = _positions_mask(q.shape[-2], "inf")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=case == "grouped")
    return fn, [q, k, v]


@pytest.mark.parametrize("case", ["no mask", "program's causal mask", "caller's mask", "grouped", "transposed q",
                                  "one query", "bf16"])
def test_an_attention_step_takes_the_wrappers_operands(case):
    """A CPU attention call is made on the operands the wrapper holds (steps.attention_direct): no
    environment, the causal question asked again only of another mask tensor (LLaMA's step at
    --size test: 44 us through the environment, 25 for the flash kernel and its NaN check)."""
    fn, inputs = _attention_program(case)
    with torch.no_grad():
        compiled = egc.compile(fn, inputs)
        lines = [line for line in compiled._executable.wrapper.source.splitlines() if "# library: sdpa" in line]
        assert lines and all(line.endswith(", direct") for line in lines), compiled._executable.wrapper.source
        tolerance = dict(atol=2e-2, rtol=2e-2) if case == "bf16" else dict(atol=1e-5, rtol=1e-4)
        for _ in range(2):  # (the second call with new values, a caller's mask among them)
            torch.testing.assert_close(compiled(*inputs), fn(*inputs), **tolerance)
            inputs = [torch.rand(x.shape) > 0.5 if x.dtype == torch.bool else torch.randn_like(x) for x in inputs]
            if case == "caller's mask":
                inputs[3][..., 0] = True
        if case == "caller's mask":  # the last mask asked about is held weakly: the caller's to free
            compiled(*inputs)
            gone = weakref.ref(inputs[3])
            del inputs
            assert gone() is None
