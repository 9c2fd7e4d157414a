"""The rules DSL: text -> checked Rule objects (no egglog here).

Parsing is lark's (grammar in rules.lark); this module turns the parse tree
into Rule objects and checks them against the op table: known ops, arity,
attribute kinds, variables bound on the left, conditions on known variables,
unique names.  Every error names file:line:column and shows a caret line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import lark

from .. import ops
from ..errors import RuleError
from .terms import DTYPE_NAMES, Arith, Condition, Lit, Pat, Query, Var
from .typecheck import side_mismatch


@dataclass
class Rule:
    name: str
    group: str
    lhs: Pat
    rhs: object
    both_ways: bool
    unsafe: bool
    conditions: list[Condition] = field(default_factory=list)
    path: str = "<rules>"
    line: int = 0
    text: str = ""  # the source line, for messages

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    def variables(self) -> dict[str, str]:
        return collect_vars(self.lhs)


FUSE_CONDITIONS = {"same_domain": "the producer is a keepdim reduction over the consumer's index space"}


@dataclass
class Phase:
    """`phase NAME: GROUP, ... [iterations N]`: groups that run together, in
    file order, each phase until nothing changes or its iteration limit."""
    name: str
    groups: tuple[str, ...]
    iterations: int | None = None
    path: str = "<rules>"
    line: int = 0


@dataclass
class FuseRule:
    """`fuse NAME: CONSUMERS <- PRODUCERS`: each consumer op may compute a
    producer operand inside its own kernel instead of reading it from memory."""
    name: str
    group: str
    consumers: tuple[str, ...]  # op names
    producers: tuple[str, ...]
    conditions: tuple[str, ...] = ()
    path: str = "<rules>"
    line: int = 0
    text: str = ""
    unsafe: bool = False
    horizontal: bool = False  # `A & B`: sibling kernels share a loop nest (decided after extraction)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"


def collect_vars(term, out=None) -> dict[str, str]:
    out = {} if out is None else out
    if isinstance(term, Var):
        out[term.name] = term.sort
    elif isinstance(term, Pat):
        for a in term.args:
            collect_vars(a, out)
    elif isinstance(term, tuple):
        for a in term:
            collect_vars(a, out)
    elif isinstance(term, Arith):
        collect_vars(term.left, out)
        collect_vars(term.right, out)
    return out


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = (Path(__file__).parent / "rules.lark").read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False)


_TOKEN_NAMES = {"_NL": "end of line", "NAME": "a name", "NUMBER": "a number", "LPAR": "'('", "RPAR": "')'",
                "COMMA": "','", "COLON": "':'", "ARROW": "'=>' or '<=>'", "LSQB": "'['", "RSQB": "']'",
                "EQUAL": "'='", "RULE": "'rule'", "GROUP": "'group'", "UNSAFE": "'unsafe'", "IF": "'if'",
                "WHERE": "'where'", "COMPARE": "a comparison", "$END": "end of file", "BOOL": "true/false",
                "STRING": "a string"}


def parse_rules(text: str, path: str = "<rules>", group: str | None = None) -> list[Rule]:
    """Parse and check one rules file; its default group is the file's stem."""
    group = group or (Path(path).stem if path != "<rules>" else "user")
    # lark counts lines by "\n" only; splitlines() would also break at \f, \v, \u2028, ... and show the wrong line
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    try:
        tree = _parser().parse(text if text.endswith("\n") else text + "\n")
    except lark.exceptions.UnexpectedInput as exc:
        line, column = getattr(exc, "line", 0), getattr(exc, "column", 0)
        expected = sorted(_TOKEN_NAMES.get(t, t) for t in (getattr(exc, "expected", None) or []))
        found = getattr(getattr(exc, "token", None), "value", None)
        if found is None and hasattr(exc, "char"):
            found = exc.char
        what = f"unexpected {found!r}" if found not in (None, "") else "unexpected input"
        hint = f"; expected {', '.join(expected[:8])}" if expected else ""
        raise RuleError(what + hint, path, line, column, _line(lines, line)) from None
    return _Checker(path, group, lines).statements(tree)


def parse_file(path) -> list[Rule]:
    path = Path(path)
    return parse_rules(path.read_text(), str(path))


MAX_DEPTH = 100  # nesting of one statement's terms; the checker, typecheck and verifier recurse over them


class _Checker:
    def __init__(self, path, group, lines):
        self.path, self.group, self.lines = path, group, lines
        self.group_unsafe = False
        self.expanding: list[str] = []  # `where` bindings being substituted, innermost last

    def error(self, message, meta):
        line, column = getattr(meta, "line", 0), getattr(meta, "column", 0)
        raise RuleError(message, self.path, line, column, _line(self.lines, line))

    def statements(self, tree) -> list[Rule]:
        rules: list[Rule] = []
        for stmt in tree.children:
            if _depth(stmt) > MAX_DEPTH:
                self.error(f"this statement nests more than {MAX_DEPTH} terms deep", stmt.meta)
            if stmt.data == "group_decl":
                name, *flags = stmt.children
                self.group, self.group_unsafe = str(name), any(str(f.children[0]) == "unsafe" for f in flags)
            elif stmt.data == "fuse_decl":
                rules.append(self.fuse(stmt))
            elif stmt.data == "phase_decl":
                name, *groups = stmt.children
                limit = None
                if groups and isinstance(groups[-1], lark.Token) and groups[-1].type == "INT":
                    limit = int(groups.pop())
                rules.append(Phase(str(name), tuple(str(g) for g in groups), limit, self.path, stmt.meta.line))
            else:
                rules.append(self.rule(stmt))
        return rules

    def fuse(self, node) -> FuseRule:
        name, consumers, kind, producers, *rest = node.children
        conditions = tuple(str(c) for c in rest[0].children) if rest else ()
        for cond, tok in zip(conditions, rest[0].children if rest else ()):
            if cond not in FUSE_CONDITIONS:
                self.error(f"unknown fusion condition {cond!r}; known: {', '.join(FUSE_CONDITIONS)}", tok)
        if str(kind) == "&" and conditions:
            self.error("horizontal fusion takes no condition", node.meta)
        return FuseRule(str(name), self.group, self._op_set(consumers), self._op_set(producers), conditions,
                        self.path, node.meta.line, _line(self.lines, node.meta.line), horizontal=str(kind) == "&")

    def _op_set(self, tree) -> tuple[str, ...]:
        out: list[str] = []
        groups = {d.group for d in ops.OPS.values()}
        for tok in tree.children:
            name = str(tok)
            if name in groups:
                out += [n for n, d in ops.OPS.items() if d.group == name]
            elif name in ops.OPS:
                out.append(name)
            else:
                self.error(f"{name!r} is neither an op nor a group (groups: {', '.join(sorted(groups))})", tok)
        return tuple(dict.fromkeys(out))

    def rule(self, node) -> Rule:
        kids = list(node.children)
        flags = [k for k in kids if isinstance(k, lark.Tree) and k.data == "flag"]
        kids = kids[len(flags):]
        name, lhs_tree, arrow, rhs_tree, *rest = kids
        bindings = {}
        conditions_tree = None
        for extra in rest:
            if extra.data == "bindings":
                for b in extra.children:
                    bindings[str(b.children[0])] = b.children[1]
            else:
                conditions_tree = extra
        sorts: dict[str, str] = {}
        lhs = self.term(lhs_tree, "tensor", sorts, bindings, bind=True)
        if not isinstance(lhs, Pat):
            self.error("the left-hand side must be an op call, not a bare variable or constant", lhs_tree.meta)
        both = str(arrow) == "<=>"
        rhs = self.term(rhs_tree, "tensor", sorts, bindings, bind=False)
        if both and not isinstance(rhs, Pat):
            self.error("a '<=>' rule needs an op call on both sides", rhs_tree.meta)
        if both:
            for var in collect_vars(lhs):
                if var not in collect_vars(rhs):
                    self.error(f"variable {var!r} is bound on the left but not used on the right; "
                               "'<=>' needs both sides to use the same variables", lhs_tree.meta)
        mismatch = side_mismatch(lhs, rhs)
        if mismatch:
            self.error(mismatch, rhs_tree.meta)
        conditions = self.conditions(conditions_tree, sorts) if conditions_tree is not None else []
        unsafe = self.group_unsafe or bool(flags)
        return Rule(str(name), self.group, lhs, rhs, both, unsafe, conditions, self.path, node.meta.line,
                    _line(self.lines, node.meta.line))

    def term(self, tree, sort, sorts, bindings, bind):
        kind = tree.data
        if kind == "var":
            name = str(tree.children[0])
            if name in bindings:
                if name in self.expanding:
                    cycle = " -> ".join(self.expanding[self.expanding.index(name):] + [name])
                    self.error(f"binding {name!r} refers to itself ({cycle})", tree.meta)
                self.expanding.append(name)
                value = self.term(bindings[name], sort, sorts, bindings, bind)
                self.expanding.pop()
                return value
            if name not in sorts:
                if not bind:
                    self.error(f"variable {name!r} is used on the right but not bound on the left-hand side",
                               tree.meta)
                sorts[name] = sort
            elif sorts[name] != sort:
                self.error(f"variable {name!r} is used as {sorts[name]} and as {sort}", tree.meta)
            return Var(name, sort)
        if kind == "number":
            return Lit(self.number(tree, sort), sort)
        if kind == "boolean":
            if sort != "bool":
                self.error(f"expected {sort}, got a boolean", tree.meta)
            return Lit(str(tree.children[0]) == "true", "bool")
        if kind == "string":
            if sort != "str":
                self.error(f"expected {sort}, got a string", tree.meta)
            return Lit(str(tree.children[0])[1:-1], "str")
        if kind == "list":
            if sort != "ints":
                self.error(f"expected {sort}, got a list", tree.meta)
            items = tuple(self.term(c, "int", sorts, bindings, bind) for c in tree.children if c is not None)
            return Lit(tuple(i.value for i in items), "ints") if all(isinstance(i, Lit) for i in items) else items
        if kind == "call":
            return self.call(tree, sort, sorts, bindings, bind)
        if kind == "arith":
            return self.arith(tree, sort, sorts, bindings, bind)
        self.error(f"unexpected {kind}", tree.meta)

    def arith(self, tree, sort, sorts, bindings, bind):
        if bind:
            self.error("arithmetic is computed on the right-hand side only; bind values with const(c)", tree.meta)
        if sort == "tensor":  # a computed scalar constant
            return Pat("const", (self.arith(tree, "float", sorts, bindings, bind),))
        if sort not in ("int", "float"):
            self.error(f"expected {sort}, got arithmetic", tree.meta)
        left, op, right = tree.children
        return Arith(str(op), self.term(left, sort, sorts, bindings, bind), self.term(right, sort, sorts, bindings,
                                                                                      bind), sort)

    def number(self, tree, sort):
        text = str(tree.children[0])
        if sort in ("int",):
            if not text.lstrip("-").isdigit():
                self.error(f"expected an integer, got {text}", tree.meta)
            return int(text)
        if sort not in ("tensor", "float"):
            self.error(f"expected {sort}, got the number {text}", tree.meta)
        return -math.inf if text == "-inf" else float(text)

    def call(self, tree, sort, sorts, bindings, bind):
        name_tok, *args = tree.children
        args = [a for a in args if a is not None]
        op = str(name_tok)
        if op not in ops.OPS or op in ("input", "extern", "inline"):
            known = ", ".join(sorted(n for n in ops.OPS if n not in ("input", "extern", "const", "inline")))
            self.error(f"unknown op {op!r}; known ops: {known}", tree.meta)
        if sort != "tensor":
            self.error(f"expected {sort}, got a call of {op}", tree.meta)
        opdef = ops.OPS[op]
        positional = [a for a in args if a.data != "keyword"]
        keywords = {}
        for a in (a for a in args if a.data == "keyword"):
            if str(a.children[0]) in keywords:
                self.error(f"attribute {str(a.children[0])!r} is given twice", a.meta)
            keywords[str(a.children[0])] = a
        slots = ["tensor"] * opdef.arity + [kind for _, kind in opdef.attrs]
        names = [f"operand {i + 1}" for i in range(opdef.arity)] + list(opdef.attr_names())
        if len(positional) > len(slots) or len(positional) < opdef.arity:
            self.error(f"{op} takes {opdef.arity} tensor operand(s) and attributes "
                       f"({', '.join(opdef.attr_names()) or 'none'}), got {len(positional)} positional argument(s)",
                       tree.meta)
        filled: list = [None] * len(slots)
        for i, a in enumerate(positional):
            filled[i] = a
        for key, a in keywords.items():
            if key not in names[opdef.arity:]:
                self.error(f"{op} has no attribute {key!r} (attributes: {', '.join(opdef.attr_names()) or 'none'})",
                           a.meta)
            if filled[names.index(key)] is not None:
                self.error(f"attribute {key!r} is given both by position and by name", a.meta)
            filled[names.index(key)] = a.children[1]
        missing = [names[i] for i, a in enumerate(filled) if a is None]
        if missing:
            self.error(f"{op} is missing {', '.join(missing)}", tree.meta)
        return Pat(op, tuple(self.term(a, s, sorts, bindings, bind) for a, s in zip(filled, slots)))

    def conditions(self, tree, sorts) -> list[Condition]:
        out = []
        for comp in tree.children:
            left = self._cond_operand(comp.children[0], sorts)
            if comp.data == "membership":
                right = tuple(self._cond_value(t, left, sorts) for t in comp.children[1:])
                out.append(Condition(left, "in", right))
            else:
                right = self._cond_value(comp.children[2], left, sorts)
                out.append(Condition(left, str(comp.children[1]), (right,)))
        return out

    def _cond_operand(self, tree, sorts):
        if tree.data == "call" and str(tree.children[0]) in ("size", "rank", "dtype"):
            kind, args = str(tree.children[0]), [a for a in tree.children[1:] if a is not None]
            if len(args) != (2 if kind == "size" else 1) or args[0].data != "var" or \
                    (kind == "size" and args[1].data != "number"):
                self.error(f"write {kind}(x{', dim' if kind == 'size' else ''}) with a tensor variable x", tree.meta)
            var = self._cond_operand(args[0], sorts)
            if var.sort != "tensor":
                self.error(f"{kind}() takes a tensor variable; {var.name!r} is {var.sort}", tree.meta)
            dim = self.number(args[1], "int") if kind == "size" else 0
            return Query(kind, var, dim)
        if tree.data != "var":
            self.error("a condition starts with a variable, size(x, d), rank(x) or dtype(x)", tree.meta)
        name = str(tree.children[0])
        if name not in sorts:
            self.error(f"condition on unknown variable {name!r}", tree.meta)
        return Var(name, sorts[name])

    def _cond_value(self, tree, left, sorts):
        sort = "float" if left.sort == "tensor" else left.sort
        if isinstance(left, Query) and left.kind == "dtype":
            name = str(tree.children[0]) if tree.data in ("var", "string") else ""
            name = name.strip('"')
            if name not in DTYPE_NAMES:
                self.error(f"expected a dtype name ({', '.join(sorted(DTYPE_NAMES))})", tree.meta)
            return Lit(DTYPE_NAMES[name], "str")
        if tree.data in ("var", "call"):
            var = self._cond_operand(tree, sorts)
            if var.sort != sort:
                what = var.name if isinstance(var, Var) else f"{var.kind}({var.var.name})"
                self.error(f"cannot compare {sort} with {what!r} ({var.sort})", tree.meta)
            return var
        if tree.data == "number":
            return Lit(self.number(tree, sort), sort)
        if tree.data == "arith" and sort in ("int", "float"):  # size(q, -3) == size(k, -3) * g
            a, op, b = tree.children
            return Arith(str(op), self._cond_value(a, left, sorts), self._cond_value(b, left, sorts), sort)
        if tree.data == "boolean":
            return Lit(str(tree.children[0]) == "true", "bool")
        if tree.data == "string":
            return Lit(str(tree.children[0])[1:-1], "str")
        self.error("a condition compares with a constant, a variable or arithmetic on them", tree.meta)


def _line(lines, n):
    return lines[n - 1] if 0 < n <= len(lines) else ""


def _depth(tree) -> int:
    """How deeply a parse tree nests, walked without recursion (the tree may be deeper than Python's stack)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack += [(c, depth + 1) for c in getattr(node, "children", ()) if isinstance(c, lark.Tree)]
    return deepest
