"""The rule library: the shipped `rules/*.rules` files plus user rules, and
the selection a compile asks for (disabled names or groups, unsafe rules)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import RuleError
from .parser import Rule, parse_file, parse_rules


def library_dir() -> Path:
    try:
        path = Path(str(resources.files("egraph_compiler.rules")))
        if path.is_dir() and any(path.glob("*.rules")):
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "rules"  # a source checkout


def library_rules() -> list[Rule]:
    rules: list[Rule] = []
    for path in sorted(library_dir().glob("*.rules")):
        rules += parse_file(path)
    return rules


def load_user_rules(entries) -> list[Rule]:
    """Each entry is a path to a rules file or the text of rules."""
    rules: list[Rule] = []
    for k, entry in enumerate(entries or []):
        if isinstance(entry, Path) or (isinstance(entry, str) and "\n" not in entry and entry.endswith(".rules")):
            rules += parse_file(entry)
        else:
            rules += parse_rules(str(entry), f"<rules {k}>", group="user")
    return rules


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
    out = []
    for r in rules:
        if r.name in disable or r.group in disable:
            continue
        if r.unsafe and unsafe is not True and r.name not in allowed and r.group not in allowed:
            continue
        out.append(r)
    return out
