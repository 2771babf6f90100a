"""The telemetry journal (controller/storage/journal.py) and its replay, over real files, a real Redis and real gRPC.

A journal bounded only by count can grow to 77 MB while Redis is down, be re-parsed every second, and be replayed
whole before the next start listens. Here: the byte bound holds and a report past it gets
RESOURCE_EXHAUSTED (the worker's client keeps it and delivers it later); a large journal is replayed after the daemon
listens; totals reconcile exactly; a torn last line is skipped with one log line; a replay that cannot reach Redis
reads one entry, not the journal.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

import controller.storage.journal as journal_module
from controller.decision.counts import Aggregate
from controller.decision.learner import Learner
from controller.server import REDIS_HEALTH, ControllerDaemon
from controller.storage.journal import Journal, JournalFull, record
from controller.storage.redis_conn import make_client, start_embedded
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.rounds import RoundRecord
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError
from specd_client import ControllerClient
from specd_client.config import ClientConfig
from specd_client.reports import rounds_to_aggregates
from tests.daemons import DEFAULT_POLICY, daemon_config, running
from tests.waiting import wait_until

UNREACHABLE_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
RPC_TIMEOUT = 5.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


# --- helpers (test_supervision.py uses them too) -------------------------------------------------------------------


def aggregate(rounds: int, segment: str = "chat", k: int = 4) -> Aggregate:
    """``rounds`` rounds at K = ``k``: position i accepted rounds - i times (so every position counts something)."""
    accepted = tuple(max(rounds - i, 0) for i in range(k))
    return Aggregate(
        segment=segment, drafter="draft", k=k, rounds=rounds, num_drafted=k * rounds, num_accepted=sum(accepted),
        proposed_per_position=(rounds,) * k, verified_per_position=(rounds,) * k, accepted_per_position=accepted,
        tokens_emitted=sum(accepted) + rounds, draft_seconds=0.001 * rounds, verify_seconds=0.01 * rounds,
        by_drafted=((0, 0.0),) * k + ((rounds, 0.01 * rounds),),
    )  # fmt: skip


def write_journal(path: Path, reports: int, per_report: int, torn_tail: bool = False) -> int:
    """A journal as a previous run would have left it (the lines Journal.append writes, without an fsync each);
    returns the rounds it holds."""
    rounds = 0
    with path.open("w") as f:
        for r in range(reports):
            aggregates = [aggregate(5 + (r + i) % 7, segment=f"seg{i % 3}") for i in range(per_report)]
            rounds += sum(a.rounds for a in aggregates)
            f.write(json.dumps({"report_id": uuid.uuid4().hex, "aggregates": [record(a) for a in aggregates]}) + "\n")
        if torn_tail:
            f.write('{"report_id": "torn", "aggregates": [{"segment": "se')  # the write a crash cut short
    return rounds


def stored_rounds(client: redis.Redis, prefix: str) -> float:
    """Rounds in Redis under ``prefix``, summed from the raw bucket hashes (exact: no decay applied)."""
    total = 0.0
    for key in client.scan_iter(f"{prefix}:v1:seg:*", count=1000):
        total += sum(
            float(v) for name, v in client.hgetall(key).items() if name.startswith("k|") and name.endswith("|rounds")
        )
    return total


def running_daemon(state_dir: Path, redis_url: str | None, **settings: Any) -> AbstractContextManager[ControllerDaemon]:
    """A daemon in this process on a free loopback port (tests/daemons.py), with its own key prefix
    (``daemon.config.learning.prefix``), the shipped policy file and a half-life of 1e9 s; learning settings go in
    ``settings["learning"]``. Its keys stay: a test reads them after it stops."""
    learning = {"half_life_seconds": 1e9, **settings.pop("learning", {})}
    config = daemon_config(
        redis_url, state_dir.parent, DEFAULT_POLICY, state_dir=state_dir, learning=learning, **settings
    )
    return running(config)


def health(channel: grpc.Channel, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT).status)


def report_request(report_id: str, segment: str, requests: int = 1) -> pb.ReportRoundsRequest:
    """What a worker's client sends for ``requests`` requests of 4 draft rounds each (K 3; accepted 3, 2, 1, 0)."""
    aggregates = rounds_to_aggregates(
        segment, ROUNDS * requests, temperature=0.0, prompt_tokens=100, self_repetition=0.2
    )
    return pb.ReportRoundsRequest(report_id=report_id, worker_id="test", aggregates=aggregates)


def drafted(accepted: int) -> RoundRecord:
    """A draft-model round at K 3 that kept ``accepted`` tokens."""
    return RoundRecord("draft", 3, 3, accepted, accepted + 1, 0.001, 0.01, 1)


ROUNDS = [drafted(3), drafted(2), drafted(1), drafted(0)]


# --- the journal alone ---------------------------------------------------------------------------------------------


def test_the_byte_bound_refuses_a_report_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bound = 4096
    journal = Journal(tmp_path / "journal.jsonl", max_reports=10_000, max_bytes=bound)
    appended = 0
    with caplog.at_level(logging.WARNING, logger="controller.storage.journal"):
        with pytest.raises(JournalFull) as refused:
            while True:
                journal.append(f"r{appended}", [aggregate(3)])
                appended += 1
        with pytest.raises(JournalFull):
            journal.append("again", [aggregate(3)])
    assert appended > 0
    assert journal.size == journal.path.stat().st_size <= bound
    assert f"of {bound} bytes" in str(refused.value)
    assert len(caplog.records) == 1, "an episode is logged at its first refusal, not at every one"
    assert len(journal) == appended and [rid for rid, _ in journal.entries()][-1] == f"r{appended - 1}"


def test_replay_resumes_at_the_cursor_and_compaction_keeps_the_order(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, 100, 2**20)
    for n in range(10):
        journal.append(f"r{n}", [aggregate(n + 1)])
    sent: list[str] = []

    def send_until_r6(report_id: str, aggregates: list[Aggregate]) -> None:
        if report_id == "r6":
            raise redis.ConnectionError("Redis went away")
        sent.append(report_id)

    size_before = path.stat().st_size
    with pytest.raises(redis.ConnectionError):
        journal.replay(send_until_r6, batch_bytes=1)  # the cursor is saved after every entry
    assert sent == [f"r{n}" for n in range(6)] and len(journal) == 4
    assert journal.size == path.stat().st_size < size_before * 0.6, "over half was sent: that part is gone"
    journal.append("r10", [aggregate(1)])

    reopened = Journal(path, 100, 2**20)  # a restart: only what was never sent, in order
    assert [rid for rid, _ in reopened.entries()] == ["r6", "r7", "r8", "r9", "r10"]
    assert reopened.replay(lambda rid, aggs: sent.append(rid)) == 5
    assert sent[6:] == ["r6", "r7", "r8", "r9", "r10"]
    assert (len(reopened), reopened.size, path.stat().st_size) == (0, 0, 0), "all sent: the file is emptied"


def test_a_compaction_cut_short_by_a_crash_is_finished_on_open(tmp_path: Path) -> None:
    """The copy of the unsent tail and the cursor naming it were written; the rename was not."""
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, 100, 2**20)
    for n in range(4):
        journal.append(f"r{n}", [aggregate(1)])
    tail = b"".join(path.read_bytes().splitlines(keepends=True)[3:])
    copy = path.with_name(path.name + ".compacting")
    copy.write_bytes(tail)
    journal.cursor_path.write_text(f"{copy.stat().st_ino} 0\n")
    assert [rid for rid, _ in Journal(path, 100, 2**20).entries()] == ["r3"]
    assert not copy.exists()


def test_a_cursor_that_matches_nothing_replays_from_the_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Replaying more is safe (report ids are deduplicated); skipping an entry would lose it."""
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, 100, 2**20)
    for n in range(3):
        journal.append(f"r{n}", [aggregate(1)])
    journal.cursor_path.write_text("1 12\n")  # another inode, a mid-line offset
    with caplog.at_level(logging.WARNING, logger="controller.storage.journal"):
        assert [rid for rid, _ in Journal(path, 100, 2**20).entries()] == ["r0", "r1", "r2"]
    assert "replaying it from the start" in caplog.text


def test_a_replay_that_cannot_reach_redis_reads_one_entry_not_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh must not re-parse the whole journal while Redis is down (80% CPU at 77 MB)."""
    path = tmp_path / "journal.jsonl"
    write_journal(path, reports=50, per_report=2)
    parsed = 0
    parse = journal_module._parse

    def counting_parse(line: bytes) -> Any:
        nonlocal parsed
        parsed += 1
        return parse(line)

    monkeypatch.setattr(journal_module, "_parse", counting_parse)
    store = TelemetryStore(make_client(UNREACHABLE_URL, 0.3), StoreConfig(prefix="unused"), time.time)
    learner = Learner(store, Journal(path, 1000, 2**20), prior_retrain_seconds=float("inf"))
    for _ in range(5):
        assert learner.refresh(replay_seconds=1.0) is False
    assert parsed == 5, "one entry per failed replay"
    assert len(learner.journal) == 50


# --- over gRPC, with a real Redis ------------------------------------------------------------------------------------


def test_a_full_journal_answers_resource_exhausted_and_the_client_delivers_later(tmp_path: Path) -> None:
    """Redis stops; the journal fills to its byte bound; the next reports get RESOURCE_EXHAUSTED, which the worker's
    client keeps and retries; Redis returns; everything acknowledged or retried is stored exactly once."""
    bound = 8192
    redis_dir = tmp_path / "r"  # short: the unix socket path must fit in 108 bytes, and stay the same on restart
    server, url = start_embedded(redis_dir)
    check = make_client(url, 2.0)
    try:
        with running_daemon(tmp_path / "state", url, learning={"journal_max_bytes": bound}) as daemon:
            prefix, journal = daemon.config.learning.prefix, daemon.controller.learner.journal
            with grpc.insecure_channel(daemon.address) as channel:
                stub = pb_grpc.ControllerStub(channel)
                assert stub.ReportRounds(report_request("before", "chat"), timeout=RPC_TIMEOUT).journaled is False
                assert health(channel, REDIS_HEALTH) == SERVING
                server.stop()
                assert wait_until(lambda: health(channel, REDIS_HEALTH) == NOT_SERVING, timeout=5)
                assert health(channel, "") == SERVING, "Decide still answers: the process is not out of rotation"

                acknowledged = 0
                with pytest.raises(grpc.RpcError) as refused:
                    while True:
                        response = stub.ReportRounds(report_request(f"j{acknowledged}", "chat"), timeout=RPC_TIMEOUT)
                        assert response.journaled
                        acknowledged += 1
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"of {bound} bytes" in refused.value.details()
                assert journal.size == journal.path.stat().st_size <= bound and len(journal) == acknowledged

                client_config = ClientConfig(
                    address=daemon.address, worker_id="w", report_interval_s=0.05, retry_backoff_s=(0.05, 0.2),
                    max_aggregates_per_report=1,
                )  # fmt: skip
                with ControllerClient(client_config) as client:
                    for _ in range(5):
                        client.report(segment="chat", rounds=ROUNDS, temperature=0.0, prompt_tokens=100,
                                      self_repetition=0.2)  # fmt: skip
                    assert wait_until(lambda: client.stats().send_failures >= 3, timeout=5)
                    assert (client.stats().buffered, client.stats().aggregates_dropped) == (5, 0), "kept, not lost"
                    assert journal.path.stat().st_size <= bound

                    server, _ = start_embedded(redis_dir)  # Redis is back, on the same socket and data
                    assert wait_until(lambda: client.stats().buffered == 0 and not len(journal), timeout=30)
                    stats = client.stats()
                assert (stats.aggregates_sent, stats.aggregates_dropped) == (5, 0)
                assert wait_until(lambda: health(channel, REDIS_HEALTH) == SERVING, timeout=5)
        per_request = len(ROUNDS)
        assert stored_rounds(check, prefix) == per_request * (1 + acknowledged + 5), "each report exactly once"
    finally:
        check.close()
        if server._process is not None:  # not stopped by the test
            server.stop()


def test_a_large_journal_is_replayed_after_listening_and_reconciles_exactly(
    tmp_path: Path, embedded_redis_url: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    rounds = write_journal(state / "journal.jsonl", reports=50, per_report=100)  # about 3 MB: seconds of replay
    size = (state / "journal.jsonl").stat().st_size
    started = time.monotonic()
    with running_daemon(state, embedded_redis_url, learning={"journal_max_bytes": 64 * 2**20}) as daemon:
        listening_after = time.monotonic() - started
        learner = daemon.controller.learner
        with grpc.insecure_channel(daemon.address) as channel:
            decision = pb_grpc.ControllerStub(channel).Decide(
                pb.DecideRequest(segment="seg0", batch_size=1, drafters=["draft"], max_new_tokens=64),
                timeout=RPC_TIMEOUT,
            )
            assert decision.drafter and health(channel, "") == SERVING
            left = len(learner.journal)
            assert left > 0, "the replay was over before the daemon answered: this test would prove nothing"
            assert wait_until(lambda: not len(learner.journal), timeout=60)
            replayed_after = time.monotonic() - started
            prefix = daemon.config.learning.prefix
            check = make_client(embedded_redis_url, 2.0)
            assert stored_rounds(check, prefix) == rounds, "every journaled round stored once"
            check.close()

            def shown() -> float:
                return sum(learner.segment_counts(f"seg{i}").rounds for i in range(3))

            # and shown once, by the snapshot that follows the last replay, nothing left on top
            assert wait_until(lambda: shown() == pytest.approx(rounds, rel=1e-6), timeout=5), shown()
    print(
        f"\njournal of {size / 1e6:.1f} MB ({rounds} rounds): answering after {listening_after:.2f}s with {left} of 50 "
        f"reports still journaled; all replayed after {replayed_after:.2f}s"
    )
    assert listening_after < replayed_after


def test_a_torn_last_line_is_skipped_with_one_log_line(
    tmp_path: Path, embedded_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    rounds = write_journal(state / "journal.jsonl", reports=3, per_report=2, torn_tail=True)
    with caplog.at_level(logging.INFO), running_daemon(state, embedded_redis_url) as daemon:
        learner = daemon.controller.learner
        assert wait_until(lambda: not len(learner.journal), timeout=20)
        check = make_client(embedded_redis_url, 2.0)
        assert stored_rounds(check, daemon.config.learning.prefix) == rounds
        check.close()
    torn = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn) == 1 and torn[0].levelno == logging.WARNING, [r.getMessage() for r in torn]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "skipped, not an error, not a crash"


def test_journal_settings_are_validated(tmp_path: Path) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text("learning:\n  journal_max_bytes: 100\nredis_restart_backoff_seconds: [5, 1]\n")
    from controller.config import load_config

    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert "learning.journal_max_bytes" in str(error.value) and "redis_restart_backoff_seconds" in str(error.value)
