"""Result dtypes follow torch's type promotion: every pointwise and reduction
op of the table, on every dtype pair (and Python scalars), against torch
itself; then a sample of whole programs per dtype, compiled and run."""
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import egraph_compiler as egc
from egraph_compiler import ops
from egraph_compiler.capture import _as_torch_types
from egraph_compiler.graph import Node, const, input_node

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"]
SCALARS = [2, 0.5]  # a Python int and a Python float
POINTWISE = [name for name, op in ops.OPS.items() if op.group == "pointwise" and op.name not in ("cast", "where")]
UNARY = [name for name in POINTWISE if ops.OPS[name].arity == 1]
BINARY = [name for name in POINTWISE if ops.OPS[name].arity == 2]


def _tensor(dtype: str) -> torch.Tensor:
    return torch.tensor([[1, 2, 3], [3, 2, 1]]).to(getattr(torch, dtype))


def _operand(value):
    if isinstance(value, str):
        return input_node("a" + value, (2, 3), value), _tensor(value)
    return const(value), value


def _check(name, values):
    nodes, torch_args = zip(*(_operand(v) for v in values))
    try:
        expected = ops.OPS[name].reference(list(torch_args), {}) if all(isinstance(a, torch.Tensor)
                                                                         for a in torch_args) else None
        if expected is None:  # a Python scalar operand: call torch the way the user's program would
            expected = _torch_with_scalars(name, torch_args)
    except (RuntimeError, TypeError):
        pytest.skip(f"torch does not define {name} on {values}")
    node = _as_torch_types(Node.make(name, nodes), expected)
    assert node is not None, f"{name}{values}: the op table cannot give torch's result {expected.dtype}"
    assert node.dtype == str(expected.dtype).removeprefix("torch.")


def _torch_with_scalars(name, args):
    fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
          "maximum": None, "gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq,
          "ne": torch.ne}[name]
    if fn is None or not isinstance(args[0], torch.Tensor):
        raise TypeError("not callable with a leading scalar")
    return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", UNARY)
def test_unary_result_dtype(name, dtype):
    _check(name, (dtype,))


@pytest.mark.parametrize("left,right", list(itertools.product(DTYPES, DTYPES + SCALARS)))
@pytest.mark.parametrize("name", BINARY)
def test_binary_result_dtype(name, left, right):
    _check(name, (left, right))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["sum", "amax", "mean"])
def test_reduction_result_dtype(name, dtype):
    x = _tensor(dtype)
    try:
        expected = ops.OPS[name].reference([x], {"dims": (-1,), "keepdim": False})
    except RuntimeError:
        pytest.skip(f"torch does not define {name} on {dtype}")
    node = Node.make(name, (input_node("x", (2, 3), dtype),), {"dims": (-1,), "keepdim": False})
    assert node.dtype == str(expected.dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16])
def test_mixed_programs_per_dtype(dtype):
    """Whole programs mixing scalars, comparisons, reductions and another dtype."""
    def program(x, y):
        a = x * 2 + 1
        b = (x > 1).sum(-1, keepdim=True)
        return a + b, torch.where(x > 0, y, 0.5) * 3, (x + y).amax(0)
    x = torch.randint(-3, 4, (4, 5)).to(dtype)
    y = torch.randn(4, 5)
    expected = program(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = egc.compile(program, [x, y])
    for got, want in zip(compiled(x, y), expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


NARROW_PROGRAMS = {
    "chain": lambda x: torch.relu(x * 2 + 1).abs() - 0.5,
    "softmax": lambda x: torch.softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]) * 1.5 + 1,
    "rms_norm": lambda x: F.rms_norm(x, x.shape[-1:]) * 2,
    "row_sum": lambda x: x.sum(-1) + x.amax(-1),
    "round_trip": lambda x: (x.float() * 3).to(x.dtype) + 1,
    "gelu": lambda x: F.gelu(x) * torch.sigmoid(x),
}


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(NARROW_PROGRAMS))
def test_narrow_floats_are_generated_code_computing_in_float32(name, dtype, target):
    """fp16/bf16 tensors: stored narrow, computed in float32 inside a kernel and
    rounded once when stored (Inductor's contract too), so at least as close to
    float32 as eager's op-by-op rounding, give or take one rounding of the result."""
    fn = NARROW_PROGRAMS[name]
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    compiled = egc.compile(fn, [x], target=target)
    assert all(k.kind != "aten" for k in compiled.plan.kernels), str(compiled.plan)
    got, want, exact = compiled(x), fn(x), fn(x.float())
    assert got.dtype == want.dtype == dtype
    ulp = torch.finfo(dtype).eps * exact.abs().float() + 1e-6
    if target == "triton" and dtype == torch.bfloat16:  # the interpreter truncates float32 -> bf16
        ulp = 2 * ulp                                    # (a GPU rounds to nearest even)
    assert bool(((got.float() - exact.float()).abs() <= (want.float() - exact.float()).abs() + ulp).all())


INTEGER_CASTS = {  # integer buffers that a kernel only views and casts (rotary position ids, masks)
    "position_ids_to_float": (lambda p, f: torch.cos(p[..., None].float() * f), [torch.arange(16)[None], None]),
    "beyond_2_24": (lambda p: p.float() * 1.5, [torch.tensor([2**24 + 1, 2**40 + 3, -(2**31) - 7, 5, 0])]),
    "int32_to_bf16": (lambda p: p.to(torch.bfloat16) + 1, [torch.arange(-300, 300, 7, dtype=torch.int32)]),
    "int64_to_f16_transposed": (lambda p: p.t().half() * 2, [torch.arange(-40, 40).reshape(8, 10)]),
}


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("name", sorted(INTEGER_CASTS))
def test_integers_only_cast_are_read_by_generated_code(name, target):
    """An integer input that the kernel only views and casts is loaded by generated code
    (converted as torch converts)."""
    fn, inputs = INTEGER_CASTS[name]
    inputs = [t if t is not None else torch.rand(8, generator=torch.Generator().manual_seed(0)) for t in inputs]
    compiled = egc.compile(fn, inputs, target=target)
    assert [k.kind for k in compiled.plan.kernels] == ["generated"] and not compiled.plan.fallbacks
    got, want = compiled(*inputs), fn(*inputs)
    assert got.dtype == want.dtype
    if name == "position_ids_to_float":  # cos: the vector math library and torch's may differ by an ulp
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    elif target == "triton" and want.dtype == torch.bfloat16:  # the interpreter truncates float32 -> bf16
        torch.testing.assert_close(got, want, atol=0, rtol=2 * torch.finfo(torch.bfloat16).eps)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=0)


INTEGER_ARITHMETIC = {  # integer arithmetic generated, exact past 2**24 (HF's mask building: diffs, comparisons)
    "affine": lambda p: p * 3 + 1,
    "affine_to_float": lambda p: (p * 3 - 1).float(),
    "mask_building": lambda p: (p - 1 != 1) & (p >= 0),
    "where_neg": lambda p: torch.where(p > 5, p, -p),
    "int32": lambda p: p.int() * 2 - 7,
    "cat": lambda p: torch.cat([p, p * 2], -1),
    "diff_ne_one": lambda p: (p[..., 1:] - p[..., :-1]) != 1,
    "fractional_comparison": lambda p: p < 2.5,
    "float_scalar_equality": lambda p: p == 16777216.0,  # torch compares in float32: 2**24 + 1 is equal
    "half_tensor_comparison": lambda p: torch.where((p < 4096) & (p > -4096), p + 2048, 0) >= torch.full(
        (4,), 2052.0, dtype=torch.float16, device=p.device),  # in float16, as torch promotes: 3 + 2048 -> 2052
    "int_scalar_equality": lambda p: (p == 16777217) | (p != 2**53 - 1),  # in int64: exact
    "bool_to_int": lambda p: (p > 0).long() + p,
    # sums and maxima in the integer type: exact where float accumulation would round (2**53 + 5)
    "sum_rows": lambda p: p.sum(-1),
    "sum_columns_keepdim": lambda p: p.sum(0, keepdim=True) - p,
    "amax_rows": lambda p: p.amax(-1),
    "count_true": lambda p: (p > 0).sum(-1),  # sequence lengths from a padding mask
    "int32_sum_widens": lambda p: p.int().sum(0),
}
BIG = torch.tensor([[2**40 + 1, -(2**35) - 3, 7, 0], [3, 2**24 + 1, -1, 2**53 + 5]])


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("name", sorted(INTEGER_ARITHMETIC))
def test_integer_arithmetic_is_generated_exactly(name, target):
    fn = INTEGER_ARITHMETIC[name]
    compiled = egc.compile(fn, [BIG], target=target)
    assert {k.kind for k in compiled.plan.kernels} == {"generated"}, compiled.plan.fallbacks
    got, want = compiled(BIG), fn(BIG)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("fn, reason", [(lambda p: torch.maximum(p, p.flip(-1)), "integer maximum"),
                                        (lambda p: torch.abs(p) + 1, "integer abs"),
                                        (lambda p: p != 2**53 + 5, "form the op table does not model")])
def test_integer_ops_outside_exact_codegen_run_through_aten(fn, reason):
    with warnings.catch_warnings():  # warned once per process: an earlier test may have seen it
        warnings.simplefilter("ignore")
        compiled = egc.compile(fn, [BIG])
    assert any(reason in f for f in compiled.plan.fallbacks), compiled.plan.fallbacks
    torch.testing.assert_close(compiled(BIG), fn(BIG), atol=0, rtol=0)


NARROW = {"uint8": (0, 256), "int8": (-128, 128), "int16": (-32768, 32768)}


@pytest.mark.parametrize("target", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_narrow_integer_inputs_cast_to_a_float_are_read_by_generated_code(dtype, target):
    """An image as bytes normalised inside the model (`x.float() / 255`, per-channel mean and
    std, a cast to bf16): uint8, int8 and int16 inputs are read by generated kernels through
    a cast to a float, on both targets (and compile for sm_90 on the Triton one)."""
    lo, hi = NARROW[dtype]
    image = torch.randint(lo, hi, (2, 3, 5, 7), generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    mean, std = torch.tensor([0.2, 0.5, 0.7]).view(3, 1, 1), torch.tensor([0.3, 0.25, 0.2]).view(3, 1, 1)
    programs = [lambda x: (x.float() / 255 - mean) / std,
                lambda x: (x.float() / 255).sum(-1),
                lambda x: x.to(torch.bfloat16) * 2,
                lambda x: F.layer_norm(x.float(), (7,)).relu()]
    for fn in programs:
        compiled = egc.compile(fn, [image], target=target)
        assert {k.kind for k in compiled.plan.kernels} == {"generated"}, compiled.plan.fallbacks
        got, want = compiled(image), fn(image)
        assert got.dtype == want.dtype
        if target == "triton" and want.dtype == torch.bfloat16:  # the interpreter truncates float32 -> bf16
            torch.testing.assert_close(got, want, atol=0, rtol=2 * torch.finfo(torch.bfloat16).eps)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # (int16's sums of +-128s: order)
        if target == "triton":
            from egraph_compiler.codegen.triton_build import compile_for_gpu
            compile_for_gpu([(compiled.source, compiled.loop_kernels)])


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_a_convnet_taking_uint8_images_has_no_fallback(target):
    """An outsider's model: uint8 pixels normalised by buffers of ImageNet's mean and std, then a
    convolution, batch norm, pooling and a classifier, through `torch.compile`: no ATen fallback."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
            self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                            torch.nn.Linear(8, 5))

        def forward(self, image):
            return self.body((image.float() / 255 - self.mean) / self.std).softmax(-1)
    torch.manual_seed(0)
    net = Net().eval()
    image = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(net, backend="egraph", options={"target": target})(image)
        torch.testing.assert_close(got, net(image))
    plan = egc.last_compiled()[-1].plan
    assert not plan.fallbacks and "aten" not in {k.kind for k in plan.kernels}, plan


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_narrow_integers_computed_on_run_through_aten_and_say_why(target):
    """Arithmetic on uint8 (which wraps at 256 in torch, and in C++ would be promoted to int
    first), or a cast of it to another integer, is not generated: ATen runs it, and the
    reason names the input's dtype."""
    image = torch.randint(0, 256, (3, 9), dtype=torch.uint8)
    for fn, reason in [(lambda x: x + 250, "dtype uint8 in"), (lambda x: x.long() * 3, "only as a cast to a float"),
                       (lambda x: x.bool(), "only as a cast to a float")]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = egc.compile(fn, [image], target=target)
        assert any(reason in f for f in compiled.plan.fallbacks), compiled.plan.fallbacks
        got, want = compiled(image), fn(image)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_bf16_stores_round_as_torch_bit_for_bit():
    """C++ writes a bf16 result as its bits (cpp._store, and a transposed kernel's tiles:
    cpp_across.tiled): rounded to nearest even as torch rounds, infinities, overflow to
    inf, signed zeros and denormals, along rows and across them; NaN stays NaN."""
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 3.4e38, -3.4e38, 1e-40,
                            1.00390625, 1.01171875, -1.00390625, 65504.0])  # (ties to even both ways)
    x = torch.randn(96, 80)
    x.view(-1)[:special.numel() * 40:40] = special
    for fn in (lambda x: x.to(torch.bfloat16), lambda x: (x * 3).to(torch.bfloat16),
               lambda x: x.t().to(torch.bfloat16), lambda x: torch.relu(x.t() * 2).to(torch.bfloat16)):
        got, want = egc.compile(fn, [x])(x), fn(x)
        nan = want.isnan()  # (a NaN's bits are its own: torch's vector path gives 0xffff here, ours 0x7fc0)
        assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_fp16_loads_and_stores_are_torch_conversions_bit_for_bit():
    """C++ reads and writes float16 as bits through F16C's vector conversions (cpp_prelude's
    egc_h2f / egc_f2h, declared SIMD functions: g++ 12 left every _Float16 loop scalar).  Every
    one of the 65,536 halves widens as torch widens it; floats round to nearest even as torch
    rounds them (ties both ways, overflow to inf, denormal halves, signed zeros), along rows and
    across them (a transposed kernel's tiles); a cast inside a kernel rounds once."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(256, 256)
    got, want = egc.compile(lambda h: h.float(), [halves])(halves), halves.float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
    ulp = 2.0 ** -10
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 65504.0, 65519.0, 65520.0, 1e6,
                            1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
                            2.0 ** -14 * (1 - ulp / 2), 6.0e-8, -6.0e-8, 1e-30])
    x = torch.randn(96, 80) * torch.logspace(-9, 5, 80)
    x.view(-1)[:special.numel() * 40:40] = special
    for fn in (lambda x: x.to(torch.float16), lambda x: (x * 3).to(torch.float16),
               lambda x: x.t().to(torch.float16), lambda x: torch.relu(x.t() * 2).to(torch.float16),
               lambda x: x.to(torch.float16).float() * 2):  # (rounded to half inside the kernel)
        got, want = egc.compile(fn, [x])(x), fn(x)
        nan = want.isnan()
        assert got.dtype == want.dtype and torch.equal(got.isnan(), nan)
        bits = torch.int16 if want.dtype == torch.float16 else torch.int32
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
