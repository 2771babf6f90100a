"""Hostile YAML files: each is refused quickly, in bounded memory, with file:line and a reason that quotes at
most a short piece of the file, never a traceback. The policy loader (controller.decision.policy.load_policy) is the
real path a policy reload takes."""

from __future__ import annotations

import itertools
import os
import string
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from controller.decision.policy import load_policy, parse_policy
from specd_api.yaml_config import (
    ConfigError,
    YamlLimits,
    load_yaml_model,
    parse_yaml_model,
    read_stable_text,
)


class Anything(BaseModel):
    model_config = ConfigDict(extra="allow")


def billion_laughs() -> str:
    """451 bytes: ten mappings, each merging nine copies of the one before (`<<: [*a, *a, ...]`). Expanded, the
    last holds about 5 * 9**9 (2.2e9) nodes; PyYAML flattens merge keys into lists that long before building
    anything (before the limits: > 20 s and > 1.5 GB RSS, still growing, when stopped)."""
    names = string.ascii_lowercase
    lines = ["a: &a {x: 1, y: 2}"]
    for previous, name in itertools.pairwise(names[:10]):
        lines.append(f"{name}: &{name} {{<<: [{','.join([f'*{previous}'] * 9)}], {name}{name}: 1}}")
    return "\n".join(lines) + "\n"


def refused(load: Callable[[], object]) -> tuple[str, float, int]:
    """(the ConfigError's text, seconds, peak traced bytes) of a load that must be refused."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as caught:
            load()
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return str(caught.value), seconds, peak


def test_a_billion_laughs_file_is_refused_at_once(tmp_path: Path):
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size == 451
    message, seconds, peak = refused(lambda: load_policy(path))
    # Line 6 (f): its merge list of nine *e is the first node past 100,000 expanded (9 x e's ~18,000); e's is
    # within the limit.
    assert message == (
        f"{path}:6: aliases expand this sequence to more than 100000 nodes (the limit); anchors and merge keys (<<) "
        "may repeat content, not multiply it"
    )
    assert seconds < 1.0, f"{seconds:.2f} s"
    assert peak < 5 << 20, f"{peak / 2**20:.1f} MiB traced"


def test_a_50_mb_file_is_refused_without_reading_it(tmp_path: Path):
    path = tmp_path / "big.yaml"
    rule = b"  - {match: tenant-0, max_batch_size: 4}\n"
    with path.open("wb") as file:
        file.write(b"segments:\n")
        file.write(rule * (50 * 2**20 // len(rule)))
    assert path.stat().st_size > 50 * 10**6
    message, seconds, peak = refused(lambda: load_policy(path))
    assert message == f"{path}: the file is larger than 524288 bytes (the limit); not read further"
    assert seconds < 1.0, f"{seconds:.2f} s"
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB traced: more than the 1 MiB limit was read"


@pytest.mark.parametrize(
    ("text", "expected", "why"),
    [
        pytest.param(
            "a: &a [1, *a]\n", "1: an alias refers to a collection that contains it (a recursive structure)",
            "a list holding itself would make validation recurse forever", id="recursive",
        ),
        pytest.param(
            "x: " + "[" * 100_000 + "]" * 100_000 + "\n", "1: nested more than 64 levels deep (the limit)",
            "the scanner reads ahead over open flow collections: 100,000 levels would take it hours (and compose "
            "would end in a RecursionError)", id="deep-flow",
        ),
        pytest.param(
            "".join(f"{' ' * i}k{i}:\n" for i in range(100)) + " " * 100 + "v\n",
            "64: nested more than 64 levels deep (the limit)",
            "block nesting is counted while composing; a key is a level below its mapping: the 64th mapping starts on "
            "line 64 and its key k63 is the 65th level", id="deep-block",
        ),
        pytest.param(
            "a: &a 1\nb: [" + ", ".join(["*a"] * 1001) + "]\n",
            "2: more than 1000 aliases (*name) in one file (the limit)",
            "1,001 alias uses: one past max_aliases, on the line of the list that holds them", id="aliases",
        ),
        pytest.param(
            "x:\n" + "".join(f"  - {i}\n" for i in range(1000)), "999: more than 1000 nodes in one file (the limit)",
            "counted while composing: the mapping, its key, the list and 997 items make 1,000; item 997 (line 999) "
            "is the 1,001st",
            id="nodes",
        ),
    ],
)  # fmt: skip
def test_a_file_past_a_limit_is_refused_with_its_line(text: str, expected: str, why: str):
    limits = YamlLimits(max_nodes=1000)  # the default (100,000) would take a 200 KB list to reach
    message, seconds, _ = refused(lambda: parse_yaml_model(text, Anything, "p.yaml", limits))
    assert message == f"p.yaml:{expected}", why
    assert seconds < 1.0, (why, seconds)


def test_anchors_that_repeat_content_are_welcome():
    """The limit is on multiplication: 200 rules merging one anchor are 200 copies, well within it."""
    rules = "".join(f"  - {{<<: *common, match: tenant-{i}}}\n" for i in range(200))
    text = f"x-common: &common {{max_batch_size: 2, hysteresis: 0.1}}\nsegments:\n{rules}"
    segments = parse_yaml_model(text, Anything, "p.yaml").model_dump()["segments"]
    assert len(segments) == 200 and segments[199] == {"max_batch_size": 2, "hysteresis": 0.1, "match": "tenant-199"}


@pytest.mark.parametrize(
    ("limit", "size", "refused_", "why"),
    [(100, 100, False, "at the limit: read whole"), (100, 101, True, "one byte past it: refused")],
)
def test_the_size_limit_is_exact(tmp_path: Path, limit: int, size: int, refused_: bool, why: str):
    path = tmp_path / "x.yaml"
    path.write_text("x: " + "a" * (size - 4) + "\n")
    assert path.stat().st_size == size
    load = lambda: load_yaml_model(path, Anything, YamlLimits(max_bytes=limit))  # noqa: E731
    if refused_:
        with pytest.raises(ConfigError, match="larger than 100 bytes"):
            load()
    else:
        load()


def test_a_non_utf8_file_is_one_line_naming_the_byte(tmp_path: Path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("defaults:\n  force: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text at byte 22 (invalid continuation byte)"  # 10 + 12 bytes


def test_a_symlinked_file_is_never_echoed_whole(tmp_path: Path):
    """A policy path that is a symlink to another file (here one long line, as a secret or a minified file
    would be): the error quotes at most 64 characters of it."""
    secret = tmp_path / "secret.txt"
    token = "sk-" + "0123456789abcdef" * 640  # 10 KB on one line (a key past 1,024 characters must be explicit: ?)
    secret.write_text(f"? {token}\n: 1\n")
    link = tmp_path / "policy.yaml"
    os.symlink(secret, link)
    with pytest.raises(ConfigError) as caught:
        load_policy(link)
    message = str(caught.value)
    assert message.startswith(f"{link}:1: ") and "Extra inputs are not permitted" in message
    assert token[:64] in message and token[:65] not in message
    assert len(message) < 300


def test_a_duplicate_long_key_is_quoted_short():
    key = "k" * 10_000
    with pytest.raises(ConfigError) as caught:
        parse_yaml_model(f"? {key}\n: 1\n? {key}\n: 2\n", Anything, "p.yaml")
    assert str(caught.value) == f"p.yaml:3: {'k' * 64!r}... (10000 characters): duplicate key {'k' * 64!r}... " \
                               "(10000 characters) (first at line 1)"  # fmt: skip


# -- reading a file that is being written --------------------------------------------------------------


def test_a_stable_read_waits_for_the_write_to_finish(tmp_path: Path):
    """An editor that writes in place: the first read sees half the file, the next (after the settle time) the
    rest, the third agrees with the second; the half is never returned."""
    path = tmp_path / "policy.yaml"
    whole = "defaults:\n  max_batch_size: 4\nsegments:\n  - {match: code, force: draft, force_k: 3}\n"
    path.write_text(whole[:30])
    writes = iter([whole])
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        next_text = next(writes, None)
        if next_text is not None:
            path.write_text(next_text)

    assert read_stable_text(path, settle_seconds=0.2, sleep=sleep) == whole
    assert sleeps == [0.2, 0.2]


def test_a_file_that_never_settles_is_refused(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    path.write_text("segments: []\n")
    count = iter(range(100))
    with pytest.raises(ConfigError) as caught:
        read_stable_text(path, max_reads=4, sleep=lambda _: path.write_text(f"# {next(count)}\nsegments: []\n"))
    assert str(caught.value) == f"{path}: the file kept changing while it was read (4 reads 0.25 s apart); not loaded"


def test_text_handed_in_whole_is_bounded_too():
    """parse_yaml_model (and so decision.policy.parse_policy) takes text already read: it is measured in UTF-8
    bytes before it is composed. 200,000 'é' are 400,000 bytes: within 524,288; 300,000 are not."""
    parse_yaml_model("x: " + "é" * 200_000 + "\n", Anything, "p.yaml")
    message = refused(lambda: parse_yaml_model("x: " + "é" * 300_000 + "\n", Anything, "p.yaml"))[0]
    assert message == "p.yaml: the text is larger than 524288 bytes (the limit)"


def test_an_unknown_drafter_name_is_quoted_short():
    """A policy's drafter names are keys, so pydantic puts an unknown one in the field path: cut to 64 characters
    (a plain YAML key can be 1,024 characters long)."""
    name = "d" * 1000
    with pytest.raises(ConfigError) as caught:
        parse_policy(f"defaults:\n  drafters:\n    {name}: {{k_max: 2}}\n", "p.yaml")
    assert str(caught.value) == (
        f"p.yaml:3: defaults.drafters.{'d' * 64!r}... (1000 characters)[key]: Input should be 'draft', "
        "'prompt_lookup', 'chain', 'suffix' or 'eagle'"
    )
