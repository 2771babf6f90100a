"""A window's recount in one pass (``SegmentCounts.add_buckets`` over buckets ``clean_bucket`` cleaned as the store
read them) counts what adding each stored bucket in turn counts, bit for bit, whatever the stored values: corrupt
numbers, counters out of order, two names for one counter. And what it costs at a decay step: each field name is read
once a segment, not once a bucket."""

from __future__ import annotations

import copy
import gc
import json
import math

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.decision.counts import SegmentCounts, clean_bucket
from controller.storage import redis_schema as schema
from controller.storage.store import TelemetryStore
from tests.controller.test_store import T0, FakeClock, make_store, small

NAMES = [
    "k|draft|4|rounds", "k|draft|4|proposed", "k|draft|4|accepted", "k|draft|4|tokens", "k|draft|4|draft_s",
    "p|draft|0|offered", "p|draft|0|proposed", "p|draft|0|verified", "p|draft|0|accepted",
    "p|draft|1|offered", "p|draft|01|offered", "p|draft|1|proposed", "p|draft|1|verified", "p|draft|1|accepted",
    "q|ngram|0|offered", "q|ngram|0|proposed", "q|ngram|0|verified", "q|ngram|0|accepted",
    "c|draft|3", "t|1|-2", "r|draft|1|5", schema.UPDATED, "x|newer|schema", "p|draft|3000000|offered",
]  # fmt: skip
VALUE = st.one_of(
    st.floats(0, 1e6, allow_nan=False),
    st.sampled_from([0.0, 1.0, 3.0, -1.0, math.nan, math.inf, 2e15, 1.7e9]),
)
BUCKET = st.dictionaries(st.sampled_from(NAMES), VALUE, max_size=len(NAMES))
WINDOW = st.lists(st.tuples(BUCKET, st.floats(0.01, 2.0, allow_nan=False)), max_size=8)


def one_by_one(window: list[tuple[dict[str, float], float]]) -> SegmentCounts:
    counts = SegmentCounts()
    for fields, weight in window:
        counts.add_fields(fields, weight)
    return counts


def in_one_pass(window: list[tuple[dict[str, float], float]]) -> SegmentCounts:
    counts = SegmentCounts()
    counts.add_buckets((clean_bucket(fields), weight) for fields, weight in window)
    return counts


@settings(max_examples=400, deadline=None)
@given(window=WINDOW)
def test_a_window_counted_in_one_pass_equals_its_buckets_one_by_one(window):
    assert in_one_pass(window) == one_by_one(window)


@given(bucket=BUCKET)
def test_a_clean_bucket_is_kept_as_it_is_and_cleaning_is_idempotent(bucket):
    cleaned = clean_bucket(bucket)
    assert clean_bucket(cleaned) is cleaned
    writer = {name: 1.0 for name in ("p|draft|0|offered", "p|draft|0|proposed", "p|draft|0|verified")}
    assert clean_bucket(writer) is writer  # what a worker writes is clean: no copy


def names_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The field names the schema is asked to read from now on, in order."""
    read: list[str] = []
    parse = schema.segment_field

    def counted(name: str) -> object:
        read.append(name)
        return parse(name)

    monkeypatch.setattr(schema, "segment_field", counted)
    return read


def test_a_recount_reads_each_field_name_once(monkeypatch):
    """60 buckets of the same 20 names: 20 names read, not 1,200 (the parse is cached, its call is not free)."""
    read = names_read(monkeypatch)
    bucket = {name: 1.0 for name in NAMES[:20]}
    window = [(bucket, 0.5**b) for b in range(60)]
    counts = SegmentCounts()
    counts.add_buckets(window)
    assert len(read) <= len(bucket), len(read)


BUCKET_S = 10.0


def a_store(redis_client: redis.Redis, prefix: str, buckets: int) -> tuple[TelemetryStore, FakeClock]:
    """Segments a, b and c, each with a report in each of the first ``buckets`` buckets of a 12-bucket window."""
    clock = FakeClock(T0 + 1)
    store = make_store(redis_client, prefix, clock, bucket_seconds=BUCKET_S, decay_step_seconds=BUCKET_S,
                       window_buckets=12)  # fmt: skip
    for b in range(buckets):
        clock.now = T0 + 1 + b * BUCKET_S
        store.ingest(f"r{b}", [small(s, k=2 + b % 3, rounds=1 + b) for s in ("a", "b", "c")])
    return store, clock


def test_a_decay_step_recounts_each_segment_reading_each_field_name_once(redis_client, prefix, monkeypatch):
    """At a decay step every count's weight moves and each segment is recounted: the field names of its kept
    buckets are read once a segment, not once a bucket (at 1,000 segments x 60 buckets, that was seconds of CPU a
    step); only the buckets read afresh (a write may have reached them) are read one by one."""
    store, clock = a_store(redis_client, prefix, 12)
    before = store.read_snapshot(store.active_segments())
    read = names_read(monkeypatch)
    clock.now += BUCKET_S  # the next decay step: nothing new reported
    after = store.read_snapshot(store.active_segments(), previous=before)
    fresh_from = (before.taken_at - BUCKET_S) // BUCKET_S  # a bucket a late write may still reach: read again
    union = sum(len({n for _, fields in after.sources[s][2] for n in fields}) for s in after.segments)
    fresh = sum(len(fields) for s in after.segments for b, fields in after.sources[s][2] if b >= fresh_from)
    one_by_one = sum(len(fields) for s in after.segments for _, fields in after.sources[s][2])
    assert all(after.segments[s] != before.segments[s] for s in after.segments)  # recounted: every weight moved
    assert len(read) <= union + 2 * fresh < one_by_one, (len(read), union, fresh, one_by_one)
    for s in after.segments:  # the kept buckets are the earlier snapshot's fields, not copies
        earlier = dict(before.sources[s][2])
        kept = [(b, fields) for b, fields in after.sources[s][2] if b < fresh_from]
        assert kept and all(fields is earlier[b] for b, fields in kept), s


def tracked_under(root: object) -> int:
    """The objects the cyclic collector tracks that ``root`` reaches through its data (each counted once; classes
    and what they reach are not the data's)."""
    seen, todo, count = set(), [root], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, type):
            continue
        seen.add(id(o))
        if gc.is_tracked(o):
            count += 1
            todo.extend(gc.get_referents(o))
    return count


def test_a_window_of_buckets_is_a_few_tracked_objects_a_segment_not_one_a_bucket(redis_client, prefix):
    """What a segment's counts are made of stays out of the cyclic collector's way: its buckets' fields (dicts of
    numbers) are never tracked, and the window holding them is a few objects, however many buckets it has. One tuple
    a bucket, holding its dict, is never untracked, and at 1,000 segments x 60 buckets each full collection walked
    them all (~100 ms of the interpreter, two or three times a decay step)."""
    store, clock = a_store(redis_client, prefix, 12)
    before = store.read_snapshot(store.active_segments())
    clock.now += BUCKET_S
    after = store.read_snapshot(store.active_segments(), previous=before)
    gc.collect()
    for snapshot in (before, after):
        for s, (_, _, window) in snapshot.sources.items():
            assert len(window) >= 10, (s, len(window))
            assert tracked_under(window) <= 3, (s, tracked_under(window), len(window))
        assert tracked_under(snapshot.cost_sources) <= 4


def test_a_refresh_leaves_the_snapshot_before_it_as_it_was(redis_client, prefix):
    """The series a refresh keeps are the earlier snapshot's lists; one that grows is copied, never appended to in
    place (the drift watch tells an unmoved series by its identity)."""
    store, clock = a_store(redis_client, prefix, 4)
    clock.now = T0 + 51  # two buckets past the last report: every entry so far is kept at the next refresh
    before = store.read_snapshot(store.active_segments())
    series = copy.deepcopy(before.series)
    clock.now = T0 + 55
    store.ingest("late", [small("a", rounds=3)])
    after = store.read_snapshot(store.active_segments(), previous=before)
    assert before.series == series
    assert after.series["a"]["draft"][:-1] == series["a"]["draft"]
    assert after.series["a"]["draft"][-1][0] == T0 // BUCKET_S + 5
    assert after.series["b"]["draft"] is before.series["b"]["draft"]  # untouched: the same object


def test_the_benchmark_recounts_side_by_side(tmp_path):
    from benchmarks.decay_recount import main

    out = tmp_path / "recount.json"
    assert main(["--segments", "5", "--runs", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["segments"] == 5 and result["buckets"] == 60
    assert result["ratio_min"] <= result["one_by_one_over_one_pass"] <= result["ratio_max"]
