"""The controller's idle cost at scale (issue 22: 1,000 segments and 256 streams under 5 % of a core): a refresh reads
only what a report may have changed, and a decision table is recomputed, and sent, only when what it is made of
moved. Against real servers (the store's tests' fixtures) and a running daemon (the decision tables' ones)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import redis

from controller.store import Snapshot, TelemetryStore
from controller.table_publisher import HEARTBEAT_PERIODS, DecisionPublisher
from tests.controller.test_client import started
from tests.controller.test_decision_tables import FIXED_NOW, client_config, daemon_config, learned, stream_of, teach
from tests.controller.test_store import T0, FakeClock, make_store, small
from tests.daemons import running

BUCKET = 10.0  # the stores here: 10 s buckets, one decay step each (the controller's setting), a 6-bucket window


def spied(store: TelemetryStore) -> list[str]:
    """The keys each ``_read_buckets`` call asks Redis for, as they are asked."""
    asked: list[str] = []
    read = store._read_buckets

    def spy(keys: list[str], *args: object, **kwargs: object) -> dict[str, dict[str, float]]:
        asked.extend(keys)
        return read(keys, *args, **kwargs)  # type: ignore[arg-type]

    store._read_buckets = spy  # type: ignore[method-assign]
    return asked


def refresh(store: TelemetryStore, previous: Snapshot | None) -> Snapshot:
    """What the learner's refresh does: the active segments (with their last report times), then the snapshot."""
    return store.read_snapshot(store.active_segments(), previous=previous)


def a_store(client: redis.Redis, prefix: str, clock: Callable[[], float]) -> TelemetryStore:
    return make_store(client, prefix, clock, bucket_seconds=BUCKET, decay_step_seconds=BUCKET, window_buckets=6)


def segment_keys(store: TelemetryStore, asked: list[str], segment: str) -> list[str]:
    return [k for k in asked if k.startswith(store.keys.segment_bucket(segment, 0).rsplit(":", 1)[0] + ":")]


def test_a_segment_no_report_reached_is_neither_read_nor_recounted(redis_client: redis.Redis, prefix: str) -> None:
    """Was: every refresh built every segment's key for every bucket of the window and read its current bucket, for
    1,000 segments 15-22 % of a core with nothing reported."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a"), small("b")])
    clock.now = T0 + 12  # a new decay step: read whole
    first = refresh(store, None)
    asked = spied(store)
    clock.now = T0 + 15  # the same step; the last report (T0 + 1) is a whole margin before the previous read
    again = refresh(store, first)
    assert segment_keys(store, asked, "a") == [] and segment_keys(store, asked, "b") == [], "no segment key read"
    assert again.segments["a"] is first.segments["a"] and again.segments["b"] is first.segments["b"]
    assert again.series["a"] is first.series["a"]


def test_a_reported_segment_reads_only_the_buckets_a_write_may_have_reached(
    redis_client: redis.Redis, prefix: str
) -> None:
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a"), small("b")])
    clock.now = T0 + 12
    first = refresh(store, None)
    clock.now = T0 + 14
    store.ingest("r2", [small("b", rounds=3)])
    asked = spied(store)
    clock.now = T0 + 15
    after = refresh(store, first)
    bucket = store.bucket(T0)
    assert segment_keys(store, asked, "a") == [], "a: no report since"
    assert segment_keys(store, asked, "b") == [store.keys.segment_bucket("b", b) for b in (bucket, bucket + 1)], (
        "from one margin (a bucket period) before the previous read: buckets 0 and 1, not the window's 6"
    )
    assert after.segments["a"] is first.segments["a"]
    assert after.segments["b"].rounds == first.segments["b"].rounds + 3


def test_a_late_write_of_a_replica_whose_clock_is_behind_is_seen_at_the_next_refresh(
    redis_client: redis.Redis, prefix: str
) -> None:
    """Another replica, 7 s behind (within the margin), writes into a bucket already closed here. Was: a closed bucket
    was read again only once a bucket period, so the write showed up to 10 s late."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a")])
    clock.now = T0 + 12
    first = refresh(store, None)
    behind = a_store(redis_client, prefix, FakeClock(T0 + 6))  # its bucket: the one closed here at T0 + 10
    behind.ingest("late", [small("a", rounds=5)])
    clock.now = T0 + 13
    after = refresh(store, first)
    assert after.segments["a"].rounds == first.segments["a"].rounds + 5


def test_counts_read_in_part_equal_a_whole_read_across_decay_steps(redis_client: redis.Redis, prefix: str) -> None:
    """The incremental reads (kept, read in part, a decay step re-weighing the kept fields, the window moving on)
    give the counts a store reading everything afresh gives, refresh after refresh."""
    clock = FakeClock(T0 + 1)
    store = make_store(redis_client, prefix, clock, bucket_seconds=BUCKET, decay_step_seconds=BUCKET,
                       window_buckets=3, half_life_seconds=BUCKET)  # fmt: skip
    fresh = make_store(redis_client, prefix, clock, bucket_seconds=BUCKET, decay_step_seconds=BUCKET,
                       window_buckets=3, half_life_seconds=BUCKET)  # fmt: skip
    snapshot = None
    for t in range(1, 60, 3):  # 20 refreshes over 6 buckets: each bucket leaves the 3-bucket window in turn
        clock.now = T0 + t
        if t % 9 == 1:
            store.ingest(f"r{t}", [small("a", rounds=t), small("b", k=3)])
        if t % 12 == 4:
            store.ingest(f"q{t}", [small("b", rounds=2)])
        snapshot = refresh(store, snapshot)
        whole = fresh.read_snapshot(sorted(snapshot.segments))
        assert snapshot.segments == whole.segments, t
        assert snapshot.series == whole.series, t
        assert snapshot.costs == whole.costs, t


def test_a_refresh_reads_in_chunks_and_gives_the_interpreter_back_between_them(
    redis_client: redis.Redis, prefix: str, monkeypatch
) -> None:
    """Was: one pipeline for every bucket read, its replies parsed with the interpreter held (~100 ms at 1,000
    segments reported in the last minute, at every refresh: Decide's p99 21-27 ms at 1,000 segments and 256
    streams). Now no round trip asks for more than a chunk of keys, the refresh paces between two of them, and the
    counts are those of an unpaced read."""
    import controller.store as store_module

    events: list[tuple[str, int]] = []  # ("read", keys in one round trip) and ("pace", 0), in order

    class CountingPacer:
        def __call__(self) -> None:
            events.append(("pace", 0))

    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    segments = [f"chunked-{i}" for i in range(40)]
    store.ingest("r1", [small(s, rounds=1 + i % 3) for i, s in enumerate(segments)])
    clock.now = T0 + 5
    unpaced = store.read_snapshot(store.active_segments())  # read whole: 6 buckets of 40 segments, 246 keys
    monkeypatch.setattr(store_module, "Pacer", CountingPacer)
    pipeline = store.client.pipeline

    def counted_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        def counted_execute(*a: Any, **k: Any) -> Any:
            events.append(("read", len(pipe.command_stack)))
            return execute(*a, **k)

        pipe.execute = counted_execute  # type: ignore[method-assign]
        return pipe

    store.client.pipeline = counted_pipeline  # type: ignore[method-assign]
    try:
        paced = store.read_snapshot(store.active_segments())
    finally:
        del store.client.pipeline
    reads = [n for kind, n in events if kind == "read"]
    assert sum(reads) == 6 * len(segments) + 6, "every bucket of the window, and the costs'"
    assert max(reads) <= 64, f"round trips of {max(reads)} keys: their replies are parsed in one go"
    between = [kind for kind, _ in events]
    assert ("read", "read") not in set(pairwise(between)), "two round trips with no pause"
    assert paced.segments == unpaced.segments and paced.series == unpaced.series and paced.costs == unpaced.costs


def test_an_idle_refresh_wakes_no_stream_and_computes_no_table_key(embedded_redis_url, prefix, tmp_path) -> None:
    """Was: every refresh sent every stream a message (256 threads woken each second to say nothing), and computed
    every segment's table key, priors included (PriorModel.predict, three drafters, for 1,000 segments a second)."""
    refresh_s = 0.1
    with running(daemon_config(embedded_redis_url, tmp_path, prefix), clock=lambda: FIXED_NOW) as daemon:
        segments = ["idle-a", "idle-b"]
        with started(client_config(daemon.address, watch=())) as reporter:
            for segment in segments:
                teach(reporter, segment)
            learned(daemon, reporter, segments, 32)
        stream = stream_of(daemon.address)
        first = next(stream)
        assert sorted(t.segment for t in first.segments) == segments
        assert first.refresh_seconds == HEARTBEAT_PERIODS * refresh_s, "what the worker's quiet-stream check reads"
        publisher, controller = daemon.publisher, daemon.controller
        assert publisher is not None and controller is not None
        publisher.rebuild()  # settled: what the first build remembered (each segment's batch-1 plan) is in the keys
        estimated: list[object] = []
        original = controller.estimate_inputs

        def counted(*args: Any) -> Any:
            estimated.append(args)
            return original(*args)

        controller.estimate_inputs = counted  # type: ignore[method-assign]
        try:
            publisher.rebuild()
            publisher.rebuild()
        finally:
            controller.estimate_inputs = original  # type: ignore[method-assign]
        assert estimated == [], "nothing moved: no table key (no prior) computed"
        start = time.monotonic()
        second = next(stream)
        waited = time.monotonic() - start
        stream.cancel()
        assert not second.segments and not second.removed, "a heartbeat"
        assert waited > 2 * refresh_s, f"the next message came after {waited:.2f} s: a refresh without news woke it"


def test_a_rebuild_that_moved_nothing_wakes_no_stream_thread() -> None:
    """Was: every refresh woke every stream's thread (256 of them taking the interpreter and the condition's lock in
    turn, once a second) to find that nothing it waits for had moved. Now only a moved version (or the close) does."""
    learner = SimpleNamespace(segments=lambda: [], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    publisher = DecisionPublisher(controller, refresh_seconds=60.0, max_watchers=4)  # type: ignore[arg-type]
    checks: list[bool] = []  # each time the waiting stream's thread looked at its predicate
    moved_since = publisher._moved_since

    def counted(drafters: tuple[str, ...], version: int) -> Callable[[], bool]:
        predicate = moved_since(drafters, version)

        def check() -> bool:
            checks.append(result := predicate())
            return result

        return check

    publisher._moved_since = counted  # type: ignore[method-assign]
    stream = publisher.watch(("draft",), lambda: True)
    assert next(stream).full
    publisher.rebuild()  # the first build with a header: the version moves
    assert not next(stream).full, "that move, sent"
    checks.clear()
    messages: list[Any] = []
    waiting = threading.Thread(target=lambda: messages.append(next(stream, None)), daemon=True)
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while not checks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checks == [False], "the stream waits"
        for _ in range(5):
            publisher.rebuild()  # nothing moved
        time.sleep(0.2)
        assert checks == [False], f"woken {len(checks) - 1} times by rebuilds that moved nothing"
        learner.stale = True
        publisher.rebuild()  # the staleness moved: the stream sends it
        waiting.join(10)
        assert checks[-1] is True and messages and messages[0] is not None and messages[0].stale
    finally:
        publisher.close()  # a stream still waiting (the test failed) ends now, not at its heartbeat
        waiting.join(10)


def test_a_table_build_gives_the_interpreter_back_between_segments(
    embedded_redis_url, prefix, tmp_path, monkeypatch
) -> None:
    """A decay step rebuilds every segment's table (seconds of CPU at 1,000 segments, on one thread): Decide's p99
    across the step was 28 ms at 300 segments, 4.5-5.6 ms with the build paced (a pause between segments)."""
    import controller.table_publisher as table_publisher

    paced: list[int] = []

    class CountingPacer:
        def __call__(self) -> None:
            paced.append(1)

    monkeypatch.setattr(table_publisher, "Pacer", CountingPacer)
    with running(daemon_config(embedded_redis_url, tmp_path, prefix), clock=lambda: FIXED_NOW) as daemon:
        segments = ["paced-a", "paced-b", "paced-c"]
        with started(client_config(daemon.address, watch=())) as reporter:
            for segment in segments:
                teach(reporter, segment)
            learned(daemon, reporter, segments, 32)
        paced.clear()
        stream = stream_of(daemon.address)  # a drafter set no build has seen: every segment's table is built
        assert len(next(stream).segments) == len(segments)
        stream.cancel()
        assert len(paced) >= len(segments)
