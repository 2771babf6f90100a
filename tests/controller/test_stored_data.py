"""Stored data the controller cannot read never stops it (DESIGN contract 7): a non-JSON prior, bad sample
rows, a position field of 3,000,000, a key of the wrong type at one segment's bucket. Real Redis, and a real daemon
for the start-up case."""

from __future__ import annotations

import time

import pytest

from controller.decision.counts import SegmentCounts
from controller.decision.learner import Learner
from controller.storage.journal import Journal
from controller.storage.redis_schema import sample_row
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_store import small
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon

T0 = 1_700_000_000.0


def make(redis_client, prefix: str, tmp_path) -> tuple[TelemetryStore, Learner]:
    store = TelemetryStore(redis_client, StoreConfig(prefix=prefix), lambda: T0)
    return store, Learner(store, Journal(tmp_path / "journal.jsonl", 100, 2**20), clock=lambda: T0)


@pytest.mark.parametrize("value", [b"{not json", b"[1, 2]", b"\xff\xfe", b"null", b'"a string"'])
def test_an_unreadable_prior_is_skipped_and_learning_goes_on(redis_client, prefix, tmp_path, value) -> None:
    store, learner = make(redis_client, prefix, tmp_path)
    store.ingest("r1", [small("chat", rounds=3)])
    redis_client.set(store.keys.prior(), value)
    assert learner.refresh() is True and not learner.stale
    assert learner.segment_counts("chat").rounds == 3
    assert learner.prior is None and store.skipped.count >= 1


def test_a_prior_key_of_another_type_is_skipped(redis_client, prefix, tmp_path) -> None:
    store, learner = make(redis_client, prefix, tmp_path)
    redis_client.rpush(store.keys.prior(), "x")
    assert learner.refresh() is True and store.skipped.count == 1
    assert learner.refresh() is True and store.skipped.count == 2  # counted at each read, logged once


def test_bad_sample_rows_are_skipped_and_the_good_ones_kept(redis_client, prefix, tmp_path) -> None:
    store, _ = make(redis_client, prefix, tmp_path)
    good = '{"drafter": "draft", "temperature": 0, "prompt_tokens": 10, "self_repetition": 0.1, "verified": 5, ' \
           '"accepted": 3, "at": 1}'  # fmt: skip
    bad = ["{oops", "[1]", '{"drafter": 3}', good.replace('"verified": 5', '"verified": -5'),
           good.replace('"accepted": 3', '"accepted": 9'), good.replace('"temperature": 0', '"temperature": NaN'),
           good.replace('"prompt_tokens": 10', '"prompt_tokens": "10"')]  # fmt: skip
    redis_client.rpush(store.keys.samples(), good, *bad, good)
    rows = store.read_samples(100)
    assert len(rows) == 2 and store.skipped.count == len(bad)
    assert sample_row(good) == rows[0]


def test_a_position_far_past_any_k_is_ignored() -> None:
    counts = SegmentCounts()
    counts.add_fields({"p|draft|3000000|offered": 5.0, "q|draft|3000000|verified": 5.0, "k|draft|3000000|rounds": 1.0,
                       "p|draft|0|offered": 2.0, "k|draft|4|rounds": 2.0})  # fmt: skip
    assert [i for _, i in counts.positions] == [0] and not counts.counterfactual
    assert list(counts.by_k) == [("draft", 4)]
    assert len(counts.position_list("draft")) == 1


def test_a_bucket_of_the_wrong_type_spoils_that_bucket_only(redis_client, prefix, tmp_path) -> None:
    store, learner = make(redis_client, prefix, tmp_path)
    store.ingest("r1", [small("good", rounds=3), small("bad", rounds=2)])
    redis_client.delete(store.keys.segment_bucket("bad", store.bucket(T0)))
    redis_client.rpush(store.keys.segment_bucket("bad", store.bucket(T0)), "x")  # a list where a hash belongs
    assert learner.refresh() is True and not learner.stale
    assert learner.segment_counts("good").rounds == 3  # every other segment still learns
    assert store.skipped.count >= 1
    redis_client.delete(store.keys.segments())
    redis_client.set(store.keys.segments(), "x")
    assert learner.refresh() is True and not learner.stale and learner.segments() == []


INFINITE_TOKENS = (
    b'{"format": "specd.prior.v1", "features": ["temperature", "log_prompt_tokens", "self_repetition"], '
    b'"trained_unix": 0, "tokens": Infinity, "by_drafter": {}}'
)  # JSON as Python writes it; int(inf) raised OverflowError, which the refresh did not expect


@pytest.mark.parametrize("prior", [b"\x00 not json", INFINITE_TOKENS, b"[" * 3000],
                         ids=["not-json", "infinite-tokens", "nested-past-the-recursion-limit"])  # fmt: skip
def test_the_controller_starts_and_decides_over_an_unreadable_prior(embedded_redis_url, tmp_path, prior) -> None:
    from controller.storage.redis_conn import make_client

    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with running_daemon(embedded_redis_url, tmp_path / "first", DEFAULT_POLICY.read_text()) as daemon:
        prefix = daemon.config.learning.prefix
    client = make_client(embedded_redis_url, 2.0)
    try:
        client.set(f"{prefix}:v1:prior", prior)
        client.rpush(f"{prefix}:v1:samples:{{#global}}", "{broken")
        started = time.monotonic()
        with running_daemon(embedded_redis_url, tmp_path / "second", DEFAULT_POLICY.read_text(),
                            learning={"prefix": prefix}) as daemon, connected(daemon) as channel:  # fmt: skip
            stub = pb_grpc.ControllerStub(channel)
            request = pb.DecideRequest(segment="chat", batch_size=1, drafters=["draft"], max_new_tokens=64)
            decision = stub.Decide(request, timeout=RPC_TIMEOUT)
            assert decision.drafter in ("draft", "none") and not decision.stale
            assert time.monotonic() - started < 30
    finally:
        client.delete(f"{prefix}:v1:prior", f"{prefix}:v1:samples:{{#global}}")
        client.close()


def test_reports_over_keys_of_the_wrong_type_are_stored_not_journaled(embedded_redis_url, tmp_path) -> None:
    """A cost bucket of another type (set ahead for the next minutes too), the samples list as a hash, the segments
    set as a string: each would fail every report with WRONGTYPE, so that every report is journaled, the controller
    is stale and every Decide says so, until the key goes. The report's writes replace them (a daemon over gRPC, its
    report process writing)."""
    from controller.storage.redis_conn import make_client
    from tests.controller.test_calibration_service import draft_request

    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as daemon, connected(daemon) as ch:
        assert daemon.controller is not None
        store = daemon.controller.learner.store
        client = make_client(embedded_redis_url, 2.0)
        now = store.bucket(time.time())
        try:
            for bucket in range(now, now + 3):
                client.set(store.keys.cost_bucket(bucket), "x")
            client.hset(store.keys.samples(), "a", "1")
            client.set(store.keys.segments(), "x")
            stub = pb_grpc.ControllerStub(ch)
            request = pb.ReportRoundsRequest(report_id="over-bad-keys", worker_id="w",
                                             aggregates=[draft_request("over-bad-keys")])  # fmt: skip
            reply = stub.ReportRounds(request, timeout=RPC_TIMEOUT)
            assert not reply.journaled and not reply.duplicate and reply.rounds_accepted == 20, reply
            deadline = time.monotonic() + 20
            while (stats := stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="over-bad-keys"),
                                                 timeout=RPC_TIMEOUT)).rounds < 20:  # fmt: skip
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            decision = stub.Decide(pb.DecideRequest(segment="over-bad-keys", batch_size=1, drafters=["draft"],
                                                    max_new_tokens=64), timeout=RPC_TIMEOUT)  # fmt: skip
            assert not decision.stale
            # the report's bucket (the minute may have turned since: any of the three it could be) is a hash again
            assert any(client.type(store.keys.cost_bucket(b)) == "hash" for b in range(now, now + 3))
        finally:
            client.delete(*(store.keys.cost_bucket(b) for b in range(now, now + 3)), store.keys.samples())
            client.close()


def test_unreadable_change_marks_start_again_under_a_new_epoch(redis_client, prefix, tmp_path) -> None:
    """A change marks' counter that holds no number is reset by the next report's marks under a new epoch. A reset
    under this writer's usual epoch, likely the one stored, would let a reader that had seen marks up to N read only
    the marks after N and keep the old counts of the segments marked 1..N (until the decay step moved)."""
    clock = [T0]
    config = StoreConfig(prefix=prefix, decay_step_seconds=60.0)
    store = TelemetryStore(redis_client, config, lambda: clock[0])
    learner = Learner(store, Journal(tmp_path / "journal.jsonl", 100, 2**20), clock=lambda: clock[0])
    for i, segment in enumerate("abcd"):
        store.ingest(f"r{i}", [small(segment, rounds=1)])
    assert learner.refresh() is True
    redis_client.hset(store.keys.change_state(), "seq", "x")  # the epoch field stays
    for i, segment in enumerate("abcda"):
        clock[0] += 0.1
        store.ingest(f"s{i}", [small(segment, rounds=1)])
    assert learner.refresh() is True
    fresh = Learner(TelemetryStore(redis_client, config, lambda: clock[0]),
                    Journal(tmp_path / "fresh.jsonl", 100, 2**20), clock=lambda: clock[0])  # fmt: skip
    assert fresh.refresh() is True
    assert {s: learner.segment_counts(s).rounds for s in "abcd"} == {s: fresh.segment_counts(s).rounds for s in "abcd"}
    assert fresh.segment_counts("a").rounds == pytest.approx(3, rel=0.01)  # decayed by a second at most
