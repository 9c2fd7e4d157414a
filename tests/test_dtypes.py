"""Result dtypes follow torch's type promotion: every pointwise and reduction
op of the table, on every dtype pair (and Python scalars), against torch
itself; then a sample of whole programs per dtype, compiled and run."""
import itertools
import warnings

import pytest
import torch

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
