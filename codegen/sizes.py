"""Sizes as kernel arguments: one build serves the programs that differ only in sizes.

A program is first built with its sizes as literals (constants the compiler folds into
its loops).  When another program renders to the same source except for some integer
literals (the same plan at another batch size or sequence length: `dynamic=True`, or a
second `compile` of the same function), the literals that differed become the kernels'
arguments: the source is built once more as a template, each such literal read from a
size array passed with every call, and every later program of that form runs on that
build with its own sizes (Dynamo's automatic dynamic shapes, applied to kernel source).

Sound by construction: a template serves a program only when the program's own source
is the template with the program's literals in its slots, and no slot lies where the
language needs a constant (a target's `fixed` test: pragmas, array bounds), so each
kernel computes exactly what the program's own source computes.  A slot is an int64
where the literal was an int: the same value in every context a literal can stand in
(indices, loop bounds, comparisons), with more range.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

NUMBER = re.compile(r"(?<![\w.])(?<![eE][-+])\d+(?![\w.])")  # an integer literal (not in a name or a float)
MARK = "\0"


@dataclass(frozen=True)
class Sized:
    """What a target needs to take sizes as arguments: `fixed(line, column)`, whether a literal
    there must stay a constant; `slot(i)`, the text that reads size i in a kernel; `finish(text,
    slots)`, the template's source from the text with slots in place (its kernels given the size
    array as their last argument); `note(sizes)`, a comment line naming a program's sizes."""
    fixed: Callable[[str, int], bool]
    slot: Callable[[int], str]
    finish: Callable[[str, int], str]
    note: Callable[[list], str]


@dataclass
class Template:
    slots: tuple  # per size argument, the positions (among the integer literals) that read it
    values: tuple  # the literals at every position (those at slots are one program's)
    source: str  # what is built

    def sizes(self, values: tuple) -> list[int] | None:
        """This program's sizes, or None if it differs from the template outside the slots (or
        two positions of one size differ)."""
        slots = {i for group in self.slots for i in group}
        if any(a != b for i, (a, b) in enumerate(zip(values, self.values)) if i not in slots):
            return None
        if any(len({values[i] for i in group}) > 1 for group in self.slots):
            return None
        return [values[group[0]] for group in self.slots]


class Templates:
    """Per target and source form (the text with its integer literals blanked): the literal
    vectors seen, and the templates built.  Bounded: the least recently used forms go."""
    LIMIT = 128
    KEEP = 16

    def __init__(self):
        self.forms: OrderedDict = OrderedDict()  # key -> (distinct literal vectors seen, [Template])
        self.built = 0  # templates made (a test reads it)

    def source(self, target: str, text: str, sized: Sized) -> tuple[str, list[int] | None]:
        """(the source to build, the size array to pass, or None when it is `text` itself)."""
        key = (target, NUMBER.sub(MARK, text))
        values = tuple(int(m) for m in NUMBER.findall(text))
        seen, templates = self.forms.pop(key, None) or ([], [])
        self.forms[key] = (seen, templates)
        while len(self.forms) > self.LIMIT:
            self.forms.popitem(last=False)
        for template in templates:
            sizes = template.sizes(values)
            if sizes is not None:
                return template.source, sizes
        if not seen or values in seen:
            if values not in seen:
                seen.append(values)
            return text, None  # the first of its form (or the same again): built as it is
        seen.append(values)
        del seen[1:-self.KEEP]  # the first and the latest: the slots are where they differ
        groups: dict = {}  # the literals seen at a position -> the positions that saw the same
        for i in range(len(values)):
            column = tuple(v[i] for v in seen)
            if len(set(column)) > 1:
                groups.setdefault(column, []).append(i)
        slots = tuple(tuple(group) for group in groups.values())
        positions = [m.start() for m in NUMBER.finditer(text)]
        if any(_is_fixed(text, positions[i], sized) for group in slots for i in group):
            return text, None  # a size where the language needs a constant: each program its own build
        pieces = NUMBER.split(text)
        slot_of = {i: n for n, group in enumerate(slots) for i in group}
        out = [pieces[0]]
        for i, value in enumerate(values):
            out.append(sized.slot(slot_of[i]) if i in slot_of else str(value))
            out.append(pieces[i + 1])
        template = Template(slots, values, sized.finish("".join(out), len(slots)))
        templates.append(template)
        self.built += 1
        return template.source, template.sizes(values)


def _is_fixed(text: str, position: int, sized: Sized) -> bool:
    start = text.rfind("\n", 0, position) + 1
    end = text.find("\n", position)
    line = text[start:end if end >= 0 else len(text)]
    return sized.fixed(line, position - start)


TEMPLATES = Templates()
