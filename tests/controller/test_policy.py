"""Policies: rule resolution, field-by-field overrides, versions, and refusing bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.decision.policy import PolicyStore, load_policy, parse_policy
from specd_api.yaml_config import ConfigError, read_stable_text

REPO = Path(__file__).resolve().parents[2]

POLICY = """
defaults:
  max_batch_size: 8
  drafters:
    draft: {k_max: 6}
segments:
  - match: "tenant-*-eu"
    force: none
  - match: "tenant-*"
    max_batch_size: 4
  - match: "tenant-gold"
    max_batch_size: 16
  - match: "code"
    drafters:
      draft: {k_min: 2}
"""


@pytest.mark.parametrize(
    ("segment", "batch", "force", "why"),
    [
        ("tenant-gold", 16, None, "an exact name beats the globs listed before it"),
        ("tenant-blue", 4, None, "first matching glob"),
        ("tenant-blue-eu", 8, "none", "first matching glob wins even when a later one matches too"),
        ("other", 8, None, "no rule: the defaults"),
        ("tenant-gold#sampled", 16, None, "a segment's sampled requests follow its own rules, exact names included"),
        ("tenant-blue-eu#sampled", 8, "none", "and its globs, matched against the segment's name"),
    ],
)
def test_rule_resolution(segment, batch, force, why):
    settings = parse_policy(POLICY).for_segment(segment)
    assert (settings.max_batch_size, settings.force) == (batch, force), why


def test_drafter_override_merges_field_by_field():
    draft = parse_policy(POLICY).for_segment("code").drafter("draft")
    assert (draft.k_min, draft.k_max) == (2, 6)  # k_min from the rule, k_max from the defaults
    assert draft.prior_alpha == 0.6  # untouched fields keep the built-in default


def test_naming_one_drafter_keeps_the_others():
    settings = parse_policy("defaults:\n  drafters:\n    draft: {k_max: 3}\n").document.defaults
    assert settings.drafter("prompt_lookup").k_max == 10  # built-in default, not dropped
    assert settings.drafter("draft").prior_alpha == 0.6  # built-in draft default, not the class default


def test_version_is_a_content_hash():
    assert parse_policy(POLICY).version == parse_policy(POLICY).version
    assert parse_policy(POLICY).version != parse_policy(POLICY + "\n# edited\n").version


def test_shipped_policy_is_valid():
    policy = load_policy(REPO / "policies" / "default.yaml")
    assert policy.for_segment("extractive-docs").drafter("prompt_lookup").k_max == 16
    # no segment is switched off by hand: the controller earns that from data (the rule is a commented example)
    assert all(rule.force is None for rule in policy.document.segments)


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("defaults:\n  max_batch_size: -1\n", 2, "defaults.max_batch_size"),
        ("defaults:\n  drafters:\n    draft: {k_min: 5, k_max: 2}\n", 3, "defaults.drafters.draft"),
        ("segments:\n  - match: x\n    forse: none\n", 3, "segments[0].forse"),
        ("defaults:\n  drafters:\n    medusa: {}\n", 3, "defaults.drafters.medusa[key]"),
        ("segments:\n  - force: none\n", 2, "segments[0].match"),
    ],
)
def test_bad_policy_names_line_and_field(tmp_path, text, line, field):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_policy(path)
    issues = [(i.line, i.field) for i in e.value.issues]
    assert (line, field) in issues, issues
    assert all(i.file == str(path) for i in e.value.issues)


def test_rule_that_breaks_k_bounds_after_merge_is_refused():
    with pytest.raises(ConfigError, match="k_min"):
        parse_policy(
            "defaults:\n  drafters:\n    draft: {k_max: 3}\n"
            "segments:\n  - match: x\n    drafters:\n      draft: {k_min: 5}\n"
        )


def test_store_keeps_old_policy_when_reload_fails(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    store = PolicyStore(load_policy(path))
    old = store.current.version
    path.write_text("defaults: {max_batch_size: oops}\n")
    assert store.file_changed()
    with pytest.raises(ConfigError):
        store.reload()
    assert store.current.version == old
    path.write_text(POLICY + "# v2\n")
    assert store.reload().version != old and store.current.version != old


def test_the_watcher_tries_a_refused_content_once(tmp_path):
    # a bad save is refused (and logged by the daemon) once; the watcher then waits for the file to change again
    path = tmp_path / "policy.yaml"
    path.write_text("defaults:\n  min_speedup: 1.1\n")
    store = PolicyStore(load_policy(path))
    assert not store.file_changed()
    for bad in ("defaults:\n  min_speedup: 0.5\n", b"defaults:\n  min_speedup: \xff\xfe\n", ""):
        path.write_bytes(bad.encode() if isinstance(bad, str) else bad)
        assert store.file_changed()
        with pytest.raises(ConfigError):  # not a UnicodeDecodeError traceback, whatever the bytes
            store.reload(settle_seconds=0.0)
        assert not store.file_changed(), "the same refused content must not be tried again"
        assert store.current.document.defaults.min_speedup == 1.1  # the policy in force stays
    path.write_text("defaults:\n  min_speedup: 1.2\n")
    assert store.file_changed()
    assert store.reload(settle_seconds=0.0).document.defaults.min_speedup == 1.2
    assert not store.file_changed()


def test_a_file_that_keeps_changing_is_not_loaded_half_written(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("defaults:\n  min_speedup: 1.1\n")
    store = PolicyStore(load_policy(path))
    writes = iter(f"defaults:\n  min_speedup: 1.{i}\n" for i in range(2, 100))

    def editor_still_writing(seconds: float) -> None:
        path.write_text(next(writes))

    with pytest.raises(ConfigError, match="kept changing"):
        read_stable_text(path, settle_seconds=0.0, sleep=editor_still_writing)
    assert store.current.document.defaults.min_speedup == 1.1
