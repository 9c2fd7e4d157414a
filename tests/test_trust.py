"""User rules are verified before use: an unsound one is refused with its
location and a counterexample; passed rules are cached by their text."""
import json
import os

import pytest

from egraph_compiler.dsl import trust, verify
from egraph_compiler.dsl.library import load_user_items
from egraph_compiler.errors import UnsoundRuleError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache dir and an empty in-process cache; counts verify_rule calls."""
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(trust, "_passed", set())
    calls = []
    real = verify.verify_rule

    def counting(rule, *args, **kwargs):
        calls.append(rule.name)
        return real(rule, *args, **kwargs)
    monkeypatch.setattr(verify, "verify_rule", counting)
    return calls


def test_unsound_rule_is_refused_with_location_and_counterexample(cache):
    rules = load_user_items(["rule fine: neg(neg(x)) => x\nrule bad: add(x, y) => mul(x, y)\n"])
    with pytest.raises(UnsoundRuleError) as info:
        trust.check_user_rules(rules)
    message = str(info.value)
    assert message.startswith("<rules 0>:2: rule bad is unsound: lhs ")
    assert "vs rhs" in message and "max |lhs - rhs|" in message  # the error
    assert "x: shape [" in message and "y: shape [" in message  # the failing instance's inputs
    assert "\n" not in message


def test_sound_rules_pass_and_fuse_and_phase_statements_are_skipped(cache):
    rules = load_user_items(["rule neg_neg: neg(neg(x)) => x\n"
                             "unsafe rule exp_log_user: exp(log(x)) => x if x > 0\n"  # inside its domain
                             "fuse f: pointwise <- pointwise\n"
                             "phase p: user\n"])
    trust.check_user_rules(rules)
    assert cache == ["neg_neg", "exp_log_user"]


def test_second_check_hits_the_cache_in_process_and_on_disk(cache, tmp_path):
    rules = load_user_items(["rule neg_neg: neg(neg(x)) => x\n"])
    trust.check_user_rules(rules)
    trust.check_user_rules(rules)
    assert cache == ["neg_neg"]
    stored = json.loads((tmp_path / "verified_rules.json").read_text())["passed"]
    assert len(stored) == 1
    trust._passed.clear()  # a new process: the file answers
    trust.check_user_rules(rules)
    assert cache == ["neg_neg"]
    trust.check_user_rules(load_user_items(["rule neg_neg: neg(neg(y)) => y\n"]))  # other text: verified again
    assert cache == ["neg_neg", "neg_neg"]
    assert [p.name for p in tmp_path.iterdir()] == ["verified_rules.json"]  # no temp file left behind


def test_failures_are_not_cached(cache):
    rules = load_user_items(["rule bad: add(x, y) => mul(x, y)\n"])
    for _ in range(2):
        with pytest.raises(UnsoundRuleError):
            trust.check_user_rules(rules)
    assert cache == ["bad", "bad"]


def test_unwritable_cache_dir_keeps_an_in_process_cache(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EGC_CACHE_DIR", str(blocker / "cache"))  # a dir under a file can never be made
    rules = load_user_items(["rule neg_neg: neg(neg(x)) => x\n"])
    trust.check_user_rules(rules)
    trust.check_user_rules(rules)
    assert cache == ["neg_neg"]


def test_corrupt_cache_file_is_ignored_and_replaced(cache, tmp_path):
    (tmp_path / "verified_rules.json").write_text("{not json")
    trust.check_user_rules(load_user_items(["rule neg_neg: neg(neg(x)) => x\n"]))
    assert cache == ["neg_neg"]
    assert len(json.loads((tmp_path / "verified_rules.json").read_text())["passed"]) == 1


def test_rule_without_a_well_formed_instance_is_refused_as_unverifiable(cache):
    with pytest.raises(UnsoundRuleError, match=r"<rules 0>:1: rule nope could not be verified: no well-formed"):
        trust.check_user_rules(load_user_items(["rule nope: reshape(x, [7]) => x\n"]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_cache_dir(cache, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("EGC_CACHE_DIR", str(ro))
    try:
        trust.check_user_rules(load_user_items(["rule neg_neg: neg(neg(x)) => x\n"]))
        assert cache == ["neg_neg"] and list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)
