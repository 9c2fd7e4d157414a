"""The rules language: parsing, checking, errors a user can act on, and rules
from the API changing the plan."""
import pytest
import torch

import egraph_compiler as egc
from egraph_compiler.dsl.library import check_unique, library_rules
from egraph_compiler.dsl.parser import parse_rules


def error_of(text):
    with pytest.raises(egc.RuleError) as info:
        check_unique(parse_rules(text, "user.rules"))
    return str(info.value)


def test_library_parses_with_named_commented_rules():
    rules = library_rules()
    names = {r.name for r in rules}
    assert {"mul_one", "add_zero", "transpose_transpose", "exp_log"} <= names
    assert {r.name for r in rules if r.unsafe} == {"exp_log", "log_exp", "attention_bool_mask"}


def test_rule_parts():
    (rule,) = parse_rules("rule r: sum(x, dims=[-1], keepdim=true) <=> sum(x, [-1], true)  # both ways\n")
    assert rule.both_ways and rule.lhs.op == "sum" and rule.group == "user"


def test_bindings_and_conditions():
    (rule,) = parse_rules("unsafe rule r: exp(log(e)) => e where e = add(x, 1) if x > 0\n")
    assert rule.unsafe and rule.lhs.args[0].args[0].op == "add"
    assert rule.conditions[0].is_assumption


@pytest.mark.parametrize("text, expected", [
    ("rule r: mul(x, => x\n", "user.rules:1:16: unexpected '=>'; expected"),
    ("rule r mul(x, 1) => x\n", "user.rules:1:8: unexpected 'mul'; expected"),
    ("rule r: frob(x) => x\n", "user.rules:1:9: unknown op 'frob'"),
    ("rule r: exp(x, y) => x\n", "user.rules:1:9: exp takes 1 tensor operand(s)"),
    ("rule r: mul(x, y) => z\n", "user.rules:1:22: variable 'z' is used on the right but not bound"),
    ("rule r: mul(x, y) => x if w > 0\n", "user.rules:1:27: condition on unknown variable 'w'"),
    ("rule r: mul(x, 1) => x\nrule r: add(x, 0) => x\n", "user.rules:2:6: duplicate rule name 'r'"),
    ("rule r: sum(x, 1.5, true) => x\n", "user.rules:1:16: expected ints, got the number 1.5"),
    ("rule r: transpose(x, a, b) => mul(a, x)\n", "variable 'a' is used as int and as tensor"),
    ("rule r: sum(x, [-1], true, axis=3) => x\n", "sum has no attribute 'axis'"),
    ("rule r: sum(x, [-1], false) => x\n",
     "user.rules:1:32: the two sides have different ranks: rank(x) - 1 on the left, rank(x) on the right"),
    ("rule r: gt(x, y) => mul(x, y)\n", "the left side gives a bool tensor but the right side a number tensor"),
    ("rule r: mul(x, y) => x if size(x, -1) < z\n", "condition on unknown variable 'z'"),
    ("fuse f: pointwise <- frobnicate\n", "'frobnicate' is neither an op nor a group"),
])
def test_errors_name_file_line_column_and_what_was_expected(text, expected):
    message = error_of(text)
    assert expected in message
    assert "^" in message  # a caret line under the source


def test_user_rule_changes_the_plan():
    def twice_relu(x):
        return torch.relu(torch.relu(x))
    x = torch.randn(8, 8)
    plain = egc.compile(twice_relu, [x])
    assert plain.plan.count("relu") == 2
    ruled = egc.compile(twice_relu, [x], rules=["rule relu_idempotent: relu(relu(x)) => relu(x)\n"])
    assert ruled.plan.count("relu") == 1 and ruled.plan.rules_fired["relu_idempotent"] >= 1
    torch.testing.assert_close(ruled(x), twice_relu(x))


@pytest.mark.parametrize("dim", [0, 1, -2, -1])
def test_a_size_condition_holds_by_either_index(dim):
    x = torch.randn(3, 5)
    size = x.shape[dim]
    rule = f"rule relu_idempotent_sized: relu(relu(x)) => relu(x) if size(x, {dim}) == {size}\n"
    ruled = egc.compile(lambda x: torch.relu(torch.relu(x)), [x], rules=[rule])
    assert ruled.plan.count("relu") == 1 and ruled.plan.rules_fired["relu_idempotent_sized"] >= 1
    other = f"rule relu_idempotent_sized: relu(relu(x)) => relu(x) if size(x, {dim}) == {size + 1}\n"
    assert egc.compile(lambda x: torch.relu(torch.relu(x)), [x], rules=[other]).plan.count("relu") == 2


def test_user_rule_file_by_path(tmp_path):
    path = tmp_path / "mine.rules"
    path.write_text("rule neg_sub: neg(sub(a, b)) => sub(b, a)   # -(a - b) = b - a\n")
    f = lambda a, b: -(a - b)  # noqa: E731
    a, b = torch.randn(4), torch.randn(4)
    compiled = egc.compile(f, [a, b], rules=[path])
    assert compiled.plan.count("neg") == 0
    torch.testing.assert_close(compiled(a, b), f(a, b))


def test_disable_by_rule_and_group():
    f = lambda x: x * 1.0  # noqa: E731
    x = torch.randn(4, 4)
    assert egc.compile(f, [x]).plan.count("mul") == 0
    assert egc.compile(f, [x], disable=["mul_one", "mul_one_left"]).plan.count("mul") == 1
    assert egc.compile(f, [x], disable=["algebra"]).plan.count("mul") == 1


def test_a_misspelt_name_to_disable_or_allow_is_an_error_naming_the_likely_one(tmp_path):
    """Left alone, a misspelt `disable` switches nothing off and the plan is silently the same."""
    x = torch.randn(4, 4)
    with pytest.raises(egc.OptionError, match=r"disable='mul_onee'.*did you mean 'mul_one'"):
        egc.compile(lambda x: x * 1.0, [x], disable=["mul_onee"])
    with pytest.raises(egc.OptionError, match=r"unsafe='nothing_like_it' names no rule"):
        egc.compile(lambda x: x * 1.0, [x], unsafe=["nothing_like_it"])
    mine = tmp_path / "mine.rules"  # a user's own rule and group can be named
    mine.write_text("rule neg_sub: neg(sub(a, b)) => sub(b, a)\n")
    assert egc.compile(lambda a, b: -(a - b), [x, x], rules=[mine], disable=["neg_sub"]).plan.count("neg") == 1
    with pytest.raises(Exception, match="has no option 'disabel'; did you mean 'disable'"):  # (in Dynamo's wrapper)
        torch._dynamo.reset()
        torch.compile(lambda x: x * 1.0, backend="egraph", options={"disabel": ["mul_one"]})(x)


def test_a_rules_path_that_is_not_there_is_named():
    x = torch.randn(4)
    with pytest.raises(egc.RuleError, match=r"^/no/such/dir/mine\.rules: no rules file here"):
        egc.compile(lambda x: x + 0, [x], rules=["/no/such/dir/mine.rules"])


def test_unsafe_by_name():
    f = lambda x: torch.exp(torch.log(x))  # noqa: E731
    x = torch.rand(4, 4) + 0.5
    assert egc.compile(f, [x]).plan.count("exp") == 1
    assert egc.compile(f, [x], unsafe=["exp_log"]).plan.count("exp") == 0


def test_bad_user_rule_text_through_the_api():
    with pytest.raises(egc.RuleError, match=r"<rules 0>:1:\d+"):
        egc.compile(torch.relu, [torch.randn(2)], rules=["rule oops: relu(x => x\n"])


def test_schedule_phases_from_user_rules():
    f = lambda x: torch.relu(torch.relu(torch.relu(x)))  # noqa: E731
    x = torch.randn(4, 4)
    text = ("phase mine: user iterations 1\n"
            "rule relu_twice: relu(relu(x)) => relu(x)\n")
    compiled = egc.compile(f, [x], rules=[text])
    phases = [p[0] for p in compiled.report.phases]
    assert phases[0].startswith("algebra") and "mine" not in phases[0]
    assert any(p == "user" for p in phases), phases
    mine = next(p for p in compiled.report.phases if p[0] == "user")
    assert mine[1] == "phase iteration limit" and mine[2] == 1
    torch.testing.assert_close(compiled(x), f(x))


def test_library_schedule_runs_rewrites_before_fusion():
    fn = lambda x: torch.exp(x) * 1.0  # noqa: E731
    report = egc.compile(fn, [torch.randn(4, 4)]).report
    groups = [p[0] for p in report.phases]
    assert "fusion" in groups[-1] and "algebra" in groups[0]


@pytest.mark.parametrize("op, exact_mean, rule", [("softmax", True, "softmax_def"), ("log_softmax", False, "log_softmax_def"),
                                                  ("rms_norm", False, "rms_norm_def"),
                                                  ("layer_norm", True, "layer_norm_def"),
                                                  ("layer_norm", False, "layer_norm_centred")])
def test_row_composites_lower_from_their_definition_rules(op, exact_mean, rule):
    """The lowering has no second copy of the math: a row composite's expansion is its
    rule's right-hand side (the same ops, as many of each), on every target."""
    from collections import Counter

    from egraph_compiler import graph as G
    from egraph_compiler.dsl.terms import Pat
    from egraph_compiler.dsl.library import library_rule
    from egraph_compiler.rows import expand_row
    x = G.input_node("x", (4, 8), "float32")
    w, b = G.input_node("w", (8,), "float32"), G.input_node("b", (8,), "float32")
    args = {"softmax": ((x,), {"dim": -1}), "log_softmax": ((x,), {"dim": -1}),
            "rms_norm": ((x, w), {"ndim": 1, "eps": 1e-5}), "layer_norm": ((x, w, b), {"ndim": 1, "eps": 1e-5})}[op]
    node = G.Node.make(op, *args)

    def pattern_ops(term, seen):
        if isinstance(term, Pat) and term.op != "const" and term not in seen:
            seen.add(term)
            yield term.op
            for a in term.args:
                yield from pattern_ops(a, seen)
    want = Counter(pattern_ops(library_rule(rule).rhs, set()))
    got = Counter(n.op for n in G.computed_nodes(expand_row(node, exact_mean)) if n.op not in ("inline", "const"))
    assert got == want


def test_lowering_definitions_never_run_in_saturation():
    compiled = egc.compile(lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b),
                           [torch.randn(4, 8), torch.randn(8), torch.randn(8)], target="triton")
    assert "layer_norm_centred" not in compiled.plan.rules_fired and "layer_norm_centred" not in compiled.levels.egraph
