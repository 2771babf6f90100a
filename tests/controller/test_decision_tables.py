"""Decision tables pushed to workers (WatchDecisions): the local rule (pure), and the whole path over a real
ControllerDaemon on a loopback socket with the embedded Redis: a worker's client that watches the tables answers
locally exactly what Decide answers, asks Decide for what the tables cannot say, follows changes, survives the
controller going away, and the controller bounds its streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from controller.config import ControllerConfig
from controller.serving.table_publisher import HEARTBEAT_PERIODS, PROBE_DRAWS, segment_table
from specd_api.plan import BATCH_RULE_REASON, Plan, off
from specd_api.request_features import RequestFeatures
from specd_api.table_rule import BucketEntry, SegmentTable, plan_from_table
from specd_api.v1 import controller_pb2 as pb
from specd_client import ClientConfig
from tests import daemons
from tests.controller.test_client import DECIDE_ARGS, REPORT_ARGS, draft, lookup, started, stub_for
from tests.daemons import DEFAULT_POLICY, running

DRAFTERS = ("draft", "prompt_lookup")
WAIT_S = 10.0

# --- the local rule ---------------------------------------------------------------------------------------------


def plan(drafter: str, k: int, speedup: float, cost_ratio: float = 0.1, exploration: bool = False) -> Plan:
    return Plan(drafter, k, "exploration" if exploration else "best_expected_speedup", "v1",
                exploration=exploration, expected_speedup=speedup, segment="s", cost_ratio=cost_ratio)  # fmt: skip


ABOVE = off(BATCH_RULE_REASON, "v1", "s")
TABLE = SegmentTable(
    segment="s",
    max_batch_size=6,
    min_new_tokens=11,
    prefill_cost_per_token=0.02,
    buckets={
        1: BucketEntry(plan("draft", 5, 1.5), ((plan("prompt_lookup", 10, 1.2, 0.0, True), 0.25),)),
        2: BucketEntry(plan("draft", 3, 1.3)),
        4: BucketEntry(plan("prompt_lookup", 6, 1.1, 0.0)),
        8: BucketEntry(off("low_expected_speedup", "v1", "s", 0.9)),
    },
    above_max_batch_size=ABOVE,
)


@pytest.mark.parametrize(
    ("batch_size", "expected"),
    [(1, TABLE.buckets[1].plan), (2, TABLE.buckets[2].plan), (3, TABLE.buckets[4].plan),
     (4, TABLE.buckets[4].plan), (5, TABLE.buckets[8].plan), (6, TABLE.buckets[8].plan), (7, ABOVE), (64, ABOVE)],
)  # fmt: skip
def test_a_request_gets_its_batch_buckets_plan_and_none_above_the_batch_rule(batch_size, expected):
    assert plan_from_table(TABLE, batch_size, 128, 10, draw=0.9) == expected


def test_a_probe_is_drawn_with_its_share():
    assert plan_from_table(TABLE, 1, 128, 10, draw=0.24).exploration
    assert not plan_from_table(TABLE, 1, 128, 10, draw=0.25).exploration
    shares = [plan_from_table(TABLE, 1, 128, 10, draw=i / 1000).exploration for i in range(1000)]
    assert sum(shares) == 250


def test_the_table_does_not_answer_what_decide_may_answer_differently():
    assert plan_from_table(TABLE, 1, 10, 10, draw=0.9) is None, "fewer new tokens than min_new_tokens: K is capped"
    assert plan_from_table(TABLE, 1, 11, 10, draw=0.9) == TABLE.buckets[1].plan
    # the draft at 1.5x saves 128 / 3 = 42.7 steps; its prefill of P prompt tokens costs 0.1 * 0.02 * P steps
    assert plan_from_table(TABLE, 1, 128, 21_000, draw=0.9) == TABLE.buckets[1].plan  # 42 steps
    assert plan_from_table(TABLE, 1, 128, 21_500, draw=0.9) is None  # 43 steps: Decide picks another arm
    assert plan_from_table(TABLE, 3, 128, 10**6, draw=0.9) == TABLE.buckets[4].plan, "lookup has no prefill"
    assert plan_from_table(TABLE, 5, 128, 10**6, draw=0.9) == TABLE.buckets[8].plan, "off: nothing to repay"
    sparse = SegmentTable("s", 8, 11, 0.02, {1: TABLE.buckets[1]}, ABOVE)
    assert plan_from_table(sparse, 2, 128, 10, draw=0.9) is None, "a bucket the table lacks"


def test_a_table_survives_its_wire_form():
    msg = pb.SegmentTable(segment="s", max_batch_size=6, min_new_tokens=11, prefill_cost_per_token=0.02)
    for bucket, entry in TABLE.buckets.items():
        added = msg.buckets.add(batch_bucket=bucket, plan=entry.plan.to_proto())
        for probe, share in entry.probes:
            added.probes.add(plan=probe.to_proto(), probability=share)
    msg.above_max_batch_size.CopyFrom(ABOVE.to_proto())
    assert SegmentTable.from_proto(pb.SegmentTable.FromString(msg.SerializeToString())) == TABLE


# --- over gRPC, with a real daemon ------------------------------------------------------------------------------


def policy(exploration: float) -> str:
    """The default policy with exploration at ``exploration`` (a switched-off segment probes at 0.6 of it)."""
    text = DEFAULT_POLICY.read_text()
    text = text.replace("min_exploration_rate: 0.02", f"min_exploration_rate: {0.6 * exploration}")
    text = text.replace("exploration_rate: 0.25", f"exploration_rate: {exploration}")
    assert f"exploration_rate: {exploration}" in text
    return text


def daemon_config(
    redis_url: str, folder: Path, prefix: str, exploration: float = 0.0, port: int = 0, max_watchers: int = 8
) -> ControllerConfig:
    return daemons.daemon_config(
        redis_url, folder, policy(exploration), listen=f"127.0.0.1:{port}", max_watchers=max_watchers,
        shutdown_grace_seconds=0.5, learning={"prefix": prefix},
    )  # fmt: skip


def client_config(address: str, watch: tuple[str, ...] = DRAFTERS) -> ClientConfig:
    return ClientConfig(address=address, worker_id="w-tables", decide_deadline_ms=2000.0, report_interval_s=0.05,
                        reconnect_backoff_s=(0.05, 0.2), watch_decisions=watch)  # fmt: skip


def teach(client, segment: str, requests: int = 12) -> None:
    """Rounds of a segment where the draft does well and prompt lookup finds little."""
    for _ in range(requests):
        rounds = [draft(4, 4, 3), draft(4, 4, 4), draft(4, 4, 2), lookup(4, 1, 0)]
        client.report(segment=segment, rounds=rounds, **REPORT_ARGS)


def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def decide_args(batch_size: int, **changes) -> dict:
    return {**DECIDE_ARGS, "batch_size": batch_size, "max_new_tokens": 128, "prompt_tokens": 10, **changes}


def features(segment: str, batch_size: int, **changes) -> RequestFeatures:
    return RequestFeatures(segment=segment, **decide_args(batch_size, **changes))


def rpc_decide(address: str, segment: str, batch_size: int) -> pb.Decision:
    args = decide_args(batch_size)
    return stub_for(address).Decide(
        pb.DecideRequest(
            segment=segment, batch_size=batch_size, drafters=args["drafters"], max_new_tokens=args["max_new_tokens"],
            prompt_tokens=args["prompt_tokens"], sampling=pb.SamplingParams(temperature=0.0),
            prompt_features=pb.PromptFeatures(self_repetition=args["self_repetition"]),
        ),
        timeout=5,
    )  # fmt: skip


def same_plan(local: Plan, decided: pb.Decision) -> bool:
    answer = Plan.from_proto(decided)
    keys = ("drafter", "k", "reason", "policy_version", "expected_speedup", "acceptance", "proposal", "cost_ratio",
            "verify_cost", "stop_threshold", "counterfactual_ks", "prior_strength")  # fmt: skip
    return all(getattr(local, key) == getattr(answer, key) for key in keys)


def test_local_decisions_equal_decide_and_follow_new_segments(embedded_redis_url, prefix, tmp_path):
    with running(daemon_config(embedded_redis_url, tmp_path, prefix)) as daemon:
        with started(client_config(daemon.address, watch=())) as reporter:
            teach(reporter, "tab-code")
            teach(reporter, "tab-young", requests=1)  # 4 rounds: its own data weighs less than the prior (20)
            wait_for(lambda: reporter.stats().buffered == 0 and reporter.stats().aggregates_sent > 0, "the report")
        with started(client_config(daemon.address)) as client:
            wait_for(
                lambda: client.decide(features("tab-code", 1)).origin.source == "table",
                "the tables",
            )
            for batch_size in (1, 2, 3, 4, 5, 8, 9, 16):
                local = client.decide(features("tab-code", batch_size))
                assert local.origin.source == "table", batch_size
                assert same_plan(local, rpc_decide(daemon.address, "tab-code", batch_size)), batch_size
            assert client.decide(features("tab-code", 1)).speculates
            assert client.decide(features("tab-code", 9)).reason == BATCH_RULE_REASON

            # what the table cannot say goes to Decide
            assert client.decide(features("tab-unseen", 1)).origin.source == "controller"
            assert client.decide(features("tab-young", 1)).origin.source == "controller"
            short = client.decide(features("tab-code", 1, max_new_tokens=8))
            assert short.origin.source == "controller" and short.k <= 7
            other = client.decide(features("tab-code", 1, drafters=["prompt_lookup"]))
            assert other.origin.source == "controller" and other.drafter != "draft"

            # a sampled request is its segment's sampled traffic, learned apart: the greedy table does not answer it
            sampled = client.decide(features("tab-code", 1, temperature=0.9))
            assert sampled.origin.source == "controller" and sampled.segment == "tab-code#sampled"
            for _ in range(12):
                client.report(segment="tab-code", rounds=[draft(4, 4, 1), draft(4, 4, 0)],
                              **{**REPORT_ARGS, "temperature": 0.9})  # fmt: skip
            wait_for(lambda: client.decide(features("tab-code", 1, temperature=0.9)).origin.source == "table",
                     "the sampled table")  # fmt: skip
            sampled = client.decide(features("tab-code", 1, temperature=0.9))
            assert sampled.segment == "tab-code#sampled"
            assert sampled.acceptance != client.decide(features("tab-code", 1)).acceptance

            # a segment learned after the stream opened arrives in a later (partial) message
            teach(client, "tab-later")
            wait_for(
                lambda: client.decide(features("tab-later", 1)).origin.source == "table",
                "the new segment",
            )
            stats = client.stats()
            assert stats.local_decisions >= 10 and stats.fallbacks == {}
            assert daemon.publisher is not None and daemon.publisher.watchers == 1
        wait_for(lambda: daemon.publisher.watchers == 0, "the closed stream to end")


def test_tables_go_quiet_when_the_controller_stops_and_come_back_with_it(embedded_redis_url, prefix, tmp_path):
    config = daemon_config(embedded_redis_url, tmp_path, prefix)
    with running(config) as daemon:
        port = daemon.port
        with started(client_config(daemon.address, watch=())) as reporter:
            teach(reporter, "tab-restart")
            wait_for(lambda: reporter.stats().buffered == 0, "the report")
    address = f"127.0.0.1:{port}"
    with started(client_config(address)) as client:
        with running(daemon_config(embedded_redis_url, tmp_path, prefix, port=port)):
            wait_for(
                lambda: client.decide(features("tab-restart", 1)).origin.source == "table",
                "the tables",
            )
            learned = client.decide(features("tab-restart", 1))
        # the controller is gone: within 3 heartbeat periods (HEARTBEAT_PERIODS refreshes each) the tables are no
        # longer used, and decisions fall back to the segment's last plan (which the tables gave)
        time.sleep(3 * HEARTBEAT_PERIODS * 0.1 + 0.2)
        fallback = client.decide(features("tab-restart", 1))
        assert fallback.origin.source == "last_decision" and fallback.drafter == learned.drafter
        with running(daemon_config(embedded_redis_url, tmp_path, prefix, port=port)):
            wait_for(
                lambda: client.decide(features("tab-restart", 1)).origin.source == "table",
                "reconnection",
            )


def test_probes_come_from_the_table_at_the_controllers_rate(embedded_redis_url, prefix, tmp_path):
    """A segment switched off (the draft is poor, prompt lookup finds nothing), which Decide still probes on a
    share of requests (min_exploration_rate, plus Thompson draws that favour the draft); local decisions probe the
    same share (both estimated over many draws: within 5 standard errors)."""
    with running(daemon_config(embedded_redis_url, tmp_path, prefix, exploration=0.5)) as daemon:
        with started(client_config(daemon.address, watch=())) as reporter:
            for _ in range(12):  # 60 rounds: past prior_strength (20), so in the tables
                reporter.report(segment="tab-probe", rounds=[draft(4, 4, 0)] * 4 + [lookup(4, 0, 0)], **REPORT_ARGS)
            wait_for(lambda: reporter.stats().buffered == 0, "the report")
        n = 600
        rpc = sum(rpc_decide(daemon.address, "tab-probe", 1).exploration for _ in range(n)) / n
        stream = stub_for(daemon.address).WatchDecisions(pb.WatchDecisionsRequest(worker_id="raw", drafters=DRAFTERS))
        table = next(t for t in next(stream).segments if t.segment == "tab-probe")
        stream.cancel()
        shares = [p.probability for p in table.buckets[0].probes]
        with started(client_config(daemon.address)) as client:
            wait_for(
                lambda: client.decide(features("tab-probe", 1)).origin.source == "table",
                "the tables",
            )
            # Every refresh (0.1 s here) brings a table with a new 64-draw estimate of the share: compare the
            # client's draws with the one table they were all drawn from (a run that a refresh split is redone).
            watcher = client._tables
            assert watcher is not None
            for _ in range(20):
                used = watcher._tables
                plans = [client.decide(features("tab-probe", 1)) for _ in range(n)]
                if watcher._tables is used:
                    break
            else:
                pytest.fail("every run of draws straddled a table refresh")
        assert all(p.origin.source == "table" for p in plans)
        local = sum(p.exploration for p in plans) / n
        entry = used["tab-probe"].buckets[1]
        ((_, drawn_at),) = entry.probes
        assert 0.05 < rpc < 0.95, f"the segment must be one Decide probes in: {rpc}"
        assert len(shares) == 1 and table.buckets[0].probes[0].plan.drafter == "draft"
        (share,) = shares
        # the client draws probes at its table's share (600 draws); a table's share estimates Decide's rate (64
        # draws at the controller, 600 Decide calls here)
        assert abs(local - drawn_at) < 5 * (drawn_at * (1 - drawn_at) / n) ** 0.5, (local, drawn_at)
        assert abs(share - rpc) < 5 * (rpc * (1 - rpc) * (1 / n + 1 / PROBE_DRAWS)) ** 0.5, (share, rpc)


def test_streams_are_bounded_and_bad_requests_refused(embedded_redis_url, prefix, tmp_path):
    with running(daemon_config(embedded_redis_url, tmp_path, prefix, max_watchers=1)) as daemon:
        stub = stub_for(daemon.address)
        first = stub.WatchDecisions(pb.WatchDecisionsRequest(worker_id="a", drafters=["draft"]))
        assert next(first).full
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.WatchDecisions(pb.WatchDecisionsRequest(worker_id="b", drafters=["draft"]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers" in refused.value.details()
        first.cancel()
        wait_for(lambda: daemon.publisher.watchers == 0, "the cancelled stream to end")
        with pytest.raises(grpc.RpcError) as bad:
            next(stub.WatchDecisions(pb.WatchDecisionsRequest(worker_id="c", drafters=["medusa"]), timeout=5))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "drafters[0]" in bad.value.details()
        with pytest.raises(grpc.RpcError) as bad:  # each drafter once, at most 16
            next(stub.WatchDecisions(pb.WatchDecisionsRequest(worker_id="c", drafters=["draft"] * 17), timeout=5))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16" in bad.value.details()
        raw = daemon_channel_call(daemon.address, b"\x0a\x02\xff\xfe")  # worker_id: bytes that are not UTF-8
        assert raw == grpc.StatusCode.INVALID_ARGUMENT


def daemon_channel_call(address: str, payload: bytes) -> grpc.StatusCode:
    channel = grpc.insecure_channel(address)
    call = channel.unary_stream("/specd.v1.Controller/WatchDecisions")(payload, timeout=5)
    try:
        next(call)
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()
    raise AssertionError("undecodable bytes were answered")


def test_stream_ends_at_shutdown_without_holding_the_grace_period(embedded_redis_url, prefix, tmp_path):
    from controller.server import ControllerDaemon

    config = daemon_config(embedded_redis_url, tmp_path, prefix).model_copy(update={"shutdown_grace_seconds": 5.0})
    daemon = ControllerDaemon(config)
    daemon.startup()
    stream = stub_for(daemon.address).WatchDecisions(pb.WatchDecisionsRequest(worker_id="a", drafters=["draft"]))
    assert next(stream).full
    started_at = time.monotonic()
    drain = daemon.shutdown()
    assert time.monotonic() - started_at < 2.5, "the stream held the 5 s grace period"
    assert drain.cut_short["RPCs cancelled at the end of the grace period"] == 0
    try:
        rest = list(stream)
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
    else:
        assert all(not m.full for m in rest)


# --- a refresh rebuilds only what changed -----------------------------------------------------------------------

# The daemon's clock stands still in these tests: every report lands in the current time bucket, which weighs 1, so
# counts move only when reports arrive (a closed bucket's decay would move them at each refresh).
FIXED_NOW = 1_800_000_030.0


def stream_of(address: str, worker_id: str = "w") -> Iterator[pb.DecisionTables]:
    return stub_for(address).WatchDecisions(
        pb.WatchDecisionsRequest(worker_id=worker_id, drafters=DRAFTERS), timeout=30
    )


def teach_at_the_fleet_prior(client, segment: str, requests: int = 8) -> None:
    """Draft rounds that accept 3 of every 5 verified tokens: the policy's prior_alpha (0.6) for the draft, so the
    fleet's acceptance, which every segment's prior reads, stays where it is whatever a report adds."""
    for _ in range(requests):
        client.report(segment=segment, rounds=[draft(4, 4, 2), draft(4, 4, 1)] * 2, **REPORT_ARGS)


def learned(daemon, reporter, segments: list[str], rounds: float) -> None:
    """Wait until the reports left the client and the daemon's snapshot holds ``rounds`` rounds of each segment."""
    wait_for(lambda: reporter.stats().buffered == 0 and reporter.stats().aggregates_sent > 0, "the reports")
    learner = daemon.controller.learner
    wait_for(lambda: all(learner.segment_counts(s).rounds >= rounds for s in segments), "the snapshot")


def test_a_refresh_without_new_reports_rebuilds_no_table_and_sends_none(embedded_redis_url, prefix, tmp_path):
    """Exploration on, so that tables carry probe shares: a share drawn afresh at each refresh would change the
    table's bytes, and every refresh would resend it."""
    config = daemon_config(embedded_redis_url, tmp_path, prefix, exploration=0.5)
    with running(config, clock=lambda: FIXED_NOW) as daemon:
        segments = ["tab-a", "tab-b", "tab-probe"]
        with started(client_config(daemon.address, watch=())) as reporter:
            teach(reporter, "tab-a")
            teach(reporter, "tab-b")
            for _ in range(12):
                reporter.report(segment="tab-probe", rounds=[draft(4, 4, 0)] * 4 + [lookup(4, 0, 0)], **REPORT_ARGS)
            learned(daemon, reporter, segments, 48)
        stream = stream_of(daemon.address)
        first = next(stream)
        assert sorted(t.segment for t in first.segments) == segments
        assert any(len(t.buckets[0].probes) for t in first.segments), "no table probes: the test would prove nothing"
        publisher = daemon.publisher
        assert publisher is not None
        built = publisher.stats.tables_built
        updates = [next(stream) for _ in range(5)]  # five refreshes (0.1 s each)
        stream.cancel()
        assert [(len(u.segments), len(u.removed)) for u in updates] == [(0, 0)] * 5, "heartbeats only"
        assert publisher.stats.tables_built == built, "no table was recomputed"
        assert publisher.stats.tables_kept >= 3 * len(segments), "the refreshes went over every segment"
        again = [segment_table(daemon.controller, "tab-probe", DRAFTERS) for _ in range(2)]
        assert again[0] is not None and again[0].buckets[0].probes
        assert again[0] == again[1], "recomputed from the same inputs, the probe shares come out the same"


def test_a_report_to_one_segment_rebuilds_and_resends_its_table_alone(embedded_redis_url, prefix, tmp_path):
    config = daemon_config(embedded_redis_url, tmp_path, prefix, exploration=0.5)
    with running(config, clock=lambda: FIXED_NOW) as daemon:
        segments = ["tab-a", "tab-b", "tab-c"]
        with started(client_config(daemon.address, watch=())) as reporter:
            for segment in segments:
                teach_at_the_fleet_prior(reporter, segment)
            learned(daemon, reporter, segments, 32)
            stream = stream_of(daemon.address)
            assert sorted(t.segment for t in next(stream).segments) == segments
            publisher = daemon.publisher
            assert publisher is not None
            assert next(stream).segments == [] and next(stream).segments == [], "settled: heartbeats"
            built = publisher.stats.tables_built
            teach_at_the_fleet_prior(reporter, "tab-b", requests=4)
            learned(daemon, reporter, ["tab-b"], 48)
            changed = next(m for m in stream if m.segments or m.removed)
            stream.cancel()
        assert [t.segment for t in changed.segments] == ["tab-b"] and not changed.removed
        assert publisher.stats.tables_built == built + 1, "tab-a and tab-c were kept"


def test_streams_opened_together_wait_for_one_build(embedded_redis_url, prefix, tmp_path):
    """As when a controller restarts and every worker reconnects: the first streams find no tables; one of them
    builds them while the others wait, so each segment's table is computed once."""
    streams = 8
    config = daemon_config(embedded_redis_url, tmp_path, prefix, exploration=0.5, max_watchers=streams)
    with running(config, clock=lambda: FIXED_NOW) as daemon:
        segments = [f"tab-{i}" for i in range(40)]
        with started(client_config(daemon.address, watch=())) as reporter:
            for segment in segments:
                teach(reporter, segment, requests=6)
            learned(daemon, reporter, segments, 24)
        publisher = daemon.publisher
        assert publisher is not None and publisher.stats.tables_built == 0
        start = threading.Barrier(streams)

        def first_message(i: int) -> pb.DecisionTables:
            stream = stream_of(daemon.address, f"w{i}")
            start.wait()
            message = next(stream)
            stream.cancel()
            return message

        with futures.ThreadPoolExecutor(streams) as pool:
            messages = list(pool.map(first_message, range(streams)))
        assert all(m.full and len(m.segments) == len(segments) for m in messages)
        assert publisher.stats.tables_built == len(segments), "each table computed once"
