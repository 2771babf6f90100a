"""The controller's idle cost at scale (1,000 segments and 256 streams under 5 % of a core): a refresh reads
only what a report may have changed, and a decision table is recomputed, and sent, only when what it is made of
moved. Against real servers (the store's tests' fixtures) and a running daemon (the decision tables' ones)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis

from controller.serving.table_publisher import (
    HEARTBEAT_PERIODS,
    MAX_HEARTBEATS_PER_SECOND,
    DecisionPublisher,
    heartbeat_wait,
    segment_table,
)
from controller.storage.store import Snapshot, TelemetryStore
from specd_api.v1 import controller_pb2 as pb
from tests.controller.test_client import started
from tests.controller.test_decision_tables import (
    DRAFTERS,
    FIXED_NOW,
    client_config,
    daemon_config,
    learned,
    stream_of,
    teach,
)
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
    """A refresh with nothing reported reads nothing: building every segment's key for every bucket of the window
    and reading its current bucket at every refresh would cost, for 1,000 segments, 15-22 % of a core."""
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
    """Another replica, 7 s behind (within the margin), writes into a bucket already closed here. The write is read at
    the next refresh: a closed bucket read again only once a bucket period would show it up to 10 s late."""
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


def test_a_reported_segment_is_read_once_not_for_a_bucket_period_after(redis_client: redis.Redis, prefix: str) -> None:
    """The change marks say whether to read a segment: once read, it is kept until the next report, whoever's clock
    dated it. Deciding by a segment's last report time, with a bucket period's margin for other replicas' clocks,
    would read every reported segment again at every refresh for a minute after its report (1,000 segments: 2,000
    bucket reads a second, ~5 % of a core with nothing new). And with nothing changed, the segments set is not read
    either."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a"), small("b")])
    clock.now = T0 + 12
    first = refresh(store, None)
    clock.now = T0 + 13
    store.ingest("r2", [small("b", rounds=3)])
    clock.now = T0 + 14
    second = refresh(store, first)
    assert second.segments["b"].rounds == first.segments["b"].rounds + 3
    asked = spied(store)
    zrange = store.client.zrangebyscore
    set_reads: list[object] = []
    store.client.zrangebyscore = lambda *a, **k: set_reads.append(a) or zrange(*a, **k)  # type: ignore[method-assign]
    for t in (15, 16, 18):  # within a bucket period of b's report, the same decay step
        clock.now = T0 + t
        again = refresh(store, second)
        assert segment_keys(store, asked, "b") == [], f"b read again at T0 + {t} with no report since"
        assert again.segments["b"] is second.segments["b"] and again.segments["a"] is first.segments["a"]
        second = again
    assert set_reads == [], "the segments set read with no segment changed"


def test_a_segment_first_reported_between_refreshes_is_learned_at_the_next(
    redis_client: redis.Redis, prefix: str
) -> None:
    """The segments set is read again only when its count in the window is not the list's: a new segment is."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a")])
    clock.now = T0 + 12
    first = refresh(store, None)
    clock.now = T0 + 13
    refresh(store, first)
    store.ingest("r2", [small("c", rounds=2)])
    clock.now = T0 + 14
    after = refresh(store, first)
    assert sorted(after.segments) == ["a", "c"] and after.segments["c"].rounds == 2


def test_a_write_landing_while_a_refresh_reads_is_seen_by_the_next_one(redis_client: redis.Redis, prefix: str) -> None:
    """A report's segment parts land while a refresh is between its read of the change marks and its bucket reads:
    that refresh may miss them, the next must not (the mark is written after the parts, so the next finds it)."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    reader = a_store(redis_client, prefix, clock)  # another replica's refresh, running beside the ingest
    store.ingest("r1", [small("a")])
    clock.now = T0 + 12
    first = refresh(reader, None)
    write_parts = store._ingest_segments
    during: list[Snapshot] = []

    def parts_while_a_refresh_reads(calls: Any) -> None:
        during.append(refresh(reader, first))  # the refresh's marks and buckets, before the parts land
        write_parts(calls)

    store._ingest_segments = parts_while_a_refresh_reads  # type: ignore[method-assign]
    clock.now = T0 + 13
    store.ingest("r2", [small("a", rounds=4)])
    clock.now = T0 + 14
    after = refresh(reader, during[0])
    assert after.segments["a"].rounds == first.segments["a"].rounds + 4


def test_change_marks_lost_or_unreadable_mean_reading_every_recent_bucket(
    redis_client: redis.Redis, prefix: str
) -> None:
    """Marks flushed (a new epoch), or a key of the wrong type at their name (hand-edited data): a report still
    lands (the marks skipped and counted), and a refresh that cannot trust the marks reads every segment's recent
    buckets rather than keep counts a report may have changed."""
    clock = FakeClock(T0 + 1)
    store = a_store(redis_client, prefix, clock)
    store.ingest("r1", [small("a"), small("b")])
    clock.now = T0 + 12
    first = refresh(store, None)
    redis_client.delete(store.keys.changes(), store.keys.change_state())  # lost: the next mark starts a new epoch
    other = a_store(redis_client, prefix, clock)
    other.ingest("r2", [small("b", rounds=2)])
    clock.now = T0 + 13
    second = refresh(store, first)
    assert second.segments["b"].rounds == first.segments["b"].rounds + 2
    redis_client.delete(store.keys.change_state())
    redis_client.rpush(store.keys.change_state(), "x")  # a list where a hash belongs
    assert store.ingest("r3", [small("a", rounds=5)]).rounds == 5 and store.skipped.count >= 1
    clock.now = T0 + 14
    third = refresh(store, second)
    assert third.segments["a"].rounds == second.segments["a"].rounds + 5
    assert third.segments["b"].rounds == second.segments["b"].rounds


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
    """No round trip asks for more than a chunk of keys, the refresh paces between two of them, and the counts are
    those of an unpaced read. One pipeline for every bucket read, its replies parsed with the interpreter held, would
    hold it ~100 ms at 1,000 segments reported in the last minute, at every refresh."""
    import controller.storage.store as store_module

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
    """An idle refresh sends no stream a message (256 threads woken each second to say nothing) and computes no
    segment's table key, priors included (PriorModel.predict, three drafters, for 1,000 segments a second)."""
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
        later: list[Any] = []  # the messages of the next 1.2 s: heartbeats only, on the stream's grid (0.5 s apart)

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled below
                later.extend(stream)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(1.2)
        stream.cancel()
        reader.join(10)
        assert later and all(not m.segments and not m.removed for m in later), "heartbeats"
        assert len(later) <= 3, f"{len(later)} messages in 1.2 s: refreshes without news (every 0.1 s) woke it"


def test_a_rebuild_that_moved_nothing_wakes_no_stream_thread() -> None:
    """Only a moved version (or the close) wakes a stream's thread: waking every one at every refresh (256 of them
    taking the interpreter and the condition's lock in turn, once a second) would find nothing it waits for moved."""
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
    """A decay step rebuilds every segment's table (seconds of CPU at 1,000 segments, on one thread): the build is
    paced (a pause between segments), so that Decide's p99 across the step stays a few milliseconds (unpaced, 28 ms at
    300 segments)."""
    import controller.serving.table_publisher as table_publisher

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


def test_the_heartbeats_of_all_streams_together_stay_within_their_budget() -> None:
    """Past MAX_HEARTBEATS_PER_SECOND the period grows with the streams, so the heartbeats' cost does not grow with the
    streams clients open (at a fixed period, 256 streams beat 51 times a second, 3.5 % of a core in gRPC); each stream's
    beats follow it, and every message says it (the worker's quiet-stream check reads it), back down as streams
    close."""
    refresh_s = 0.2
    floor = HEARTBEAT_PERIODS * refresh_s
    few = int(MAX_HEARTBEATS_PER_SECOND * floor)  # as many as beat within the budget at the floor
    learner = SimpleNamespace(segments=lambda: [], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    publisher = DecisionPublisher(controller, refresh_seconds=refresh_s, max_watchers=8 * few)  # type: ignore[arg-type]
    streams = [publisher.watch(("draft",), lambda: True) for _ in range(few)]
    try:
        assert publisher.heartbeat_seconds == floor
        assert next(streams[0]).refresh_seconds == floor
        streams += [publisher.watch(("draft",), lambda: True) for _ in range(3 * few)]
        assert len(streams) / publisher.heartbeat_seconds == pytest.approx(MAX_HEARTBEATS_PER_SECOND)
        first = next(streams[-1])
        assert first.refresh_seconds == publisher.heartbeat_seconds == pytest.approx(4 * floor)
        waiting = threading.Thread(target=lambda: next(streams[0], None), daemon=True)
        waiting.start()  # what the serving loop does once it sent the first message: ask for the next (news)
        time.sleep(0.1)
        beat = streams[0].beat()
        assert beat is not None and beat.refresh_seconds == pytest.approx(4 * floor), "a beat says the period too"
        now = time.monotonic()
        assert all(streams[0].beat_in(now + t) <= 1.05 * 4 * floor for t in (0.0, 0.37, 1.9))
        assert max(streams[0].beat_in(now + t / 10) for t in range(80)) > 1.05 * floor, "the stream's grid follows"
    finally:
        for stream in streams[few:]:
            stream.close()
    assert publisher.heartbeat_seconds == floor
    for stream in streams[:few]:
        stream.close()
    publisher.close()
    waiting.join(10)


def test_streams_opened_together_beat_apart_and_a_beat_waits_while_a_change_is_on_its_way() -> None:
    """Each stream beats on a grid of its own random phase: waiting a heartbeat period after its last message, streams
    opened together (a fleet's restart, the benchmark's 256) would all wake together, every period, a burst of 256
    threads with Decide's p99 behind it; and no beat goes before a message being made (the first, every table, included)
    or a change on its way."""
    period = 0.5
    learner = SimpleNamespace(segments=lambda: [], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    publisher = DecisionPublisher(controller, refresh_seconds=period / HEARTBEAT_PERIODS, max_watchers=8)  # type: ignore[arg-type]
    streams = [publisher.watch(("draft",), lambda: True) for _ in range(8)]
    got: list[Any] = []

    def ask(stream: Any) -> threading.Thread:
        """What the serving loop does once it sent a stream's message: ask for the next (it waits for news)."""
        thread = threading.Thread(target=lambda: got.append(next(stream, None)), daemon=True)
        thread.start()
        return thread

    try:
        for stream in streams:
            assert stream.beat() is None, "nothing sent yet: the first message comes first"
            assert next(stream).full
            assert stream.beat() is None, "the first message is made, not yet sent: no beat before it"
        now = time.monotonic()
        dues = sorted(stream.beat_in(now) for stream in streams)
        assert all(0 < due <= 1.05 * period for due in dues)
        assert dues[-1] - dues[0] > period / 4, f"8 streams' heartbeats due within {dues[-1] - dues[0]:.3f} s"
        waiting, other = ask(streams[0]), ask(streams[1])
        time.sleep(0.1)
        beat = streams[0].beat()
        assert beat is not None and not beat.full and not beat.segments and not beat.removed
        with publisher._cond:  # (reentrant) the woken streams cannot take their news until this is let go
            learner.stale = True
            publisher.rebuild()  # the staleness moved: a change on its way to every stream
            assert streams[1].beat() is None, "its tables moved: the change says what a beat would"
        waiting.join(10)
        other.join(10)
        assert len(got) == 2 and all(m.stale for m in got)
        assert streams[0].beat() is None, "the change is made, not yet sent"
        waiting = ask(streams[0])
        time.sleep(0.1)
        beat = streams[0].beat()
        assert beat is not None and beat.stale
    finally:
        publisher.close()
        waiting.join(10)


class Beats:
    """A stream whose next message takes ``hold`` seconds (a pool thread waiting for news), beating every ``period``."""

    def __init__(self, period: float, hold: float) -> None:
        self.period, self.hold = period, hold
        self.nexts = 0  # pool-thread steps
        self.sent = 0

    def __iter__(self) -> Beats:
        return self

    def __next__(self) -> str:
        self.nexts += 1
        if self.nexts > 2:
            raise StopIteration
        time.sleep(self.hold)
        return f"message {self.nexts}"

    def beat_in(self, now: float) -> float:
        return self.period - now % self.period

    def beat(self) -> str:
        return "beat"


def test_a_heartbeat_is_sent_from_the_serving_loop_while_the_streams_thread_waits() -> None:
    """A heartbeat wakes no pool thread: waking the stream's thread to make it, hand it to the event loop and be
    handed the next wait back would cost, at 256 streams, ~4 % of a core for 51 empty messages a second."""
    from concurrent import futures

    from controller.serving.grpc_server import stream_in_pool

    beats = Beats(period=0.05, hold=0.4)

    async def collect() -> list[str]:
        with futures.ThreadPoolExecutor(2) as pool:
            stream = stream_in_pool(lambda request, context: beats, pool)
            return [m async for m in stream(None, SimpleNamespace())]  # type: ignore[arg-type]

    got = asyncio.run(collect())
    assert [m for m in got if m != "beat"] == ["message 1", "message 2"]
    assert got.count("beat") >= 8, f"{got.count('beat')} beats in 0.8 s at a 0.05 s period"
    assert beats.nexts == 3, "the thread stepped once per message (and once to end), not once per beat"


def test_a_sent_message_is_let_go_of_while_the_next_one_waits() -> None:
    """A stream does not hold its last message until its next one: every stream's first message (every table,
    1.2 MiB at 1,000 segments) held for as long as no table changes is 1.1 GiB at 256 streams."""
    import gc
    import weakref
    from concurrent import futures

    from controller.serving.grpc_server import stream_in_pool

    class Big:
        pass

    first, release = Big(), threading.Event()
    gone: list[bool] = []

    class Messages:
        """Two messages, the second a wait away; heartbeats due every 5 s meanwhile (the serving loop's path)."""

        def __init__(self) -> None:
            self.sent = 0

        def __iter__(self) -> Messages:
            return self

        def __next__(self) -> Any:
            self.sent += 1
            if self.sent == 1:
                return first
            if self.sent == 2:
                release.wait(10)  # the next message waits on the pool thread
                return "second"
            raise StopIteration

        def beat_in(self, now: float) -> float:
            return 5.0

        def beat(self) -> str:
            return "beat"

    def messages(request: Any, context: Any) -> Messages:
        return Messages()

    async def consume() -> None:
        nonlocal first
        kept = weakref.ref(first)
        with futures.ThreadPoolExecutor(2) as pool:
            stream = stream_in_pool(messages, pool)(None, SimpleNamespace())  # type: ignore[arg-type]
            assert await stream.__anext__() is kept()
            first = None  # type: ignore[assignment]
            waiting = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)  # the stream waits for its next message (and its next beat)
            gc.collect()
            gone.append(kept() is None)
            release.set()
            assert await waiting == "second"
            await stream.aclose()

    asyncio.run(consume())
    assert gone == [True], "the first message is still held while the stream waits for its next"


def test_a_stream_whose_call_ends_while_its_handler_is_called_closes_what_the_handler_returns() -> None:
    """A WatchDecisions handler counts its stream as a watcher when called (``DecisionPublisher.watch``); a call
    cancelled while the handler ran was never closed: its ``max_watchers`` slot held for good."""
    from concurrent import futures

    from controller.serving.grpc_server import stream_in_pool

    closed = threading.Event()

    class Messages:
        def __iter__(self) -> Messages:
            return self

        def __next__(self) -> str:
            return "message"

        def close(self) -> None:
            closed.set()

    def handler(request: Any, context: Any) -> Messages:
        time.sleep(0.3)  # the call is cancelled meanwhile
        return Messages()

    async def cancel_early() -> None:
        with futures.ThreadPoolExecutor(2) as pool:
            stream = stream_in_pool(handler, pool)(None, SimpleNamespace())  # type: ignore[arg-type]
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.1)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await first
            await asyncio.to_thread(closed.wait, 5)

    asyncio.run(cancel_early())
    assert closed.is_set(), "what the handler returned after its call ended was never closed"


def test_a_heartbeat_is_never_more_than_a_period_and_a_twentieth_away() -> None:
    for now in (0.0, 0.01, 2.49, 2.5, 2.51, 7.3, 1e6 + 0.2):
        for phase in (0.0, 0.3, 2.4):
            wait = heartbeat_wait(now, phase, 2.5)
            assert 2.5 / 20 <= wait <= 2.5 * 1.05, (now, phase, wait)
            assert (now + wait - phase) % 2.5 == pytest.approx(0.0, abs=1e-6) or (
                now + wait - phase
            ) % 2.5 == pytest.approx(2.5)


def test_streams_woken_together_share_one_change_message() -> None:
    """Streams woken by a change share one message: each finding none yet and making its own, at a decay step 256
    streams would each copy ~700 tables, the step's largest cost."""
    learner = SimpleNamespace(segments=lambda: [], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    publisher = DecisionPublisher(controller, refresh_seconds=60.0, max_watchers=8)  # type: ignore[arg-type]
    streams = [publisher.watch(("draft",), lambda: True) for _ in range(8)]
    for stream in streams:
        assert next(stream).full
    publisher.rebuild()  # the first build with a header
    for stream in streams:
        assert not next(stream).full
    made: list[bool] = []
    message = publisher._message

    def slow_message(*args: Any) -> Any:
        made.append(args[0])
        time.sleep(0.05)  # as long as 700 tables take: every woken stream gets to ask meanwhile
        return message(*args)

    publisher._message = slow_message  # type: ignore[method-assign]
    got: list[Any] = []
    threads = [threading.Thread(target=lambda s=s: got.append(next(s)), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    time.sleep(0.1)  # every stream waits
    learner.stale = True
    publisher.rebuild()  # the staleness moved: one change for every stream
    try:
        for thread in threads:
            thread.join(10)
    finally:
        publisher.close()
    assert len(got) == 8 and all(m.stale for m in got) and all(m is got[0] for m in got)
    assert made == [False], f"the change message made {len(made)} times"
    wire = publisher.wire(got[0])
    assert wire == got[0].SerializeToString() and all(publisher.wire(m) is wire for m in got), "serialized once"
    assert publisher.wire(pb.DecisionTables()) == pb.DecisionTables(), "any other message goes as it is"


def test_streams_opened_together_share_one_first_message() -> None:
    """The streams that open while the tables, the header and the period (a quarter of the floor) hold share the
    one message's bytes: a first message per stream (every table: 1.2 MiB at 1,000 segments), serialized for each,
    is made 256 times when a fleet restarts."""
    learner = SimpleNamespace(segments=lambda: [], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    publisher = DecisionPublisher(controller, refresh_seconds=1.0, max_watchers=512)  # type: ignore[arg-type]
    made: list[bool] = []
    message = publisher._message

    def counted(*args: Any) -> Any:
        made.append(args[0])
        return message(*args)

    publisher._message = counted  # type: ignore[method-assign]
    firsts = [next(publisher.watch(("draft",), lambda: True, wire=True)) for _ in range(8)]
    assert all(type(f) is bytes and f is firsts[0] for f in firsts), "one message's bytes, shared"
    assert made == [True], f"the first message made {len(made)} times"
    assert pb.DecisionTables.FromString(firsts[0]).full
    learner.stale = True  # the header moved: a stream opened now gets a message that says so
    assert pb.DecisionTables.FromString(next(publisher.watch(("draft",), lambda: True, wire=True))).stale
    assert made == [True, True]
    # Past the heartbeat budget the period grows with every stream opened: a first message never names a period
    # shorter than the stream's heartbeats (its worker would call a live stream dead), and is remade once the
    # period passes what it named, not at every stream
    opened, before = [], len(made)
    for _ in range(300):
        first = pb.DecisionTables.FromString(next(publisher.watch(("draft",), lambda: True, wire=True)))
        assert first.refresh_seconds >= publisher.heartbeat_seconds - 1e-9
        assert first.refresh_seconds <= publisher.heartbeat_seconds + HEARTBEAT_PERIODS * 1.0 / 4 + 1e-9
        opened.append(first.refresh_seconds)
    remade = len(made) - before
    assert remade <= len(set(opened)) < 20, f"{remade} first messages for 300 streams"
    in_process = publisher.watch(("draft",), lambda: True)  # not on the wire: the message itself
    assert isinstance(next(in_process), pb.DecisionTables)


def test_a_table_computes_each_drafters_posteriors_once_not_once_per_batch_bucket(
    embedded_redis_url, prefix, tmp_path, monkeypatch
) -> None:
    """The posteriors do not depend on the batch size (the cost ratio does, set per bucket): a segment's table (five
    buckets: 1, 2, 4, 8 and above) computed them five times over, at a decay step for every segment."""
    import controller.decision.core as core_module

    with running(daemon_config(embedded_redis_url, tmp_path, prefix), clock=lambda: FIXED_NOW) as daemon:
        with started(client_config(daemon.address, watch=())) as reporter:
            teach(reporter, "posteriors")
            learned(daemon, reporter, ["posteriors"], 32)
        controller = daemon.controller
        assert controller is not None
        calls: list[str] = []
        estimate = core_module.estimate_drafter

        def counted(counts: Any, drafter: str, *args: Any) -> Any:
            calls.append(drafter)
            return estimate(counts, drafter, *args)

        monkeypatch.setattr(core_module, "estimate_drafter", counted)
        table = segment_table(controller, "posteriors", DRAFTERS)
        assert table is not None and len(table.buckets) >= 3
        assert set(DRAFTERS) <= set(calls) and len(calls) == len(set(calls)), f"per drafter: {Counter(calls)}"
