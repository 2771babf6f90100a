"""Contract 3: the controller never loses acknowledged telemetry and keeps answering while Redis is down
(from memory, marked stale), then catches up without counting anything twice. Also the connection helpers:
``connect`` and ``redact``."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import controller.decision.learner as learner_module
from controller.decision.counts import Aggregate
from controller.decision.learner import Learner
from controller.storage.journal import Journal, JournalFull
from controller.storage.redis_conn import RedisSetupError, connect, make_client, redact, start_embedded
from controller.storage.store import StoreConfig, TelemetryStore

T0 = 1_000_000.0
UNREACHABLE_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def aggregate(rounds: int, segment: str = "chat") -> Aggregate:
    """``rounds`` rounds at K = 2 that each kept position 0 and rejected position 1."""
    return Aggregate(
        segment=segment,
        drafter="draft",
        k=2,
        rounds=rounds,
        num_drafted=2 * rounds,
        num_accepted=rounds,
        proposed_per_position=(rounds, rounds),
        verified_per_position=(rounds, rounds),
        accepted_per_position=(rounds, 0),
        tokens_emitted=2 * rounds,
        draft_seconds=0.25 * rounds,
        verify_seconds=0.5 * rounds,
        batch_size=1,
        by_drafted=((0, 0.0), (0, 0.0), (rounds, 0.5 * rounds)),
    )


def make_learner(client: redis.Redis, journal_path: Path, max_reports: int = 100, prefix: str = "specd") -> Learner:
    """A learner on a frozen clock (one bucket, no decay) that never refits the prior (no sklearn here)."""
    store = TelemetryStore(client, StoreConfig(prefix=prefix), lambda: T0)
    return Learner(store, Journal(journal_path, max_reports), clock=lambda: T0, prior_retrain_seconds=float("inf"))


def redis_rounds(store: TelemetryStore, segment: str = "chat") -> float:
    """Rounds stored in Redis for ``segment`` (read fresh: a new store has no cache of closed buckets)."""
    fresh = TelemetryStore(store.client, store.config, store.clock)
    return fresh.read_snapshot([segment]).segments[segment].rounds


class EmbeddedServer:
    """An embedded valkey under ``data_dir`` that the test can stop and start again on the same data."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server: Any | None = None
        self.url = ""

    def start(self) -> str:
        self.server, url = start_embedded(self.data_dir)
        assert not self.url or url == self.url, "a restart on the same dir must keep the address"
        self.url = url
        return url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path / "r")  # short: the unix socket path must fit in 108 bytes
    yield server
    server.stop()


# --- outage and catch-up ------------------------------------------------------------------------------


def test_outage_is_served_from_memory_then_caught_up_exactly(embedded: EmbeddedServer, tmp_path: Path) -> None:
    url = embedded.start()
    assert url.startswith("unix://"), "the test restarts on the same socket; a TCP port would change"
    client = make_client(url, 0.3)
    learner = make_learner(client, tmp_path / "journal.jsonl")

    # 1. Redis up: reports go straight to Redis.
    assert learner.report("r1", [aggregate(1)]).journaled is False
    assert learner.report("r2", [aggregate(2)]).journaled is False
    assert learner.refresh() is True and learner.stale is False
    assert learner.segment_counts("chat").rounds == 3

    # 2. Redis down: refresh fails and marks stale; reports are journaled, still acknowledged, still visible.
    embedded.stop()
    assert learner.refresh() is False
    assert learner.stale is True
    outcome = learner.report("r3", [aggregate(4)])
    assert (outcome.journaled, outcome.rounds, outcome.duplicate) == (True, 4, False)
    assert learner.report("r4", [aggregate(8)]).journaled is True
    assert len(learner.journal) == 2
    assert learner.segment_counts("chat").rounds == 1 + 2 + 4 + 8, "snapshot plus journaled reports"
    assert learner.segment_counts("chat").by_k[("draft", 2)].accepted == 15
    assert learner.segments() == ["chat"]

    # 3. Redis back on the same data: what it had acknowledged survived the restart (append-only file).
    embedded.start()
    assert redis_rounds(learner.store) == 1 + 2, "r1 and r2 persisted; the journal is not replayed yet"
    queued = learner.report("r5", [aggregate(16)])
    assert queued.journaled is True, "with a backlog, new reports queue behind it to keep the order"

    # 4. Catch up: the journal is replayed with the original ids, nothing is lost or counted twice.
    assert learner.refresh() is True
    assert learner.stale is False
    assert len(learner.journal) == 0
    everything = 1 + 2 + 4 + 8 + 16
    assert redis_rounds(learner.store) == everything
    assert learner.segment_counts("chat").rounds == everything, "journaled counts are not shown twice"
    assert learner.report("r3", [aggregate(4)]).duplicate is True, "a worker's retry of an acked report"
    assert learner.report("r6", [aggregate(32)]).journaled is False, "journal empty: straight to Redis again"
    assert redis_rounds(learner.store) == everything + 32
    client.close()


def test_replaying_a_journal_twice_counts_once(redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """A crash after replay but before truncation replays the same entries again on restart."""
    store = TelemetryStore(redis_client, StoreConfig(prefix=prefix), lambda: T0)
    journal = Journal(tmp_path / "journal.jsonl", 10)
    journal.append("j1", [aggregate(3)])
    journal.append("j2", [aggregate(5), aggregate(7, segment="code")])
    shutil.copy(journal.path, tmp_path / "copy.jsonl")  # the file as it was when the crash happened

    assert journal.replay(store.ingest) == 2
    assert len(journal) == 0
    duplicates: list[bool] = []

    def send(report_id: str, aggregates: list[Aggregate]) -> None:
        duplicates.append(store.ingest(report_id, aggregates).duplicate)

    assert Journal(tmp_path / "copy.jsonl", 10).replay(send) == 2
    assert duplicates == [True, True]
    assert (redis_rounds(store, "chat"), redis_rounds(store, "code")) == (3 + 5, 7)


def test_report_arriving_during_replay_is_not_counted_twice(
    redis_client: redis.Redis, prefix: str, tmp_path: Path
) -> None:
    """Traffic keeps coming while the backlog is replayed; those reports queue in the journal (order), and the
    learner's counts must be Redis's snapshot plus only what is still journaled."""
    learner = make_learner(make_client(UNREACHABLE_URL, 0.3), tmp_path / "journal.jsonl", prefix=prefix)
    learner.report("r1", [aggregate(1)])  # Redis down: journaled
    store = TelemetryStore(redis_client, StoreConfig(prefix=prefix), lambda: T0)  # Redis is back
    ingest = store.ingest

    def ingest_while_traffic_arrives(report_id: str, aggregates: list[Aggregate], *step: object) -> object:
        if report_id == "r1":
            assert learner.report("r2", [aggregate(10)]).journaled, "queued behind the backlog"
        return ingest(report_id, aggregates, *step)  # type: ignore[arg-type]

    store.ingest = ingest_while_traffic_arrives  # type: ignore[method-assign]
    learner.store = store
    assert learner.refresh() is True
    assert len(learner.journal) == 1 and redis_rounds(store) == 1, "r1 replayed, r2 still journaled"
    assert learner.segment_counts("chat").rounds == 1 + 10, "r1 from the snapshot, r2 from the journal, once each"
    store.ingest = ingest  # type: ignore[method-assign]
    assert learner.refresh() is True
    assert learner.segment_counts("chat").rounds == redis_rounds(store) == 11


def test_torn_last_line_from_a_crash_mid_append_is_skipped(tmp_path: Path) -> None:
    """A crash (or a full disk) during append leaves a partial line that was never acknowledged; the
    acknowledged reports before it must still replay, and the next append must not be glued onto it."""
    path = tmp_path / "journal.jsonl"
    Journal(path, 10).append("j1", [aggregate(3)])
    with path.open("a") as f:
        f.write('{"report_id": "j2", "aggreg')  # the write that never finished
    journal = Journal(path, 10)
    journal.append("j3", [aggregate(5)])
    assert [report_id for report_id, _ in journal.entries()] == ["j1", "j3"]


def test_journal_round_trips_aggregates_exactly(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl", 10)
    sent = [aggregate(3), aggregate(5, segment="code")]
    journal.append("j1", sent)
    assert Journal(tmp_path / "journal.jsonl", 10).entries() == [("j1", sent)], "a restarted controller reads it"


def test_full_journal_refuses_the_report(tmp_path: Path) -> None:
    learner = make_learner(make_client(UNREACHABLE_URL, 0.3), tmp_path / "journal.jsonl", max_reports=3)
    for n in range(3):
        assert learner.report(f"r{n}", [aggregate(1)]).journaled is True
    with pytest.raises(JournalFull):
        learner.report("r3", [aggregate(100)])
    assert len(learner.journal) == 3
    assert learner.segment_counts("chat").rounds == 3, "the refused report is not counted anywhere"
    assert learner.stale is True
    with pytest.raises(JournalFull):  # shown while it was being written, then refused: no trace of it is left
        learner.report("r4", [aggregate(100, segment="new")])
    assert not learner.counted("new") and learner.segment_counts("new").empty
    assert learner.segment_counts("chat").rounds == 3


def test_refresh_with_redis_never_reached_keeps_the_journal(tmp_path: Path) -> None:
    learner = make_learner(make_client(UNREACHABLE_URL, 0.3), tmp_path / "journal.jsonl")
    learner.report("r1", [aggregate(2)])
    assert learner.refresh() is False
    assert learner.stale is True
    assert len(learner.journal) == 1, "a failed replay leaves the journal as it was"
    assert learner.segment_counts("chat").rounds == 2


# --- connect and redact -------------------------------------------------------------------------------


def test_connect_to_an_unreachable_url_serves_from_memory(tmp_path: Path) -> None:
    handle = connect(UNREACHABLE_URL, tmp_path, timeout_seconds=0.3)
    try:
        assert handle.embedded is None
        assert handle.url == UNREACHABLE_URL
        with pytest.raises(redis.ConnectionError):
            handle.client.ping()
    finally:
        handle.close()


def test_connect_without_url_starts_the_embedded_server(tmp_path: Path) -> None:
    handle = connect(None, tmp_path)
    try:
        assert handle.embedded is not None
        assert handle.client.ping() is True
        assert (tmp_path / "redis").is_dir(), "the server keeps its data under the state dir"
    finally:
        handle.close()
    assert handle.embedded is None


def test_connect_rejects_an_unusable_url_without_showing_the_password(tmp_path: Path) -> None:
    with pytest.raises(RedisSetupError) as excinfo:
        connect("http://user:hunter2@example.com/0", tmp_path)
    assert "hunter2" not in str(excinfo.value)
    assert "example.com" in str(excinfo.value)


REDACT_ROWS = [
    ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0", "password only (requirepass)"),
    ("redis://app:hunter2@cache:6379/0", "redis://app:***@cache:6379/0", "ACL user keeps its name"),
    ("rediss://app:hunt@r2@cache:6380/1", "rediss://app:***@cache:6380/1", "an '@' inside the password"),
    ("unix://app:hunter2@/run/redis.sock?db=0", "unix://app:***@/run/redis.sock?db=0", "unix socket with user"),
    ("redis://cache:6379/0", "redis://cache:6379/0", "no credentials: unchanged"),
    ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0", "socket without credentials: unchanged"),
]


@pytest.mark.parametrize(("url", "shown", "why"), REDACT_ROWS)
def test_redact_hides_passwords(url: str, shown: str, why: str) -> None:
    assert redact(url) == shown, why
    assert "hunter2" not in redact(url) and "hunt@r2" not in redact(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("unix:///run/redis.sock?db=0&password=hunter2", "redis-py's documented form for unix sockets"),
        ("redis://cache:6379/0?password=hunter2", "redis-py takes any connection argument from the query"),
    ],
)
def test_redact_hides_passwords_in_the_query_string(url: str, why: str) -> None:
    assert redis.ConnectionPool.from_url(url).connection_kwargs["password"] == "hunter2", "redis-py uses it"
    assert "hunter2" not in redact(url), why


def test_a_journaled_report_is_encoded_and_counted_outside_the_lock_decisions_read_under(
    redis_client: redis.Redis, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Decide reads the learner's counts under its lock. A report at the bounds takes tens of milliseconds to
    encode for the journal and to count for the journaled view, and each Decide would wait that long while Redis is
    down: that work is done with the lock free, going in and coming out (replay) alike."""
    learner = make_learner(make_client(UNREACHABLE_URL, 0.3), tmp_path / "journal.jsonl", prefix=prefix)
    held: dict[str, list[bool]] = {"entry": [], "report_counts": []}
    for name in held:
        real = getattr(learner_module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            held[_name].append(learner._lock.locked())
            return _real(*args)

        monkeypatch.setattr(learner_module, name, spy)
    assert learner.report("r1", [aggregate(3)]).journaled
    assert learner.segment_counts("chat").rounds == 3  # shown at once
    learner.store = TelemetryStore(redis_client, StoreConfig(prefix=prefix), lambda: T0)  # Redis is back
    assert learner.refresh() is True
    assert learner.segment_counts("chat").rounds == 3 == redis_rounds(learner.store), "replayed, counted once"
    assert held == {"entry": [False], "report_counts": [False, False]}, "made under the lock Decide reads under"


def test_a_report_is_written_to_the_journal_with_the_lock_free_and_a_refresh_meanwhile_keeps_it_shown(
    redis_client: redis.Redis, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's write and fsync happen with the learner's lock free (a slow disk must not hold every Decide).
    A refresh that replays the backlog and installs a snapshot while a report is being written must keep that
    report shown: it is in neither the journal's count nor Redis yet, and taking it off would miss it until its
    replay."""
    learner = make_learner(make_client(UNREACHABLE_URL, 0.3), tmp_path / "journal.jsonl", prefix=prefix)
    assert learner.report("r1", [aggregate(1)]).journaled  # Redis down: the backlog
    learner.store = TelemetryStore(redis_client, StoreConfig(prefix=prefix), lambda: T0)  # Redis is back
    append = learner.journal.append_entry
    seen: list[tuple[bool, float]] = []

    def refresh_meanwhile(data: bytes) -> None:
        if not seen:
            if learner._lock.locked():  # (a refresh would wait for it forever)
                seen.append((True, math.nan))
            else:
                assert learner.refresh() is True  # r1 replayed, its snapshot installed; the journal is empty now
                seen.append((False, learner.segment_counts("chat").rounds))
        append(data)

    monkeypatch.setattr(learner.journal, "append_entry", refresh_meanwhile)
    assert learner.report("r2", [aggregate(10)]).journaled, "queued behind the backlog"
    assert seen == [(False, 1 + 10)], "r2 taken off the view while it was being written (or written under the lock)"
    assert learner.segment_counts("chat").rounds == 11
    monkeypatch.undo()
    assert learner.refresh() is True
    assert learner.segment_counts("chat").rounds == redis_rounds(learner.store) == 11, "counted once"
