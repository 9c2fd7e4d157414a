"""Encode: Graph IR and DSL rules -> egglog text.

One egglog constructor per op-table entry (`layer_norm` -> `LayerNorm`), with
tensor operands first and attributes after, in op-table order.  Attribute
sorts: int -> i64, float -> f64, bool -> bool, str -> String, ints -> an `Ints`
cons list.  Graph outputs are bound to `$out<i>_` so extraction finds its roots.
Rules compile to `rewrite` commands, one ruleset per group.
"""
from __future__ import annotations

import json
import math

from .. import ops
from ..dsl.parser import Arith, Condition, FuseRule, Lit, Pat, Query, Var
from ..graph import Graph, Node, topo_order

SORTS = {"int": "i64", "float": "f64", "bool": "bool", "str": "String", "ints": "Ints"}


def ctor(op: str) -> str:
    return "".join(part.capitalize() for part in op.split("_"))


OP_OF_CTOR = {ctor(name): name for name in ops.OPS}


def declarations() -> str:
    lines = ["(datatype Ints (INil) (ICons i64 Ints))", "(sort T)"]
    for opdef in ops.OPS.values():
        if opdef.name == "extern":
            continue
        sorts = ["T"] * opdef.arity + [SORTS[kind] for _, kind in opdef.attrs]
        lines.append(f"(constructor {ctor(opdef.name)} ({' '.join(sorts)}) T)")
    lines.append("(datatype TList (TNil) (TCons T TList))")
    lines.append("(constructor Extern (String TList) T)")
    return "\n".join(lines + _typing_declarations())


TYPING = "typing"  # the ruleset that types e-classes (run by facts.py between iterations)


def sig(op: str) -> str:
    """The constructor of an op's typing signature (lowercase: not an e-node for `size`)."""
    return "sig-" + op.replace("_", "-")


OP_OF_SIG = {sig(name): name for name in ops.OPS}


def _typing_declarations() -> list[str]:
    """Per-class facts live in egglog.  `ty` gives a typed e-class a type id,
    and a type id's facts (`ty-rank`, `ty-dim`, `ty-dtype`, `ty-shape`) are set
    once per distinct type.  An e-node whose operands are typed `ask`s for the
    type of its signature (op, operand type ids, attributes); facts.py answers
    each distinct signature once (`res`) with the op table's shape rule, and a
    rule carries the answer to every e-node with that signature.  Typing new
    e-nodes is so egglog's incremental work, in proportion to what changed."""
    lines = ["(sort Sig)", "(relation ask (Sig))", "(function res (Sig) i64 :merge old)",
             "(function ty (T) i64 :merge old)", "(function ty-rank (i64) i64 :merge old)",
             "(function ty-dim (i64 i64) i64 :merge old)", "(function ty-dtype (i64) String :merge old)",
             "(function ty-shape (i64) String :merge old)", f"(ruleset {TYPING})"]
    for opdef in ops.OPS.values():
        if opdef.name == "extern":  # typed by its call alone
            sorts, query, key = ["String"], "(= e (Extern x0 l))", ["x0"]
        else:
            operands = [f"a{i}" for i in range(opdef.arity)]
            attrs = [f"x{i}" for i in range(len(opdef.attrs))]
            sorts = ["i64"] * opdef.arity + [SORTS[kind] for _, kind in opdef.attrs]
            query = " ".join([f"(= e ({ctor(opdef.name)}{''.join(' ' + v for v in operands + attrs)}))"]
                             + [f"(= t{i} (ty {a}))" for i, a in enumerate(operands)])
            key = [f"t{i}" for i in range(opdef.arity)] + attrs
        signature = f"({sig(opdef.name)}{''.join(' ' + k for k in key)})"
        lines.append(f"(constructor {sig(opdef.name)} ({' '.join(sorts)}) Sig)")
        lines.append(f"(rule ({query}) ((ask {signature})) :ruleset {TYPING} "
                     f":name {json.dumps(HIDDEN + 'ask/' + opdef.name)})")
        lines.append(f"(rule ({query} (= t (res {signature}))) ((set (ty e) t)) :ruleset {TYPING} "
                     f":name {json.dumps(HIDDEN + 'ty/' + opdef.name)})")
    return lines


def literal(value, kind: str) -> str:
    if kind == "ints":
        out = "(INil)"
        for v in reversed(tuple(value)):
            out = f"(ICons {int(v)} {out})"
        return out
    if kind == "int":
        return str(int(value))
    if kind == "bool":
        return "true" if value else "false"
    if kind == "str":
        return json.dumps(str(value))
    value = float(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if math.isnan(value):
        raise ValueError("NaN constants cannot be encoded")
    text = repr(value)
    return text if ("." in text or "e" in text) else text + ".0"


def node_names(graph: Graph) -> dict[int, str]:
    """Node id -> its egglog global, `$nK_` in topological order.

    The trailing `_` matters: egglog 13.2 renames each use of a global to its
    name followed by a per-name use counter, so the eleventh use of `$n37`
    (counter 10) and the first of `$n371` (counter 0) were one variable, and
    `(let $n372 (Mul $n371 $n37))` silently built `Mul($n37, $n37)` (a wrong
    answer on an 8-layer LLaMA; fixed upstream in egglog's "Fix collisions").
    No name here ends in a digit, so a name and a counter never spell another's."""
    return {id(node): f"$n{k}_" for k, node in enumerate(topo_order(graph.outputs))}


def output_name(i: int) -> str:
    """The global bound to output i (ending in a non-digit: see node_names)."""
    return f"$out{i}_"


def encode_graph(graph: Graph) -> tuple[str, dict[int, str]]:
    """Each node becomes `(let $nK ...)`; returns the text and node-id -> name."""
    names = node_names(graph)
    lines = [f"(let {names[id(node)]} {_node_term(node, names)})" for node in topo_order(graph.outputs)]
    for i, out in enumerate(graph.outputs):
        lines.append(f"(let {output_name(i)} {names[id(out)]})")
    return "\n".join(lines), names


def _node_term(node: Node, names) -> str:
    return term_text(node.op, [names[id(a)] for a in node.args], node.a)


def term_text(op: str, operands: list[str], attrs: dict) -> str:
    """One e-node as egglog text, its operands already named."""
    if op == "extern":
        items = "(TNil)"
        for a in reversed(operands):
            items = f"(TCons {a} {items})"
        return f"(Extern {literal(str(attrs['target']), 'str')} {items})"
    parts = operands + [literal(attrs[name], kind) for name, kind in ops.get(op).attrs]
    return f"({ctor(op)}{''.join(' ' + p for p in parts)})"


def facts_text(type_id: int, shape, dtype: str) -> str:
    """The facts of one type id (each dim under its negative index and its index from the front:
    `size(x, 0)` in a rule's condition never held while only the negative ones were set)."""
    lines = [f"(set (ty-rank {type_id}) {len(shape)})", f"(set (ty-dtype {type_id}) {json.dumps(dtype)})",
             f"(set (ty-shape {type_id}) {json.dumps(','.join(map(str, shape)))})"]
    lines += [f"(set (ty-dim {type_id} {d - len(shape)}) {n})" for d, n in enumerate(shape)]
    lines += [f"(set (ty-dim {type_id} {d}) {n})" for d, n in enumerate(shape)]
    return "\n".join(lines)


def sexp(term) -> str:
    """A term as read back by EgglogSession.rows, as egglog text again."""
    if isinstance(term, tuple):
        return f"({' '.join([term[0]] + [sexp(t) for t in term[1:]])})"
    if isinstance(term, bool):
        return literal(term, "bool")
    return literal(term, {int: "int", float: "float", str: "str"}[type(term)])


# ---- rules ----

def rule_commands(rule, reach: set[str] | None = None) -> list[str]:
    """egglog commands for one rule: a rewrite (two for `<=>`), named after it; a fusion's
    only for the ops in `reach` where it is given (saturate.reachable_ops)."""
    if isinstance(rule, FuseRule):
        return [] if rule.horizontal else fuse_commands(rule, reach)
    options: list[list[str]] = [[]]  # one guard list per alternative of `in` conditions
    for cond in rule.conditions:
        if cond.is_assumption:
            continue  # a declared domain: checked by `verify`, not at match time
        if cond.op == "in":
            options = [g + [_guard(Condition(cond.left, "==", (r,)))] for g in options for r in cond.right]
        else:
            options = [g + [_guard(cond)] for g in options]
    out = []
    for k, guards in enumerate(options):
        suffix = f"#{k}" if len(options) > 1 else ""
        out.append(_rewrite(rule.lhs, rule.rhs, rule.group, rule.name + suffix, guards))
        if rule.both_ways:
            out.append(_rewrite(rule.rhs, rule.lhs, rule.group, rule.name + ".reverse" + suffix, guards))
    return out


def _rewrite(lhs, rhs, group, name, guards) -> str:
    when = f" :when ({' '.join(guards)})" if guards else ""
    return f"(rewrite {pattern(lhs)} {pattern(rhs)}{when} :ruleset {ruleset_name(group)} :name {json.dumps(name)})"


def ruleset_name(group: str) -> str:
    return "rs_" + "".join(c if c.isalnum() else "_" for c in group)


def pattern(term) -> str:
    if isinstance(term, Var):
        return "v_" + term.name
    if isinstance(term, Lit):
        return f"(Const {literal(term.value, 'float')})" if term.sort == "tensor" else literal(term.value, term.sort)
    if isinstance(term, Arith):
        return f"({term.op} {pattern(term.left)} {pattern(term.right)})"
    if isinstance(term, Query):
        if term.kind == "size":
            return f"(ty-dim (ty {pattern(term.var)}) {term.dim})"
        return f"({'ty-rank' if term.kind == 'rank' else 'ty-dtype'} (ty {pattern(term.var)}))"
    if isinstance(term, tuple):  # a list attribute holding variables
        out = "(INil)"
        for item in reversed(term):
            out = f"(ICons {pattern(item)} {out})"
        return out
    assert isinstance(term, Pat)
    return f"({ctor(term.op)}{''.join(' ' + pattern(a) for a in term.args)})"


def _guard(cond: Condition) -> str:
    left = pattern(cond.left)
    op = {"==": "="}.get(cond.op, cond.op)
    (right,) = cond.right
    return f"({op} {left} {pattern(right) if not isinstance(right, Lit) else literal(right.value, right.sort)})"


def _op_pattern(op: str, prefix: str) -> tuple[str, list[str]]:
    """`(Ctor p0 p1 .. attrs)` with fresh variables; returns it and the operand names."""
    opdef = ops.get(op)
    operands = [f"{prefix}{i}" for i in range(opdef.arity)]
    attrs = [f"{prefix}_a{i}" for i in range(len(opdef.attrs))]
    return f"({ctor(op)}{''.join(' ' + v for v in operands + attrs)})", operands


HIDDEN = "~"  # prefix of helper rules that the report does not count


def fuse_commands(rule: FuseRule, reach: set[str] | None = None) -> list[str]:
    """A fusion statement as egglog rules: for each consumer op and operand
    position, an alternative e-node whose operand is `(Inline p)`; with `reach`,
    only for the consumers and producers in it."""
    rs = ruleset_name(rule.group)
    out = []
    relation = "fuse-src-" + "".join(c if c.isalnum() else "-" for c in rule.name)
    same_domain = "same_domain" in rule.conditions
    for producer in rule.producers if same_domain else ():
        if ops.get(producer).group != "reduction":
            raise ValueError(f"{rule.location}: same_domain applies to reductions, not {producer}")
    producers = [p for p in rule.producers if reach is None or p in reach]
    consumers = [c for c in rule.consumers if reach is None or c in reach] if producers else []
    if not same_domain and consumers:
        out.append(f"(relation {relation} (T))")
        for producer in producers:
            pat, _ = _op_pattern(producer, "q")
            out.append(f"(rule ((= e {pat})) (({relation} e)) :ruleset {rs} "
                       f":name {json.dumps(HIDDEN + rule.name + '/' + producer)})")
    for consumer in consumers:
        pat, operands = _op_pattern(consumer, "c")
        for i, operand in enumerate(operands):
            inlined = pat.replace(f" {operand} ", f" (Inline {operand}) ", 1) if f" {operand} " in pat \
                else pat.replace(f" {operand})", f" (Inline {operand}))", 1)
            if same_domain:
                for producer in producers:
                    query = (f"(= {operand} ({ctor(producer)} x dims true)) "
                             f"(= (ty-shape (ty x)) (ty-shape (ty e)))")
                    out.append(f"(rule ((= e {pat}) {query}) ((union e {inlined})) :ruleset {rs} "
                               f":name {json.dumps(rule.name + '#' + producer + str(i) + consumer)})")
            else:
                out.append(f"(rule ((= e {pat}) ({relation} {operand})) ((union e {inlined})) :ruleset {rs} "
                           f":name {json.dumps(rule.name + '#' + str(i) + consumer)})")
    return out
