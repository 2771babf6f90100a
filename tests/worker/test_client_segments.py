"""The segments a client may name (``client_segments``; issue 22: a client naming a new segment per request filled
the controller's segment cap, and every later new segment learned only as ``_overflow`` for an hour).

The rule itself, on a clock the test moves; tests/e2e/test_segment_flood.py has it over the real path."""

from __future__ import annotations

import pytest

from decoder.worker.client_segments import MAX_REMEMBERED, WINDOW_SECONDS, SegmentAdmission, SegmentRefused
from decoder.worker.config import ClientSegments


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, **bounds: object) -> SegmentAdmission:
    return SegmentAdmission(ClientSegments(**bounds), always=("default", "code"), clock=clock)  # type: ignore[arg-type]


def test_new_names_past_the_hours_budget_are_served_under_the_inferred_segment():
    clock = Clock()
    gate = admission(clock, new_per_hour=3)
    assert [gate.admit(f"made-up-{i}") for i in range(5)] == ["made-up-0", "made-up-1", "made-up-2", None, None]
    assert gate.ignored == 2
    assert gate.admit("made-up-1") == "made-up-1", "a name taken this hour is still taken"
    assert gate.admit("code") == "code" and gate.admit("default") == "default", "what the worker infers: never counted"
    clock.now += WINDOW_SECONDS / 2
    assert gate.admit("made-up-3") is None, "the hour is not over"
    clock.now += WINDOW_SECONDS / 2
    assert gate.admit("made-up-3") == "made-up-3", "an hour after the first names were taken, their places are free"
    assert gate.admit("made-up-1") == "made-up-1", "seen half an hour ago: still taken"
    clock.now += WINDOW_SECONDS * 2
    assert [gate.admit(f"later-{i}") for i in range(4)] == ["later-0", "later-1", "later-2", None]


def test_names_and_the_switch_refuse_with_the_setting_named():
    clock = Clock()
    gate = admission(clock, names=["tenant-*", "batch"])
    assert gate.admit("tenant-a") == "tenant-a" and gate.admit("batch") == "batch"
    with pytest.raises(SegmentRefused, match=r"'tenant' is not among .*\(client_segments\.names\)"):
        gate.admit("tenant")
    with pytest.raises(SegmentRefused, match=r"client_segments\.allowed is false"):
        admission(clock, allowed=False).admit("tenant-a")
    unbounded = admission(clock, new_per_hour=0)
    assert all(unbounded.admit(f"s{i}") == f"s{i}" for i in range(5000))
    assert len(unbounded._taken) == 0, "no bound: nothing to count"


def test_the_names_remembered_are_bounded():
    clock = Clock()
    gate = admission(clock, new_per_hour=0)
    for i in range(MAX_REMEMBERED + 10):
        gate.admit(f"s{i}")
    assert len(gate._seen) == MAX_REMEMBERED
    assert "s0" not in gate._seen and f"s{MAX_REMEMBERED + 9}" in gate._seen
