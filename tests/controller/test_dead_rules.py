"""Policy rules that can never apply are refused, naming the rule and what shadows it: a repeated match, a glob an
earlier glob covers, a match no segment name can equal. ``covers`` is checked against every name its globs can
match over a small alphabet, so a live rule is never called dead."""

from __future__ import annotations

import fnmatch
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.decision.policy import parse_policy
from controller.decision.rule_globs import covers, dead_rules
from specd_api.yaml_config import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("matches", "dead", "why"),
    [
        (["tenant-a", "tenant-a"], 1, "segments[0] has the same match"),
        (["tenant-*", "tenant-a*"], 1, "segments[0] (match 'tenant-*') matches every name it does"),
        (["*", "code"], None, ""),  # an exact name beats every glob
        (["*-eval", "a?-eval"], 1, "segments[0]"),
        (["a?-eval", "*-eval"], None, ""),  # the broader one after the narrower still applies elsewhere
        (["tenant a"], 0, "no segment name equals it"),
        (["tenant!*"], 0, "no segment name holds '!'"),
        (["a" * 129], 0, "no segment name equals it"),
        (["?" * 129 + "*"], 0, "longer than 128"),
        (["t-[ab]*", "t-a*"], None, ""),  # a class is never claimed to cover: unreported, never wrongly
    ],
)
def test_dead_rules_and_why(matches: list[str], dead: int | None, why: str) -> None:
    found = dead_rules(matches)
    if dead is None:
        assert found == {}
    else:
        assert list(found) == [dead] and why in found[dead], found


def test_a_policy_with_a_dead_isolation_rule_is_refused_by_policy_check(tmp_path: Path) -> None:
    text = 'segments:\n  - match: "tenant-*"\n    min_speedup: 1.1\n  - match: "tenant-a*"\n    force: none\n'
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"segments\[1\] \(match 'tenant-a\*'\) can never apply"):
        parse_policy(text)
    checked = subprocess.run([sys.executable, "-m", "specd", "policy", "check", str(path)], capture_output=True,
                             text=True, cwd=REPO)  # fmt: skip
    assert checked.returncode == 1
    assert f"{path}:1: segments:" in checked.stderr and "segments[0] (match 'tenant-*')" in checked.stderr


def test_the_shipped_policy_has_no_dead_rule() -> None:
    parse_policy((REPO / "policies" / "default.yaml").read_text())


ALPHABET = "ab"
NAMES = ["".join(p) for n in range(6) for p in itertools.product(ALPHABET, repeat=n)]
globs = st.text(alphabet=ALPHABET + "*?", min_size=0, max_size=5)


@settings(max_examples=600, deadline=None)
@given(general=globs, specific=globs)
def test_covers_only_what_it_covers(general: str, specific: str) -> None:
    """Every name up to 5 characters over the alphabet that ``specific`` matches, ``general`` matches too, whenever
    ``covers`` says so (a glob of at most 5 pieces that differs is told apart within 5 characters)."""
    if covers(general, specific):
        for name in NAMES:
            if fnmatch.fnmatchcase(name, specific):
                assert fnmatch.fnmatchcase(name, general), (general, specific, name)


@pytest.mark.parametrize(("general", "specific"), [("a*", "ab*"), ("*b", "a*b"), ("a?", "ab"), ("*a*", "*ba*"),
                                                    ("a*b*", "a?b*"), ("**", "a")])  # fmt: skip
def test_covers_finds_the_covers(general: str, specific: str) -> None:
    assert covers(general, specific)
