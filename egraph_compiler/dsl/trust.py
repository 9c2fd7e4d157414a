"""Trusting user rules: before a compile uses a user's rule, both sides are
checked numerically (dsl/verify.py) and an unsound rule is refused with a
counterexample, since one wrong rewrite silently changes every program it
matches.  A passed rule is remembered by its exact text (and the verifier's
version), in this process and in `verified_rules.json` in the cache dir, so
compiling again with the same rules verifies nothing.  Failures are not
remembered: they stop the compile, and the user will edit the rule."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import UnsoundRuleError
from . import verify
from .parser import Rule

TRIALS = 8  # a handful: an unsound rule is nearly always caught by the first instances
SEED = 0
CACHE_FILE = "verified_rules.json"
MAX_ENTRIES = 10_000  # oldest keys are dropped beyond this, so the file stays small

_passed: set[str] = set()  # keys verified (or read from the file) in this process


def check_user_rules(rules: list) -> None:
    """Raise UnsoundRuleError for the first rewrite rule whose sides differ on
    an instance meeting its conditions (unsafe rules: inside their declared
    domain).  `fuse` and `phase` statements have no equation and are skipped."""
    todo = [r for r in rules if isinstance(r, Rule) and _key(r) not in _passed]
    if not todo:
        return
    _passed.update(_read(_cache_file()))
    fresh: list[str] = []
    try:
        for rule in todo:
            key = _key(rule)
            if key in _passed:
                continue
            result = verify.verify_rule(rule, trials=TRIALS, seed=SEED)
            if not result.passed:
                raise UnsoundRuleError(refusal(rule, result))
            _passed.add(key)
            fresh.append(key)
    finally:  # rules that passed before a refusal need not be verified again
        if fresh:
            _write(_cache_file(), fresh)


def refusal(rule: Rule, result: verify.VerifyResult) -> str:
    if result.trials == 0:  # nothing ran, so nothing is known either way
        return (f"{rule.location}: rule {rule.name} could not be verified: {result.message}; "
                "trust_rules=True compiles with it unverified")
    return f"{rule.location}: rule {rule.name} is unsound: {result.counterexample or result.message}"


def _key(rule: Rule) -> str:
    """The rule's text and its parsed meaning (a `\\` continuation line is not in `text`), with
    everything that could change a verdict: verifier version, trials, seed, torch version."""
    parts = [verify.VERSION, TRIALS, SEED, torch.__version__, rule.text,
             repr((rule.lhs, rule.rhs, rule.both_ways, rule.conditions))]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _cache_file() -> Path:
    root = os.environ.get("EGC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "egraph_compiler")
    return Path(root) / CACHE_FILE


def _read(path: Path) -> list[str]:
    """The stored keys; a missing, unreadable or malformed file counts as empty."""
    try:
        keys = json.loads(path.read_text()).get("passed", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def _write(path: Path, fresh: list[str]) -> None:
    """Add keys to the file: a temp file in the same dir then os.replace, so a
    concurrent reader sees the old file or the new one, never half of one.  An
    unwritable dir leaves only the in-process cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(dict.fromkeys(_read(path) + fresh))[-MAX_ENTRIES:]
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verified_rules.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"passed": keys}, out)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
