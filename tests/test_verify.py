"""Numerical verification of rules (dsl/verify.py) and `egc rules verify`."""
import pytest
from typer.testing import CliRunner

from egraph_compiler.cli import app
from egraph_compiler.dsl.library import library_dir, library_rules
from egraph_compiler.dsl.parser import parse_rules
from egraph_compiler.dsl.verify import verify_outside_domain, verify_rule, verify_rules


def rule(text):
    (r,) = parse_rules(text + "\n", "user.rules")
    return r


def test_every_library_rule_passes():
    results = verify_rules(library_rules())
    assert results and all(r.trials > 0 for r in results)
    failures = [r.line() for r in results if not r.passed]
    assert not failures, "library rules that fail verification:\n" + "\n".join(failures)


def test_wrong_rule_is_caught():
    result = verify_rule(rule("rule wrong: exp(add(x, y)) => add(exp(x), exp(y))"))
    assert not result.passed and result.trials > 0 and result.max_error > 1e-3
    assert result.name == "wrong" and result.location == "user.rules:1"
    assert "x=[" in result.message and "y=[" in result.message  # the worst inputs' shapes


@pytest.mark.parametrize("text, fragments", [
    ("rule bad: add(x, y) => mul(x, y)", ["lhs ", " vs rhs ", " where x=", ", y=", "max |lhs - rhs| ", "x: shape ["]),
    ("rule bad_dims: sum(x, [-1], true) => sum(x, [-2], true)", ["lhs and rhs shapes differ", "x: shape ["]),
    ("rule bad_attr: transpose(x, a, b) => x", ["shapes differ", ", a=", ", b="]),
    ("rule bad_nan: exp(log(x)) => x", ["lhs nan vs rhs ", "max |lhs - rhs| inf"]),
])
def test_failure_carries_a_counterexample(text, fragments):
    result = verify_rule(rule(text), trials=8)
    assert not result.passed
    for fragment in fragments:
        assert fragment in result.counterexample
    assert verify_rule(rule("rule fine: neg(neg(x)) => x"), trials=8).counterexample == ""


def test_unsafe_rule_passes_inside_its_domain_and_fails_outside():
    r = rule("unsafe rule exp_log: exp(log(x)) => x if x > 0")
    inside = verify_rule(r)
    assert inside.passed and inside.trials > 0, inside.line()
    assert not verify_outside_domain(r).passed


@pytest.mark.parametrize("text", [
    "unsafe rule sqrt_square: mul(sqrt(x), sqrt(x)) => x if x >= 0",
    "unsafe rule log_exp_bounded: log(exp(x)) => x if x > -80 and x < 80",
    "unsafe rule log_small: log(x) => log(x) if x > 0 and x < 1e-3",
])
def test_domain_values_meet_the_assumption(text):
    result = verify_rule(rule(text))
    assert result.passed and result.trials > 0, result.line()


def test_wrong_attribute_rule_is_caught():
    result = verify_rule(rule("rule bad_sum: sum(x, [-1], true) => sum(x, [-2], true)"))
    assert not result.passed and result.trials > 0


def test_attribute_conditions_are_respected():
    assert verify_rule(rule("rule last: sum(x, [d], true) => sum(x, [-1], true) if d == -1")).passed
    assert not verify_rule(rule("rule any_dim: sum(x, [d], true) => sum(x, [-1], true)")).passed
    assert verify_rule(rule("rule near: mul(x, const(k)) => mul(x, 0.5) if k > 0.4999999 and k < 0.5000001")).passed


def test_shape_conditions_and_library_ops():
    assoc = verify_rule(rule("rule assoc: matmul(matmul(a, b), c) => matmul(a, matmul(b, c)) "
                             "if rank(a) == 2 and rank(b) == 2 and rank(c) == 2"))
    assert assoc.passed and assoc.trials > 0, assoc.line()
    assert not verify_rule(rule("rule assoc_any: matmul(matmul(a, b), c) => matmul(a, matmul(b, c))")).passed
    assert not verify_rule(rule("rule uncausal: sdpa(q, k, v, s, c) => sdpa(q, k, v, s, false)")).passed
    lin = verify_rule(rule("rule lin: linear(x, w, b) => add(matmul(x, transpose(w, -2, -1)), b) "
                           "if rank(w) == 2 and rank(b) == 1"))
    assert lin.passed and lin.trials > 0, lin.line()


def test_constants_behave_like_python_scalars():
    assert verify_rule(rule("rule fold: mul(mul(x, const(a)), const(b)) => mul(x, const(a * b))")).passed
    assert verify_rule(rule("rule half: mul(x, 0.5) => div(x, 2)")).passed
    assert not verify_rule(rule("rule nudge: add(x, const(c)) => x if c > 0 and c < 1e-4")).passed


def test_both_directions_of_a_two_way_rule_are_checked():
    result = verify_rule(rule("rule bias: linear(x, w, b) <=> add(matmul(x, transpose(w, -2, -1)), b) "
                              "if rank(w) == 2 and rank(b) == 1"), trials=64)
    assert not result.passed and result.message.startswith("right to left")  # b broadcasts on the right only


def test_rule_never_well_formed_fails():
    result = verify_rule(rule("rule nope: reshape(x, [7]) => x"))
    assert not result.passed and result.trials == 0
    assert "no well-formed instance found" in result.message


def test_cli_exit_codes(tmp_path):
    wrong = tmp_path / "wrong.rules"
    wrong.write_text("rule wrong: exp(add(x, y)) => add(exp(x), exp(y))\nrule fine: neg(neg(x)) => x\n")
    runner = CliRunner()
    bad = runner.invoke(app, ["rules", "verify", str(wrong)])
    assert bad.exit_code == 1
    assert "FAIL  wrong" in bad.output and "PASS  fine" in bad.output and "1 passed, 1 failed" in bad.output
    good = runner.invoke(app, ["rules", "verify", "--trials", "8"])
    assert good.exit_code == 0, good.output
    assert str(library_dir()) in good.output
