"""The segments a client may name (``client_segments``: a client naming a new segment per request must not fill the
controller's segment cap, where every later new segment would learn only as ``_overflow`` for an hour).

The rule itself, on a clock the test moves; tests/e2e/test_segment_flood.py has it over the real path."""

from __future__ import annotations

import threading

import pytest

from decoder.worker.client_segments import MAX_REMEMBERED, SegmentAdmission, SegmentRefused
from decoder.worker.config import ClientSegments

WINDOW = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, **bounds: object) -> SegmentAdmission:
    return SegmentAdmission(ClientSegments(**bounds), always=("default", "code"), clock=clock)  # type: ignore[arg-type]


def test_a_worker_holds_at_most_max_names_and_a_silent_name_gives_its_place_back():
    clock = Clock()
    gate = admission(clock, max_names=3, max_names_per_host=3, window_seconds=WINDOW)
    assert [gate.admit(f"made-up-{i}", "a") for i in range(5)] == ["made-up-0", "made-up-1", "made-up-2", None, None]
    assert gate.ignored == 2
    assert gate.admit("made-up-1", "b") == "made-up-1", "a name held is taken, from any address"
    assert gate.admit("code", "a") == "code" and gate.admit("default", "a") == "default", "inferred names: no place"
    clock.now += WINDOW - 1
    assert gate.admit("made-up-0", "a") == "made-up-0"  # named again: kept
    clock.now += 2  # made-up-2 has been silent a whole window (made-up-1 too: named at the start)
    assert gate.admit("new", "a") == "new"
    assert set(gate.held()) == {"a"} and gate.held()["a"] == 2  # made-up-0 and new


def test_names_kept_alive_never_take_more_than_max_names():
    """A rate of new names was not a bound: a client naming each of its names again every half hour kept them all
    and added the hour's budget every hour (1,200 live names on one worker after 12 hours, past the controller's
    cap of 1,000). The places a worker holds are bounded, however long the client keeps at it."""
    clock = Clock()
    gate = admission(clock, max_names=100, max_names_per_host=100, new_host_share=0.0, window_seconds=WINDOW)
    mine: list[str] = []
    for hour in range(12):
        for half in range(2):
            for name in mine:
                gate.admit(name, "flooder")  # kept alive
            for i in range(100):
                if gate.admit(name := f"h{hour}-{half}-{i}", "flooder") is not None:
                    mine.append(name)
            clock.now += WINDOW / 2
        assert sum(gate.held().values()) <= 100
    assert len(mine) == 100


def test_one_address_takes_its_share_and_leaves_the_others_room():
    clock = Clock()
    gate = admission(clock, max_names=10, max_names_per_host=4, window_seconds=WINDOW)
    assert sum(gate.admit(f"flood-{i}", "10.0.0.9") is not None for i in range(50)) == 4
    assert [gate.admit(f"tenant-{i}", "10.0.0.1") for i in range(2)] == ["tenant-0", "tenant-1"]
    assert gate.held() == {"10.0.0.9": 4, "10.0.0.1": 2}


def test_a_few_addresses_at_their_share_leave_room_for_new_ones():
    """Four addresses at 25 names each must not take all 100 places, leaving a new tenant served under an inferred
    segment: an address holding names takes a new place only while more than a quarter of the places are free."""
    clock = Clock()
    gate = admission(clock, max_names=100, max_names_per_host=25, window_seconds=WINDOW)
    taken = [sum(gate.admit(f"flood-{h}-{i}", f"10.0.0.{h}") is not None for i in range(50)) for h in range(1, 5)]
    assert taken == [25, 25, 25, 1], "the fourth address, holding none, takes one kept place; then it holds one"
    assert [gate.admit(f"tenant-{i}", f"10.1.0.{i}") for i in range(3)] == ["tenant-0", "tenant-1", "tenant-2"]


def test_names_and_the_switch_refuse_with_the_setting_named():
    clock = Clock()
    gate = admission(clock, names=["tenant-*", "batch"])
    assert gate.admit("tenant-a", "h") == "tenant-a" and gate.admit("batch", "h") == "batch"
    with pytest.raises(SegmentRefused, match=r"'tenant' is not among .*\(client_segments\.names\)"):
        gate.admit("tenant", "h")
    with pytest.raises(SegmentRefused, match=r"client_segments\.allowed is false"):
        admission(clock, allowed=False).admit("tenant-a", "h")


def test_without_a_bound_the_names_remembered_are_still_bounded():
    clock = Clock()
    gate = admission(clock, max_names=0)
    assert all(gate.admit(f"s{i}", "h") == f"s{i}" for i in range(MAX_REMEMBERED + 10))
    assert gate.held() == {"h": MAX_REMEMBERED}


def test_admission_from_many_threads_keeps_the_bound():
    gate = admission(Clock(), max_names=50, max_names_per_host=50, new_host_share=0.0)

    def name_many(worker: int) -> None:
        for i in range(200):
            gate.admit(f"t{worker}-{i}", f"host-{worker % 2}")

    threads = [threading.Thread(target=name_many, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(gate.held().values()) == 50 and gate.ignored == 8 * 200 - 50
