"""Fuzzing the rules parser: whatever the text, parse_rules returns or raises a
RuleError that points at a position (line >= 1, column >= 1), never any other
exception.  Random text mostly stops in the lexer, so real rule lines from the
library are also mutated (characters deleted, inserted, replaced) to reach the
checker behind it."""
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egraph_compiler.dsl.library import library_dir
from egraph_compiler.dsl.parser import parse_rules
from egraph_compiler.errors import RuleError

LINES = [line for path in sorted(Path(library_dir()).glob("*.rules"))
         for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
# characters the grammar gives meaning to, so insertions make near-misses rather than lexer errors
ALPHABET = st.sampled_from(list("()[],:=<>!+-*/&|#.\"\\ \n\t_01x") + ["rule ", "if ", " and ", "where ", "=>",
                                                                      "<=>", "in (", "size(x, ", "true", "-inf"])
FUZZ = settings(max_examples=300, deadline=None)

# well-formed-looking rules built from the grammar's pieces, to get past the
# parser into the checker: any op, variable, literal, keyword, arithmetic,
# binding and condition, in any combination
OPS = st.sampled_from(["exp", "add", "mul", "where", "sum", "transpose", "reshape", "const", "size", "rank",
                       "dtype", "sdpa", "layer_norm", "input", "extern", "inline", "frob"])
LEAVES = st.sampled_from(["x", "y", "a", "e", "c", "k", "size(x, -1)", "rank(y)", "dtype(m)", "1", "-1", "0.5", "-inf", "1e400", "99999999999999999999", "[]",
                          "[-1]", "[0, a]", "true", '"f32"', "f16"])


def _calls(args):
    keyword = st.tuples(st.sampled_from(["dims", "keepdim", "shape", "value", "x"]), args).map("=".join)
    listed = st.lists(args | keyword, max_size=4).map(", ".join)
    return (st.tuples(OPS, listed).map(lambda t: f"{t[0]}({t[1]})")
            | st.tuples(args, st.sampled_from([" + ", " - ", " * ", " / "]), args).map("".join)
            | args.map(lambda t: f"({t})") | st.lists(args, max_size=3).map(lambda t: f"[{', '.join(t)}]"))


TERMS = st.recursive(LEAVES, _calls, max_leaves=12)
# left sides that check, so the right side, bindings and conditions get checked too
LEFT = st.sampled_from(["add(x, y)", "sum(x, dims, k)", "transpose(x, a, b)", "exp(e)", "mul(x, const(c))",
                        "reshape(x, [a, -1])", "where(m, x, y)"]) | TERMS
COMPARISON = (st.tuples(TERMS, st.sampled_from([" < ", " >= ", " == ", " != "]), TERMS).map("".join)
              | st.tuples(TERMS, st.lists(TERMS, min_size=1, max_size=3)).map(
                  lambda t: f"{t[0]} in ({', '.join(t[1])})"))
BINDINGS = st.lists(st.tuples(st.sampled_from(["e", "a", "x"]), TERMS).map(" = ".join), min_size=1, max_size=2)


@st.composite
def structured(draw):
    text = f"{draw(st.sampled_from(['', 'unsafe ']))}rule r: {draw(LEFT)} {draw(st.sampled_from(['=>', '<=>']))}"
    text += " " + draw(TERMS)
    if draw(st.booleans()):
        text += " where " + ", ".join(draw(BINDINGS))
    if draw(st.booleans()):
        text += " if " + " and ".join(draw(st.lists(COMPARISON, min_size=1, max_size=2)))
    return text


def parses_or_points(text):
    try:
        parse_rules(text, "<fuzz>")
    except RuleError as exc:
        assert exc.line >= 1 and exc.column >= 1, (str(exc), text)
        assert str(exc).startswith(f"<fuzz>:{exc.line}:{exc.column}: ")
        lines = text.split("\n")
        if exc.line <= len(lines) and lines[exc.line - 1].strip():  # the caret block shows the line lark means
            assert f"\n    {lines[exc.line - 1].removesuffix(chr(13))}\n" in str(exc), (str(exc), text)


@st.composite
def mutated(draw):
    """One to three library lines joined, then up to four character edits."""
    chars = list("\n".join(draw(st.lists(st.sampled_from(LINES), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(chars)))
        edit = draw(st.sampled_from(["delete", "insert", "replace"]))
        if edit != "insert" and where < len(chars):
            del chars[where]
        if edit != "delete":
            chars.insert(where, draw(ALPHABET | st.characters()))
    return "".join(chars)


@FUZZ
@given(st.text())
@example("# \x0c\nrule r: =>")  # a form feed: splitlines() would count it as a line, lark does not
def test_arbitrary_text(text):
    parses_or_points(text)


@FUZZ
@given(mutated())
def test_mutated_library_lines(text):
    parses_or_points(text)


@FUZZ
@given(structured())
def test_structured_rules(text):
    parses_or_points(text)


@FUZZ
@given(st.lists(ALPHABET, max_size=40).map("".join))
def test_grammar_fragments(text):
    parses_or_points("rule r: " + text)


@pytest.mark.parametrize("text, message", [
    # found by the fuzzer: an AttributeError while building the message
    ("rule r: mul(x, y) => x if x > y", "cannot compare float with 'y' (tensor)"),
    ("rule r: exp(e) => e where e = e", "binding 'e' refers to itself (e -> e)"),  # RecursionError
    ("rule r: exp(a) => a where a = b, b = exp(a)", "binding 'a' refers to itself (a -> b -> a)"),
    # found while reading the checker for what the fuzzer could reach
    ("rule r: mul(x, y) => x if size(x, []) == 2", "write size(x, dim)"),  # IndexError
    ("rule r: exp(x) => " + "neg(" * 2000 + "x" + ")" * 2000, "nests more than 100 terms deep"),  # RecursionError
    ("rule r: exp(x) => x" + " + 1" * 3000, "nests more than 100 terms deep"),
    ("# \x0c\nrule r: frob(x) => x", "\n    rule r: frob(x) => x\n"),  # wrong line
    ("rule r: sum(x, [-1], true, dims=[0]) => x", "attribute 'dims' is given both by position and by name"),
    ("rule r: sum(x, keepdim=true, dims=[0], dims=[1]) => x", "attribute 'dims' is given twice"),
])
def test_found_by_the_fuzzer(text, message):
    with pytest.raises(RuleError) as info:
        parse_rules(text, "<fuzz>")
    assert message in str(info.value)
    parses_or_points(text)
