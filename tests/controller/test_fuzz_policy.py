"""The policy loader under hostile files (hypothesis; tests/controller/yaml_strategies.py draws them): whatever the
bytes, the outcome is a loaded policy or a ConfigError whose every line names the file (and the line, where one is
known) in one short, printable line; never another exception, never a hang. Run counts: `pytest
--hypothesis-show-statistics tests/controller/test_fuzz_policy.py`; tests/fuzzing.py says how to draw more."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import example, given

from controller.decision.policy import PolicyDocument, load_policy
from specd_api.yaml_config import ConfigError
from tests.controller.yaml_strategies import (
    alias_documents,
    mutated_default_documents,
    mutated_default_texts,
    policy_files,
    random_documents,
)
from tests.fuzzing import fuzz_settings

MAX_SECONDS = 5.0  # the slowest file the limits admit (512 KiB) composes in about 3 s; these are far smaller
MAX_LINE_CHARS = 1_000  # a message line: the path, a line number, a field path and a message, each bounded


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-policy") / "policy.yaml"


def check_load(path: Path, data: bytes) -> None:
    """Load ``data`` from ``path``: a policy, or a ConfigError of one printable line per issue, each naming the file."""
    path.write_bytes(data)
    started = time.perf_counter()
    try:
        policy = load_policy(path)
    except ConfigError as e:
        lines = str(e).split("\n")
        assert len(lines) == len(e.issues) >= 1, str(e)
        last_line = data.count(b"\n") + 1
        for issue, line in zip(e.issues, lines, strict=True):
            assert issue.file == str(path)
            assert issue.line is None or 1 <= issue.line <= last_line, issue
            assert issue.message, issue
            assert line.startswith(f"{path}:"), line
            assert len(line) <= MAX_LINE_CHARS, line
            assert line.isprintable(), f"not one printable line (a gRPC status and a log line carry it): {line!r}"
            line.encode("utf-8")
    else:
        assert isinstance(policy.document, PolicyDocument)
        for rule in policy.document.segments:
            policy.for_segment(rule.match)  # every rule resolves against the defaults
        policy.for_segment("fuzz-segment")
    elapsed = time.perf_counter() - started
    assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s to load {len(data)} bytes"


@given(data=policy_files)
# Inputs that can raise past the loader, or break the one-line message, unless the loader catches them:
@example(data=b"\x00")  # PyYAML's reader refuses the character while the loader is built: a bare ReaderError
@example(data=b"defaults:\n  min_speedup: !!int 0.6\n")  # a tag its value cannot have: a ValueError
@example(data=b"!!bool defaults: {}\n")  # ... on a key, read before construction: a KeyError
@example(data=b"defaults:\n  min_speedup: !!timestamp soon\n")  # an AttributeError
@example(data=b'"\\uD7FC": null\n')  # an unprintable key, echoed raw into the field path
@example(data=b'"\\e[31m\\n": 1\n')  # a terminal escape and a newline in a key: one line, quoted
@fuzz_settings(300)
def test_any_file_loads_or_is_refused_with_file_and_line(policy_path: Path, data: bytes):
    check_load(policy_path, data)


@given(data=mutated_default_documents())
@fuzz_settings(150)
def test_the_shipped_policy_with_wrong_types_and_out_of_range_numbers(policy_path: Path, data: bytes):
    check_load(policy_path, data)


@given(data=mutated_default_texts())
@fuzz_settings(150)
def test_the_shipped_policy_cut_spliced_and_retagged(policy_path: Path, data: bytes):
    check_load(policy_path, data)


@given(data=random_documents())
@fuzz_settings(100)
def test_random_documents(policy_path: Path, data: bytes):
    check_load(policy_path, data)


@given(data=alias_documents())
@fuzz_settings(60)
def test_anchors_aliases_and_merge_keys(policy_path: Path, data: bytes):
    check_load(policy_path, data)


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("defaults:\n  prior_strength: .inf\n", 2, "defaults.prior_strength"),  # hung every Decide (betavariate)
        ("defaults:\n  min_speedup: .inf\n", 2, "defaults.min_speedup"),
        ("defaults:\n  hysteresis: .nan\n", 2, "defaults.hysteresis"),
        ("segments:\n  - match: x\n    drafters: {draft: {cost_ratio: .inf}}\n", 3, "segments[0].drafters.draft"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(policy_path: Path, text: str, line: int, field: str):
    """The bounds alone let infinity through, and decisions would hang on it: a number must be finite."""
    policy_path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_policy(policy_path)
    assert str(caught.value).startswith(f"{policy_path}:{line}: {field}"), str(caught.value)
    assert str(caught.value).endswith(": Input should be a finite number"), str(caught.value)
