"""The size guard on a kernel's written-out expression: every inline operand is written out
wherever it is read, so a chain of ops that each read their operand twice doubles the
rendered source per step.  make_plan materialises an edge of a kernel past the limit."""
from __future__ import annotations

from .graph import Node, inline_edges

MAX_EXPRESSION = 4096  # ops in a kernel's expression with every inline operand written out where it is read


# how many times the renderers write out an operand of these ops (their templates' `{0}`s, pow's by
# its exponent; tests/test_regressions.py holds both targets' templates to these): a chain of
# silu(x) = x / (1 + exp(-x)) doubles its source per step (soak 6060: 6.8 MB lines, g++ minutes)
OPERAND_COPIES = {"relu": 2, "silu": 2, "gelu": 2, "gelu_tanh": 5}
POW_COPIES = {2.0: 2, 3.0: 3}


def copies(op: str, exponent: float | None = None) -> int:
    """How many times a renderer writes out the first operand of `op` (`exponent`: a pow's constant one)."""
    if op == "pow" and exponent is not None:
        return POW_COPIES.get(exponent, 1)
    return OPERAND_COPIES.get(op, 1)


def operand_copies(n: Node) -> int:
    if n.group == "row":
        return 3  # a row reads its input ~3 times
    constant = len(n.args) > 1 and n.args[1].op == "const"
    return copies(n.op, n.args[1].attr("value") if constant else None)


def oversized_edges(root: Node) -> set[int]:
    """An `inline` edge to materialise when the kernel's expression, as the renderers
    write it (each inline operand written out at every read), exceeds MAX_EXPRESSION
    ops: a chain of steps that each read their operand twice doubles the source per
    step (a 600-step random program rendered 1.5 GB of C++).  The edge whose target's
    copies weigh most (and any whose copies alone exceed the limit); empty when the
    kernel is small enough."""
    order, seen = [], set()
    stack = [(root, False)]
    while stack:  # post-order over the inline edges
        n, done = stack.pop()
        if done:
            order.append(n)
        elif id(n) not in seen:
            seen.add(id(n))
            stack.append((n, True))
            stack.extend((t, False) for _, t in inline_edges(n))
    weight = {id(n): operand_copies(n) for n in order}
    size: dict[int, int] = {}
    for n in order:
        size[id(n)] = 1 + sum(size[id(t)] * weight[id(n)] for _, t in inline_edges(n))
    if size[id(root)] <= MAX_EXPRESSION:
        return set()
    copies = {id(root): 1}
    edge_of: dict[int, int] = {}
    for n in reversed(order):  # parents before children
        for edge, t in inline_edges(n):
            copies[id(t)] = copies.get(id(t), 0) + copies[id(n)] * weight[id(n)]
            edge_of[id(t)] = id(edge)
    repeated = [n for n in order if copies[id(n)] >= 2 and id(n) in edge_of]
    if not repeated:
        return set()
    worst = max(repeated, key=lambda n: (copies[id(n)] - 1) * size[id(n)])
    heavy = {edge_of[id(n)] for n in repeated if copies[id(n)] * size[id(n)] > MAX_EXPRESSION}
    return heavy | {edge_of[id(worst)]}  # (every target whose copies alone exceed the budget, at once)


def written_size(expressions) -> int:
    """Ops in loop-IR expressions as the renderers write them (each operand written out at
    each read, a template's repeated `{0}` included): what a kernel's source weighs once
    lowered.  share_row_values holds a kernel that takes in another's work to MAX_EXPRESSION
    (soak 32003: a row kernel that absorbed 45 per-row values rendered 17 MB of C++)."""
    from .loopir import Call, Const

    size: dict[int, int] = {}

    def walk(e) -> int:
        if not isinstance(e, Call):
            return 1
        if id(e) not in size:
            first = copies(e.op, e.args[1].value if len(e.args) > 1 and isinstance(e.args[1], Const) else None)
            size[id(e)] = 1 + sum(walk(a) * (first if i == 0 else 1) for i, a in enumerate(e.args))
        return size[id(e)]
    return sum(walk(e) for e in expressions)
