"""Kernel-aware DAG greedy extraction.

An e-class can be used two ways: *materialised* (its value is written to
memory by a kernel of its own, or is an input or a view) or *inlined* (an
`Inline` edge: computed inside its consumer's kernel).  For each class the
extractor keeps the best choice for both uses:

- inlined: the FLOPs and bytes loaded by the inlined body, plus the
  materialised kernels it depends on.  Inlined bodies' FLOPs are tree-costed, so
  an inlined producer used by two kernels is charged in each (it is recomputed);
  their loads are counted once per tensor a kernel reads (a fused silu backward
  reads its input once, however many of its ops take it), except where an inlined
  operand computes again what the body already inlines (`_merged`): that one is
  written out at each read, its loads with it, so a chain of `x * x + x` is cut
  into kernels rather than kept inline at twice the work per step.
- materialised: the roofline cost of the kernel rooted here (body FLOPs,
  loads + its own store, launch), plus the kernels it depends on.  Kernels are
  DAG-costed: a materialised class is paid once however many kernels read it.

Library and extern ops never take an inlined operand.  Inlining is offered
only where rules put an `Inline` edge; nothing here decides fusion.
"""
from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass, field, replace

from .. import ops
from ..cost import (ELEMENTWISE, VIEW_COST, DeviceProfile, extra_passes, inlined_cost, itemsize, kernel_cost,
                    moves_inner_dim, op_flops, repeats)
from ..errors import CodegenError, UnsoundRuleError
from ..graph import WEAK, Graph, Node
from .extract import EClassGraph, ENode

INLINE_GROUPS = {"pointwise", "reduction", "layout", "row", "source", "concat", "gather"}


@dataclass
class Option:
    total: float
    node: ENode
    needed: dict[str, float]  # materialised class -> its kernel cost
    flops: float = 0.0
    loads: dict = field(default_factory=dict)  # class read from memory -> its bytes (once per kernel)
    body: frozenset = field(default_factory=frozenset)  # classes computed inline (a cycle guard)
    elementwise: float = 0.0  # of `flops`, those a broadcasting consumer repeats (cost.repeats)


class KernelExtractor:
    def __init__(self, eg: EClassGraph, profile: DeviceProfile, banned: frozenset = frozenset()):
        self.eg, self.profile = eg, profile
        self.banned = banned  # id()s of e-nodes not to choose (alternative plans)
        self.inline_of = {c: n.children[0] for c, nodes in eg.classes.items() for n in nodes if n.op == "inline"}
        self.class_of = {id(n): c for c, nodes in eg.classes.items() for n in nodes}
        self.mat: dict[str, Option] = {}
        self.inl: dict[str, Option] = {}
        self.numel = {c: math.prod(shape) for c, shape in eg.shape.items()}  # (read per e-node per sweep)

    def bytes(self, class_id: str) -> float:
        dtype = self.eg.dtype[class_id]
        return self.numel[class_id] * itemsize("float32" if dtype == WEAK else dtype)

    def run(self) -> None:
        """Sweeps over the e-nodes in class order until no option improves, as a
        fixed point; an e-node is evaluated again only once an option it reads
        has improved (its offers are a function of those options, and options
        only improve, so the others would lose again).  An e-node whose input
        improves later in the sweep is evaluated in the same sweep, an earlier
        one in the next: the same choices as sweeping everything, without
        re-costing 3,000 e-nodes ~140 times on a 16-layer model."""
        order = [(class_id, en) for class_id, enodes in self.eg.classes.items()
                 if class_id not in self.inline_of and class_id in self.eg.shape
                 for en in enodes if id(en) not in self.banned]
        readers: dict[str, list[int]] = {}  # class -> the e-nodes whose cost reads its options
        for i, (_, en) in enumerate(order):
            for child in dict.fromkeys(en.children):
                readers.setdefault(self.inline_of.get(child, child), []).append(i)
        sweep = list(range(len(order)))
        while sweep:
            queued, later = set(sweep), set()
            heapq.heapify(sweep)
            while sweep:
                i = heapq.heappop(sweep)
                class_id, en = order[i]
                body = self._body(en)
                if body is None:
                    continue
                improved = self._offer_inline(class_id, en, body)
                improved |= self._offer_materialised(class_id, en, body)
                if improved:
                    for j in readers.get(class_id, ()):
                        if j > i and j not in queued:
                            queued.add(j)
                            heapq.heappush(sweep, j)
                        elif j <= i:
                            later.add(j)
            sweep = sorted(later)

    def _body(self, en: ENode, inline=None):
        group = ops.group_of(en.op)
        flops = 0.0
        if group not in ("source", "layout", "boundary", "extern"):
            flops = op_flops(en.op, self._shape_of(en), [self.eg.shape[c] for c in en.children], self.profile)
        elementwise = flops if group in ELEMENTWISE else 0.0
        elements = self.numel[self.class_of[id(en)]]
        loads, needed, inlined = {}, {}, frozenset()
        for position, child in enumerate(en.children):
            if child in self.inline_of:
                if ops.operand_in_memory(group, position):
                    return None
                option = (inline or self.inl.get)(self.inline_of[child])
                if option is None:
                    return None
                times = repeats(group, elements, self.numel[self.inline_of[child]])
                flops = flops + option.flops + option.elementwise * (times - 1)
                loads = _merged(loads, option.loads, recomputed=bool(option.body & inlined))
                elementwise += option.elementwise * times if group in ELEMENTWISE else 0.0
                needed = {**needed, **option.needed}
                inlined |= option.body
            else:
                option = self.mat.get(child)
                if option is None:
                    return None
                needed = {**needed, **option.needed}
                if option.node.op != "const":
                    loads = _merged(loads, {child: self.bytes(child)}, recomputed=False)
        return flops, loads, needed, inlined, elementwise

    def _shape_of(self, en: ENode):
        return self.eg.shape[self.class_of[id(en)]]

    def _offer_inline(self, class_id, en, body) -> bool:
        group = ops.group_of(en.op)
        flops, loads, needed, inlined, elementwise = body
        if group not in INLINE_GROUPS or class_id in inlined or en.op == "extern":
            return False
        if en.op == "input":
            loads = {class_id: self.bytes(class_id)}
        total = sum(needed.values()) + inlined_cost(flops, sum(loads.values()), self.profile)
        old = self.inl.get(class_id)
        if old is not None and total >= old.total - 1e-15:
            return False
        self.inl[class_id] = Option(total, en, needed, flops, loads, inlined | {class_id}, elementwise)
        return True

    def _offer_materialised(self, class_id, en, body) -> bool:
        option = self._materialised(class_id, en, body)
        if option is None:
            return False
        old = self.mat.get(class_id)
        if old is not None and option.total >= old.total - 1e-15:
            return False
        self.mat[class_id] = option
        return True

    def _materialised(self, class_id, en, body) -> Option | None:
        group = ops.group_of(en.op)
        flops, loads, needed, inlined, _ = body
        if class_id in needed or class_id in inlined:
            return None  # a cycle through this class
        has_inline = any(c in self.inline_of for c in en.children)
        if group == "source":
            cost = 0.0
        elif group == "layout" and not has_inline:
            cost = VIEW_COST  # a view of a materialised tensor
        else:
            extra = extra_passes(en.op, [self.eg.shape[c] for c in en.children], en.attrs) * self.bytes(class_id)
            cost = kernel_cost(flops, sum(loads.values()) + self.bytes(class_id), self.profile, library=group == "library",
                               link=group == "collective", serial_bytes=extra, op=en.op)
        needed = {**needed, class_id: cost}
        return Option(sum(needed.values()), en, needed, body=inlined)

    def share_roots(self, strided: frozenset = frozenset()) -> None:
        """Each output's cheapest term is chosen as if it were alone; where it computes
        again what the other outputs' terms already store (a training forward's saved
        transpose of an activation the next matmul reads: fused into a kernel of its own
        rather than viewed), the term that costs least beside theirs is taken instead.
        Only an output no other output's term reads changes (another's cost would change
        with it), so each change lowers the program's DAG cost.  A transposing view of a
        stored value is free only where eager returns the output so (`strided`: root
        positions, Graph.output_strides); elsewhere the runtime copies it, a read and a write.
        An output's kernel may also compute inline another output that would otherwise have a
        kernel of its own, and store it (sharing._absorb): GPT-2's gelu beside the tanh its
        backward saves.  Its operands' inline terms are chosen again for that (`_beside`), and
        kept where no other kernel inlines them."""
        contiguous = {r for i, r in enumerate(self.eg.roots) if i not in strided}
        roots = list(dict.fromkeys(self.eg.roots))
        stored_by, memo = self._storable_roots(roots), {}
        users: dict[str, int] = {}  # class -> how many outputs' terms need it
        for r in roots:
            for c in self.mat[r].needed:
                users[c] = users.get(c, 0) + 1
        # kernels between the outputs that could store one of them beside their own output
        sizes = {self.numel[s] for s in stored_by}
        between = [c for c in users if c not in roots and c in self.mat and self.numel[c] in sizes
                   and _writes(self.mat[c], self.inline_of)]
        for _ in range(3):
            changed = False
            for r in roots + between:
                mine = self.mat[r].needed

                def by_others(c: str) -> bool:
                    return users.get(c, 0) - (c in mine) > 0
                # where another term reads this class, only its kernel may change, for one that
                # also stores an output (the readers read the same tensor)
                read = r not in self.eg.roots or by_others(r)
                if read and not (stored_by and _writes(self.mat[r], self.inline_of)):
                    continue

                def marginal(option: Option) -> float:
                    en = option.node
                    copy = (r in contiguous and ops.group_of(en.op) == "layout"
                            and not any(c in self.inline_of for c in en.children)
                            and moves_inner_dim(en.op, en.attrs, self.eg.shape[en.children[0]]))
                    absorbed = sum(stored_by[s] for s in option.body if s != r and s in stored_by
                                   and self.numel[s] == self.numel[r])
                    if read and option is not self.mat[r] and not (absorbed and _writes(option, self.inline_of)):
                        return math.inf
                    return sum(cost for c, cost in option.needed.items() if c == r or not by_others(c)) - absorbed + \
                        (2 * self.bytes(r) / self.profile.bandwidth if copy else 0.0)
                best, best_cost, chosen = self.mat[r], marginal(self.mat[r]), {}
                beside = (lambda c: self._beside(c, stored_by, memo)) if stored_by else None
                for en in self.eg.classes[r]:
                    for inline in dict.fromkeys((None, beside)):
                        body = self._body(en, inline) if id(en) not in self.banned else None
                        option = self._materialised(r, en, body) if body is not None else None
                        if option is not None and marginal(option) < best_cost - 1e-12:
                            changes = self._inline_changes(r, option.node, memo) if inline else {}
                            if changes is not None:
                                best, best_cost, chosen = option, marginal(option), changes
                if best is not self.mat[r]:
                    if r in self.eg.roots:  # (the counts are of outputs' terms)
                        for c in mine:
                            users[c] -= 1
                        for c in best.needed:
                            users[c] = users.get(c, 0) + 1
                    self.mat[r], changed = best, True
                    self.inl.update(chosen)
            if not changed:
                return

    def _beside(self, c: str, stored_by: dict, memo: dict) -> Option | None:
        """Class c's inline term where terms that compute an output of `stored_by` inline
        are priced less what storing it saves (the output's kernel goes)."""
        if c in memo:
            return memo[c]
        best = memo[c] = self.inl.get(c)  # (also the guard of a cycle through c)
        if best is None:
            return None
        best_score = best.total - sum(stored_by.get(s, 0.0) for s in best.body)
        for en in self.eg.classes[c]:
            body = self._body(en, lambda k: self._beside(k, stored_by, memo)) if id(en) not in self.banned else None
            if body is None or not body[3] & stored_by.keys() or ops.group_of(en.op) not in INLINE_GROUPS:
                continue
            flops, loads, needed, inlined, elementwise = body
            if c in inlined or en.op in ("extern", "input"):
                continue
            total = sum(needed.values()) + inlined_cost(flops, sum(loads.values()), self.profile)
            score = total - sum(stored_by.get(s, 0.0) for s in inlined)
            if score < best_score - 1e-12:
                best, best_score = Option(total, en, needed, flops, loads, inlined | {c}, elementwise), score
        memo[c] = best
        return best

    def _inline_changes(self, root: str, node: ENode, memo: dict) -> dict | None:
        """The inline terms below `node` that `_beside` chose unlike `inl`, or None where one
        of them is also inlined by another kernel of the current program (its cost would change)."""
        changes, stack = {}, [node]
        while stack:
            for child in stack.pop().children:
                k = self.inline_of.get(child)
                if k is None or k in changes:
                    continue
                option = memo.get(k, self.inl.get(k))
                if option is not self.inl.get(k):
                    changes[k] = option
                stack.append(option.node)
        if changes:
            kernels = {c for r in self.eg.roots for c in self.mat[r].needed} - {root}
            if any(changes.keys() & self.mat[c].body for c in kernels if c in self.mat):
                return None
        return changes

    def _storable_roots(self, roots) -> dict[str, float]:
        """Outputs whose kernel another kernel could replace by storing them beside its own
        output, where it computes them inline as they would be computed alone (the same e-node,
        so the same node once built): each with what that saves (its kernel less one store)."""
        saved = {}
        for s in roots:
            mat, inl = self.mat[s], self.inl.get(s)
            if (inl is not None and inl.node is mat.node and ops.group_of(mat.node.op) in ELEMENTWISE
                    and any(c in self.inline_of for c in mat.node.children)):
                saved[s] = max(0.0, mat.needed[s] - self.bytes(s) / self.profile.bandwidth)
        return saved

    def cost_of(self, roots) -> float:
        used: dict[str, float] = {}
        for r in roots:
            used.update(self.mat[r].needed)
        return sum(used.values())


def _writes(option: Option, inline_of: dict) -> bool:
    """Whether the option is a kernel that writes its class (not an input, a constant or a view)."""
    group = ops.group_of(option.node.op)
    return group not in ("source", "layout") or (group == "layout" and any(c in inline_of for c in option.node.children))


def _merged(loads: dict, more: dict, recomputed: bool) -> dict:
    """A kernel's loads with an inlined operand's: a tensor it reads once however many ops take
    it, except where the operand computes again what the body already inlines (written out at
    each read: `x * x + x` chained, each step's loads twice its operand's)."""
    merged = dict(loads)
    for c, b in more.items():
        merged[c] = merged.get(c, 0.0) + b if recomputed else max(merged.get(c, 0.0), b)
    return merged


def extract_kernels(eg: EClassGraph, graph: Graph, profile: DeviceProfile,
                    banned: frozenset = frozenset()) -> tuple[Graph, float]:
    """The cheapest program, with `inline` nodes marking fused operands (without
    the `banned` e-nodes: UnsoundRuleError where that leaves an output no term)."""
    extractor = KernelExtractor(eg, profile, banned)
    extractor.run()
    missing = [r for r in eg.roots if r not in extractor.mat]
    if missing:
        raise UnsoundRuleError(f"no finite term for output class(es) {missing}")
    extractor.share_roots(frozenset(graph.output_strides))
    return build(eg, extractor, graph), extractor.cost_of(eg.roots)


def chosen_enodes(eg: EClassGraph, profile: DeviceProfile, banned: frozenset = frozenset(),
                  strided: frozenset = frozenset()) -> list[ENode]:
    """The e-nodes the cheapest program uses (each once, outputs first)."""
    extractor = KernelExtractor(eg, profile, banned)
    extractor.run()
    if all(r in extractor.mat for r in eg.roots):
        extractor.share_roots(strided)
    seen, out, stack = set(), [], [(r, "mat") for r in eg.roots]
    while stack:
        class_id, mode = stack.pop()
        if (class_id, mode) in seen:
            continue
        seen.add((class_id, mode))
        option = (extractor.mat if mode == "mat" else extractor.inl).get(class_id)
        if option is None:
            continue
        out.append(option.node)
        for child in option.node.children:
            stack.append((extractor.inline_of[child], "inl") if child in extractor.inline_of else (child, "mat"))
    return out


def build(eg: EClassGraph, extractor: KernelExtractor, graph: Graph) -> Graph:
    inputs = {n.attr("name"): n for n in graph.inputs}
    built: dict[tuple[str, str], Node] = {}
    where = dict(graph.where)
    eclass: dict[int, str] = {}

    active: set[tuple[str, str]] = set()

    def operand(class_id: str, mode: str) -> Node:
        """A child's node; where the per-class choices form a cycle (each class's
        cheapest node reads the other: x = y * a, y = x * b), the child is the
        captured program's own node of its class, computed as captured."""
        if (class_id, mode) not in active:
            made = make(class_id, mode)
            return made if mode == "mat" else Node.make("inline", (made,))
        if class_id not in eg.original:
            raise CodegenError(f"extraction chose a cyclic term through e-class {class_id} (a compiler bug)")
        return eg.original[class_id]

    def make(class_id: str, mode: str) -> Node:
        key = (class_id, mode)
        if key in built:
            return built[key]
        en = (extractor.mat if mode == "mat" else extractor.inl)[class_id].node
        active.add(key)
        args = []
        for child in en.children:
            if child in extractor.inline_of:
                args.append(operand(extractor.inline_of[child], "inline"))
            else:
                args.append(operand(child, "mat"))
        active.discard(key)
        if en.op == "input":
            node = inputs[en.attrs["name"]]
        elif en.op in ("const", "extern"):
            node = Node.make(en.op, tuple(args), en.attrs, shape=eg.shape[class_id], dtype=eg.dtype[class_id])
        else:
            node = Node.make(en.op, tuple(args), en.attrs)
        built[key] = node
        eclass.setdefault(id(node), class_id)
        if class_id in eg.where:
            where.setdefault(id(node), eg.where[class_id])
        return node

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))  # deep programs recurse deeply
    outputs = tuple(make(r, "mat") for r in eg.roots)
    return replace(graph, outputs=outputs, where=where, eclass=eclass)
