"""The rule library: the shipped `rules/*.rules` files plus user rules, and
the selection a compile asks for (disabled names or groups, unsafe rules)."""
from __future__ import annotations

from difflib import get_close_matches
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ..errors import OptionError, RuleError
from .parser import FuseRule, Phase, Rule, parse_file, parse_rules


LOWERING = "lowering"  # rules/lowering.rules: definitions lower.py instantiates, never run in saturation


def library_dir() -> Path:
    try:
        path = Path(str(resources.files("egraph_compiler.rules")))
        if path.is_dir() and any(path.glob("*.rules")):
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "rules"  # a source checkout


def _library_items() -> list:
    items: list = []
    for path in sorted(library_dir().glob("*.rules")):
        items += _parse_cached(str(path), path.stat().st_mtime_ns)
    return items


@lru_cache(maxsize=64)
def _parse_cached(path: str, mtime: int) -> tuple:
    return tuple(parse_file(path))


def library_rules() -> list[Rule]:
    """The shipped rules and fusion statements (not the schedule)."""
    return [r for r in _library_items() if not isinstance(r, Phase)]


def library_rule(name: str) -> Rule:
    """A shipped rule by name (lowering instantiates the row composites' definitions)."""
    for rule in library_rules():
        if rule.name == name:
            return rule
    raise RuleError(f"the rule library has no rule {name!r}", str(library_dir()), 0, 0, "")


def library_phases() -> list[Phase]:
    """The shipped schedule (`phase` statements, in file order)."""
    return [p for p in _library_items() if isinstance(p, Phase)]


def load_user_items(entries) -> list:
    """Each entry is a path to a rules file (a Path, a name ending in .rules, or any one line
    naming a file that exists) or the text of rules."""
    items: list = []
    for k, entry in enumerate(entries or []):
        if isinstance(entry, Path) or (isinstance(entry, str) and "\n" not in entry and (
                entry.endswith(".rules") or Path(entry).is_file())):
            if not Path(entry).is_file():
                raise RuleError("no rules file here (a path, or the text of rules, was expected)", str(entry))
            items += parse_file(entry)
        else:
            items += parse_rules(str(entry), f"<rules {k}>", group="user")
    return items


def load_user_rules(entries) -> list[Rule]:
    return [r for r in load_user_items(entries) if not isinstance(r, Phase)]


def schedule(rules, phases: list[Phase]) -> list[tuple[list[str], int | None]]:
    """(groups, iteration limit) per phase.  Without phases: every rewrite
    group together, then the fusion groups.  Groups no phase names (a user's
    own) join the first phase."""
    present = list(dict.fromkeys(r.group for r in rules))
    if not phases:
        fusion = [g for g in present if all(isinstance(r, FuseRule) for r in rules if r.group == g)]
        return [([g for g in present if g not in fusion], None), (fusion, None)]
    named = {g for p in phases for g in p.groups}
    out = [([g for g in p.groups if g in present], p.iterations) for p in phases]
    out[0] = (out[0][0] + [g for g in present if g not in named], out[0][1])
    return out


def check_unique(rules: list[Rule]) -> None:
    seen: dict[str, Rule] = {}
    for r in rules:
        if r.name in seen:
            first = seen[r.name]
            raise RuleError(f"duplicate rule name {r.name!r} (first defined at {first.location})", r.path, r.line,
                            r.text.find("rule " + r.name) + 6, r.text)
        seen[r.name] = r


def select(rules: list[Rule], disable=(), unsafe=False) -> list[Rule]:
    """Rules that run: not disabled (by name or group), and unsafe ones only
    when `unsafe` is True or names them (or their group)."""
    disable = set(disable or ())
    allowed = set(unsafe) if isinstance(unsafe, (list, tuple, set)) else set()
    known = {r.name for r in rules} | {r.group for r in rules}
    for option, names in (("disable", disable), ("unsafe", allowed)):
        for name in sorted(names - known):  # (a misspelt name would otherwise switch nothing, silently)
            close = get_close_matches(name, known, n=3)
            raise OptionError(f"{option}={name!r} names no rule or group of rules"
                              + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                 " (`egc rules list` prints them by group)"))
    out = []
    for r in rules:
        if r.name in disable or r.group in disable:
            continue
        if r.unsafe and unsafe is not True and r.name not in allowed and r.group not in allowed:
            continue
        out.append(r)
    return out
