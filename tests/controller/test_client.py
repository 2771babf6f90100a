"""The controller client library: conversions (pure, table-driven), fallbacks, and the client against a real
ControllerDaemon on a loopback socket over the embedded Redis, killed, restarted, or replaced by a fake server that
is slow or loses acknowledgements.

Counts are checked exactly: the daemons here use a half-life far beyond the test's duration, so decay cannot
scale them.
"""

from __future__ import annotations

import math
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import controller.server as server_module
from controller.config import ControllerConfig
from specd_api.checks import check_aggregate
from specd_api.plan import Origin, Plan
from specd_api.position_tally import PositionTally
from specd_api.request_features import RequestFeatures
from specd_api.rounds import RoundRecord, Scored
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_client import ClientConfig, ControllerClient, rounds_to_aggregates, self_repetition
from specd_client.buffer import ReportBuffer
from specd_client.fallback import DecisionMemory
from tests import daemons
from tests.daemons import DEFAULT_POLICY, FORCED_OFF_RULE, running
from tests.waiting import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
DEADLINE_MS = 5.0
LATENCY_BOUND_S = 0.050  # a fallback's p99 with a 5 ms deadline, with room for a loaded 2-core test machine
WAIT_S = 10.0


def round_record(
    drafter: str, k: int, num_drafted: int, num_accepted: int, num_emitted: int, draft_seconds: float = 0.001,
    verify_seconds: float = 0.01, batch_size: int = 1,
) -> RoundRecord:  # fmt: skip
    """A round record with the timings a test does not care about filled in."""
    return RoundRecord(drafter, k, num_drafted, num_accepted, num_emitted, draft_seconds, verify_seconds, batch_size)


def draft(k: int, proposed: int, accepted: int, emitted: int | None = None) -> RoundRecord:
    return round_record("draft", k, proposed, accepted, accepted + 1 if emitted is None else emitted)


def lookup(k: int, proposed: int, accepted: int) -> RoundRecord:
    return round_record("prompt_lookup", k, proposed, accepted, accepted + 1, draft_seconds=0.0)


def summary(a: pb.RoundsAggregate) -> tuple:
    """The counting fields of an aggregate: (drafter, K, rounds, proposed, accepted, emitted, per position...)."""
    return (
        a.drafter, a.k, a.rounds, a.num_drafted, a.num_accepted, a.tokens_emitted,
        list(a.proposed_per_position), list(a.verified_per_position), list(a.accepted_per_position),
    )  # fmt: skip


DECIDE_ARGS = dict(
    batch_size=1,
    drafters=["draft", "prompt_lookup"],
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    prompt_tokens=100,
    max_new_tokens=64,
    self_repetition=0.2,
)
REPORT_ARGS = dict(temperature=0.0, prompt_tokens=100, self_repetition=0.2)


# --- rounds -> aggregates ------------------------------------------------------------------------------

CONVERSIONS = [
    pytest.param([], [], id="no-rounds-no-aggregates"),
    # K 3, all three accepted: every position proposed, verified and accepted once; 3 + bonus emitted
    pytest.param([draft(3, 3, 3)], [("draft", 3, 1, 3, 3, 4, [1, 1, 1], [1, 1, 1], [1, 1, 1])], id="all-accepted"),
    # K 3, first token rejected: position 0 verified (nothing precedes it), 1 and 2 proposed but never verified
    pytest.param([draft(3, 3, 0)], [("draft", 3, 1, 3, 0, 1, [1, 1, 1], [1, 0, 0], [0, 0, 0])], id="first-rejected"),
    # K 3, two kept: position 2 is verified (both before it were accepted) and rejected
    pytest.param([draft(3, 3, 2)], [("draft", 3, 1, 3, 2, 3, [1, 1, 1], [1, 1, 1], [1, 1, 0])], id="third-rejected"),
    # three rounds add up position by position: accepted 3, 1, 0 -> accepted_at [2, 1, 1], verified_at [3, 2, 1]
    pytest.param(
        [draft(3, 3, 3), draft(3, 3, 1), draft(3, 3, 0)],
        [("draft", 3, 3, 9, 4, 7, [3, 3, 3], [3, 2, 1], [2, 1, 1])],
        id="three-rounds-sum",
    ),
    # prompt lookup asked for 4 but found 2 and 0 tokens: positions 2, 3 were never proposed
    pytest.param(
        [lookup(4, 2, 2), lookup(4, 0, 0)],
        [("prompt_lookup", 4, 2, 2, 2, 4, [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0])],
        id="lookup-proposes-fewer-than-k",
    ),
    # K 0 (speculation off, or the budget left no room) is a "none" round whatever drafter was named
    pytest.param(
        [round_record("draft", 0, 0, 0, 1), round_record("none", 0, 0, 0, 1)],
        [("none", 0, 2, 0, 0, 2, [], [], [])],
        id="k0-is-none",
    ),
    # K clamped to the budget for the last round: a second (drafter, K) group, after the first
    pytest.param(
        [draft(4, 4, 4), draft(2, 2, 1)],
        [
            ("draft", 4, 1, 4, 4, 5, [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]),
            ("draft", 2, 1, 2, 1, 2, [1, 1], [1, 1], [1, 0]),
        ],
        id="k-changes-within-a-request",
    ),
    # a stop string cut the round: 2 accepted but only 1 emitted; emitted is what the output got
    pytest.param([draft(2, 2, 2, emitted=1)], [("draft", 2, 1, 2, 2, 1, [1, 1], [1, 1], [1, 1])], id="cut-at-stop"),
    # two drafters interleaved: one aggregate each, in order of first appearance
    pytest.param(
        [lookup(2, 1, 0), draft(2, 2, 1), lookup(2, 2, 1)],
        [
            ("prompt_lookup", 2, 2, 3, 1, 3, [2, 1], [2, 1], [1, 0]),
            ("draft", 2, 1, 2, 1, 2, [1, 1], [1, 1], [1, 0]),
        ],
        id="two-drafters",
    ),
]


@pytest.mark.parametrize(("rounds", "expected"), CONVERSIONS)
def test_rounds_to_aggregates(rounds, expected):
    aggregates = rounds_to_aggregates("code", rounds, **REPORT_ARGS)
    assert [summary(a) for a in aggregates] == expected
    for a in aggregates:
        check_aggregate(a)  # and the controller accepts every one


def test_aggregates_carry_timings_and_request_features():
    rounds = [round_record("draft", 2, 2, 1, 2, draft_seconds=0.25, verify_seconds=0.5, batch_size=3)] * 2
    (a,) = rounds_to_aggregates("code", rounds, temperature=0.7, prompt_tokens=42, self_repetition=0.5)
    assert (a.segment, a.draft_seconds, a.verify_seconds) == ("code", 0.5, 1.0)
    assert (a.batch_size, a.temperature, a.prompt_tokens, a.self_repetition) == pytest.approx((3, 0.7, 42, 0.5))


def test_verification_time_is_kept_per_number_drafted():
    # prompt lookup found 0, 2 and 2 tokens: v(n) is learned from rounds that verified exactly n drafts
    rounds = [lookup(4, 0, 0), lookup(4, 2, 1), lookup(4, 2, 2)]
    rounds = [replace(r, draft_seconds=0.0, verify_seconds=0.01 * (1 + r.num_drafted)) for r in rounds]
    (a,) = rounds_to_aggregates("code", rounds, **REPORT_ARGS)
    assert list(a.rounds_by_drafted) == [1, 0, 2]
    assert list(a.verify_seconds_by_drafted) == pytest.approx([0.01, 0.0, 0.06])


def test_rounds_of_different_batch_buckets_are_reported_apart():
    # the costs of a round depend on the batch it ran in: 1, 2, 3-4, 5-8 ... are separate buckets
    rounds = [round_record("draft", 2, 2, 1, 2, batch_size=b) for b in (1, 1, 3, 4, 5)]
    aggregates = rounds_to_aggregates("code", rounds, **REPORT_ARGS)
    assert [(a.batch_size, a.rounds) for a in aggregates] == [(1, 2), (4, 2), (5, 1)]


def test_counterfactual_tallies_become_scored_aggregates():
    tally = PositionTally(rounds=4, proposed=[3, 2, 1], verified=[3, 2, 1], accepted=[2, 1, 0])
    (served, scored) = rounds_to_aggregates(
        "code", [draft(2, 2, 1)], **REPORT_ARGS, scored=[Scored("prompt_lookup", 3, tally)]
    )
    assert not served.counterfactual and scored.counterfactual
    assert summary(scored) == ("prompt_lookup", 3, 4, 6, 3, 0, [3, 2, 1], [3, 2, 1], [2, 1, 0])
    assert (scored.draft_seconds, scored.verify_seconds, list(scored.rounds_by_drafted)) == (0.0, 0.0, [])
    check_aggregate(scored)
    # suffix decoding, scored the same way (decoder.engine.SpeculativeDecoder.score), at its K ceiling of 16
    wide = PositionTally.of_width(16)
    wide.add(5, 3)
    (_, suffix) = rounds_to_aggregates("code", [draft(2, 2, 1)], **REPORT_ARGS, scored=[Scored("suffix", 16, wide)])
    assert (suffix.drafter, suffix.k, suffix.counterfactual, suffix.num_drafted, suffix.num_accepted) == (
        "suffix", 16, True, 5, 3,
    )  # fmt: skip
    check_aggregate(suffix)


def test_one_aggregate_per_request_carries_the_requests_calibration_observation():
    # The round policy ran K 1 first (the budget's start), K 4 for three rounds, then stopped drafting: the plan's
    # expectation goes with the request's totals on the aggregate with the most speculating rounds, once. A one-round
    # K 1 aggregate is no request's speedup (each aggregate an observation made a tail's 0.5x a third of the median).
    rounds = [round_record("draft", 1, 1, 0, 1, 0.001, 0.010), *[round_record("draft", 4, 4, 3, 4, 0.004, 0.020)] * 3,
              round_record("none", 0, 0, 0, 1, 0.0, 0.010)]  # fmt: skip
    aggregates = rounds_to_aggregates("code", rounds, **REPORT_ARGS, expected_speedup=1.5)
    carriers = [a for a in aggregates if a.expected_speedup]
    assert [(a.drafter, a.k, a.rounds, a.expected_speedup) for a in carriers] == [("draft", 4, 3, 1.5)]
    assert carriers[0].request_tokens_emitted == 1 + 3 * 4 + 1
    assert carriers[0].request_seconds == pytest.approx(0.011 + 3 * 0.024 + 0.010)
    assert not any(a.request_tokens_emitted or a.request_seconds for a in aggregates if not a.expected_speedup)
    for a in aggregates:
        check_aggregate(a)
    # a request that never drafted has nothing to calibrate
    plain = rounds_to_aggregates(
        "code", [round_record("none", 0, 0, 0, 1, 0.0, 0.01)], **REPORT_ARGS, expected_speedup=1.5
    )
    assert [(a.expected_speedup, a.request_tokens_emitted) for a in plain] == [(0.0, 0)]


REQUEST_TOTALS_REFUSED = [
    pytest.param(dict(request_tokens_emitted=5, request_seconds=0.1), "request_tokens_emitted", id="fewer-than-own"),
    pytest.param(dict(request_tokens_emitted=50, request_seconds=0.001), "request_seconds", id="shorter-than-own"),
    pytest.param(dict(request_tokens_emitted=50, request_seconds=math.inf), "request_seconds", id="infinite"),
    pytest.param(dict(request_tokens_emitted=50, request_seconds=0.0), "request_seconds", id="tokens-no-time"),
    pytest.param(
        dict(request_tokens_emitted=50, request_seconds=0.1, expected_speedup=0.0),
        "expected_speedup",
        id="totals-without-expectation",
    ),
]


@pytest.mark.parametrize(("fields", "named"), REQUEST_TOTALS_REFUSED)
def test_impossible_request_totals_are_refused_with_the_field_named(fields, named):
    (a,) = rounds_to_aggregates("code", [round_record("draft", 4, 4, 3, 4, 0.004, 0.02)] * 3, **REPORT_ARGS,
                                expected_speedup=1.5)  # fmt: skip
    check_aggregate(a)
    for name, value in fields.items():
        setattr(a, name, value)
    with pytest.raises(ValueError, match=named):
        check_aggregate(a)


IMPOSSIBLE = [
    # more accepted than proposed: acceptance counts proposed tokens
    pytest.param(draft(3, 2, 3), "num_accepted", id="accepted-above-proposed"),
    # more proposed than K asked for
    pytest.param(draft(2, 3, 0), "k", id="proposed-above-k"),
    # a round adds at most the accepted tokens and the bonus token
    pytest.param(draft(3, 3, 1, emitted=3), "num_emitted", id="emitted-above-accepted-plus-bonus"),
    pytest.param(round_record("draft", 2, 2, 1, 2, draft_seconds=-1.0), "draft_seconds", id="negative-seconds"),
    pytest.param(round_record("draft", 2, 2, 1, 2, verify_seconds=math.nan), "verify_seconds", id="nan-seconds"),
    pytest.param(round_record("none", 3, 2, 0, 1), "none", id="none-proposing-tokens"),
]


@pytest.mark.parametrize(("bad", "named"), IMPOSSIBLE)
def test_impossible_rounds_are_refused_with_the_round_named(bad, named):
    with pytest.raises(ValueError, match=rf"rounds\[1\].*{named}"):
        rounds_to_aggregates("code", [draft(2, 2, 1), bad], **REPORT_ARGS)


def test_random_rounds_always_make_aggregates_the_controller_accepts():
    rng = random.Random(7)
    for _ in range(300):
        rounds = []
        for _ in range(rng.randint(1, 30)):
            drafter = rng.choice(["draft", "prompt_lookup", "none"])
            k = 0 if drafter == "none" else rng.randint(0, 10)
            proposed = rng.randint(0, k) if drafter == "prompt_lookup" else k
            accepted = rng.randint(0, proposed)
            rounds.append(
                round_record(drafter, k, proposed, accepted, rng.randint(0, accepted + 1), rng.random() * 0.01)
            )
        aggregates = rounds_to_aggregates("random", rounds, **REPORT_ARGS, expected_speedup=1.2)
        for a in aggregates:
            check_aggregate(a)
        speculated = any(r.drafter != "none" and r.k for r in rounds)
        assert sum(bool(a.expected_speedup) for a in aggregates) == speculated  # one observation per request
        assert sum(a.request_tokens_emitted for a in aggregates) == (
            sum(r.num_emitted for r in rounds) if speculated else 0
        )
        assert sum(a.rounds for a in aggregates) == len(rounds)
        assert sum(a.num_accepted for a in aggregates) == sum(r.num_accepted for r in rounds)
        assert sum(a.tokens_emitted for a in aggregates) == sum(r.num_emitted for r in rounds)


def test_the_decoders_round_record_is_round_like():
    record = RoundRecord("draft", 4, 4, 2, 3, draft_seconds=0.01, verify_seconds=0.02)
    (a,) = rounds_to_aggregates("code", [record], **REPORT_ARGS)
    assert summary(a) == ("draft", 4, 1, 4, 2, 3, [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0])


SELF_REPETITION = [
    pytest.param([], 3, 0.0, id="empty"),
    pytest.param([1, 2], 3, 0.0, id="shorter-than-n"),  # no trigram at all
    pytest.param([1, 2, 3], 3, 0.0, id="one-trigram"),  # nothing before it to occur in
    pytest.param([1, 2, 3, 4, 5, 6], 3, 0.0, id="no-repeats"),
    # trigrams 123 231 312 123: the last occurred earlier -> 1 of 4
    pytest.param([1, 2, 3, 1, 2, 3], 3, 0.25, id="repeated-phrase"),
    # trigrams 555 555 555 555: all but the first occurred earlier (overlap counts) -> 3 of 4
    pytest.param([5, 5, 5, 5, 5, 5], 3, 0.75, id="one-token-repeated"),
    # bigrams 12 21 12 21: the last two occurred earlier -> 2 of 4
    pytest.param([1, 2, 1, 2, 1], 2, 0.5, id="bigrams"),
]


@pytest.mark.parametrize(("prompt", "n", "expected"), SELF_REPETITION)
def test_self_repetition(prompt, n, expected):
    assert self_repetition(prompt, n) == pytest.approx(expected)


# --- fallbacks ---------------------------------------------------------------------------------------

LAST = Plan("prompt_lookup", 6, "best_expected_speedup", "v1", expected_speedup=1.8, origin=Origin(latency_s=0.001))


def test_decision_memory_forgets_the_least_recently_used():
    memory = DecisionMemory(max_entries=2)
    memory.remember("a", LAST)
    memory.remember("b", LAST)
    assert memory.recall("a") is LAST  # "a" is now the most recently used
    memory.remember("c", LAST)
    assert (memory.recall("a"), memory.recall("b"), memory.recall("c")) == (LAST, None, LAST)
    assert len(memory) == 2


# --- the buffer ----------------------------------------------------------------------------------------


def aggregate(n: int) -> pb.RoundsAggregate:
    return pb.RoundsAggregate(segment=f"s{n}", drafter="none", rounds=1, tokens_emitted=1)


def test_buffer_drops_the_oldest_and_counts_them():
    buffer = ReportBuffer(capacity=4, max_per_report=10)
    buffer.add([aggregate(i) for i in range(3)])
    _, dropped = buffer.add([aggregate(i) for i in range(3, 6)])
    assert dropped == 2  # 6 added, room for 4: the two oldest go
    pending = buffer.take()
    assert pending is not None and [a.segment for a in pending.aggregates] == ["s2", "s3", "s4", "s5"]
    assert (buffer.counts().aggregates_dropped, buffer.counts().buffered) == (2, 4)


def test_buffer_keeps_a_pending_report_until_it_is_settled():
    buffer = ReportBuffer(capacity=4, max_per_report=2)
    buffer.add([aggregate(i) for i in range(3)])
    first = buffer.take()
    buffer.failed()
    assert buffer.take() is first  # a retry: same report_id, same contents
    _, dropped = buffer.add([aggregate(3), aggregate(4)])
    assert dropped == 1  # the pending two take room too: only two of the three waiting fit
    buffer.acknowledged(first)
    second = buffer.take()
    assert second is not None and second.report_id != first.report_id
    assert [a.segment for a in second.aggregates] == ["s3", "s4"]
    counts = buffer.counts()
    assert (counts.reports_sent, counts.aggregates_sent, counts.send_failures, counts.buffered) == (1, 2, 1, 2)


# --- configuration -------------------------------------------------------------------------------------

BAD_CONFIGS = [
    pytest.param({"decide_deadline_ms": 0}, "decide_deadline_ms", id="zero-deadline"),
    pytest.param({"default_drafter": "medusa"}, "default_drafter", id="unknown-drafter"),
    # "none" drafts nothing, a drafter drafts at least one token
    pytest.param({"default_k": 3}, "default_k", id="none-with-k"),
    pytest.param({"default_drafter": "draft"}, "default_k", id="draft-with-k0"),
    pytest.param({"max_buffered_aggregates": 0}, "max_buffered_aggregates", id="no-buffer"),
    # the controller refuses reports of more than 10 000 aggregates
    pytest.param({"max_aggregates_per_report": 1_001}, "max_aggregates_per_report", id="report-too-big"),
    pytest.param({"retry_backoff_s": (1.0, 0.5)}, "retry_backoff_s", id="backoff-max-below-min"),
    pytest.param({"worker_id": ""}, "worker_id", id="no-worker-id"),
    # replicas are listed as IP:port (test_targets.py has the rest of the rules)
    pytest.param({"address": "127.0.0.1:1,"}, "address", id="stray-comma-in-replicas"),
]


@pytest.mark.parametrize(("changes", "named"), BAD_CONFIGS)
def test_bad_config_is_refused_with_the_field_named(changes, named):
    with pytest.raises(ValueError, match=named):
        ClientConfig(**{"address": "127.0.0.1:1", "worker_id": "w", **changes})


# --- daemons and fakes ---------------------------------------------------------------------------------


def daemon_config(redis_url: str, folder: Path, prefix: str, port: int = 0) -> ControllerConfig:
    """The module daemon's setup (the default policy plus the `forced-off*` rule) for a daemon of a test's own, on
    ``port`` and ``prefix``: restarted on both, it finds what it learned."""
    return daemons.daemon_config(
        redis_url, folder, DEFAULT_POLICY.read_text() + FORCED_OFF_RULE, listen=f"127.0.0.1:{port}",
        shutdown_grace_seconds=0.5, learning={"prefix": prefix},
    )  # fmt: skip


@pytest.fixture
def prefix(embedded_redis_url) -> Iterator[str]:
    """A fresh Redis key prefix for a daemon; its keys are deleted afterwards."""
    name = f"c{uuid.uuid4().hex[:12]}"
    yield name
    daemons.forget_keys(embedded_redis_url, name)


def config(address: str, **changes) -> ClientConfig:
    fields = dict(address=address, worker_id="test-worker", decide_deadline_ms=DEADLINE_MS, report_interval_s=0.05)
    fields.update(retry_backoff_s=(0.05, 0.2), reconnect_backoff_s=(0.05, 0.2))
    fields.update(changes)
    return ClientConfig(**fields)


@contextmanager
def started(client_config: ClientConfig, **kwargs) -> Iterator[ControllerClient]:
    client = ControllerClient(client_config, **kwargs)
    client.start()
    try:
        yield client
    finally:
        client.close(flush_timeout_s=0.5)


def stub_for(address: str) -> pb_grpc.ControllerStub:
    return pb_grpc.ControllerStub(grpc.insecure_channel(address))


def segment_stats(stub: pb_grpc.ControllerStub, segment: str, rounds: float) -> pb.SegmentStats:
    """GetSegmentStats once the daemon's refresh has seen ``rounds`` rounds (or after WAIT_S)."""
    found: list[pb.SegmentStats] = []

    def seen() -> bool:
        found[:] = [stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=5)]
        return found[0].rounds >= rounds - 1e-6

    wait_until(seen)
    return found[0]


def k_stats(stats: pb.SegmentStats, drafter: str, k: int) -> tuple[float, float, float]:
    entry = next(e for d in stats.drafters if d.drafter == drafter for e in d.by_k if e.k == k)
    return entry.rounds, entry.proposed, entry.accepted


class FakeController(pb_grpc.ControllerServicer):
    """A controller that is slow, records what it is sent, and can forward reports to a real one while losing
    the first acknowledgements."""

    def __init__(self, decide_delay: float = 0.0, report_delay: float = 0.0) -> None:
        self.decide_delay = decide_delay
        self.report_delay = report_delay
        self.forward_to: pb_grpc.ControllerStub | None = None
        self.acks_to_lose = 0
        self.decide_metadata: list[dict[str, str]] = []
        self.reports: list[pb.ReportRoundsRequest] = []
        self.responses: list[pb.ReportRoundsResponse] = []

    def Decide(self, request, context):
        self.decide_metadata.append(dict(context.invocation_metadata()))
        time.sleep(self.decide_delay)
        return pb.Decision(drafter="draft", k=4, reason="fake", policy_version="fake")

    def GetPolicy(self, request, context):
        return pb.PolicyInfo(version="fake")

    def ReportRounds(self, request, context):
        self.reports.append(request)
        time.sleep(self.report_delay)
        response = pb.ReportRoundsResponse(rounds_accepted=sum(a.rounds for a in request.aggregates))
        if self.forward_to is not None:
            response = self.forward_to.ReportRounds(request, timeout=5)
            self.responses.append(response)
        if self.acks_to_lose > 0:  # stored, but the worker never hears so
            self.acks_to_lose -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset after the report was stored")
        return response


@contextmanager
def serving(servicer: FakeController) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ControllerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def p(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# --- decide against the daemon ----------------------------------------------------------------------------

RULE_CASES = [
    # the default policy switches speculation off above batch 8 (contract 6)
    pytest.param("chat", 9, ("none", 0, "batch_size_above_threshold"), id="batch-rule"),
    # the test policy's `forced-off*` rule forces "none"
    pytest.param("forced-off-prompts", 1, ("none", 0, "policy_off"), id="policy-rule"),
]


@pytest.mark.parametrize(("segment", "batch_size", "expected"), RULE_CASES)
def test_decide_returns_the_controllers_decision(daemon, segment, batch_size, expected):
    version = stub_for(daemon.address).GetPolicy(pb.GetPolicyRequest(), timeout=5).version
    with started(config(daemon.address, decide_deadline_ms=1000)) as client:
        outcome = client.decide(RequestFeatures(segment=segment, **{**DECIDE_ARGS, "batch_size": batch_size}))
    assert (outcome.drafter, outcome.k, outcome.reason) == expected
    assert (outcome.origin.source, outcome.origin.fallback, outcome.policy_version) == ("controller", None, version)
    assert 0 < outcome.origin.latency_s < 1.0


def test_decide_never_raises(daemon):
    with started(config(daemon.address, decide_deadline_ms=1000)) as client:
        # the controller refuses a segment with a space (INVALID_ARGUMENT): "error", not an exception
        refused = client.decide(RequestFeatures(segment="a b", **DECIDE_ARGS))
        # 2**40 does not fit the int32 field: the request cannot even be built
        unbuildable = client.decide(RequestFeatures(segment="chat", **{**DECIDE_ARGS, "prompt_tokens": 2**40}))
        stats = client.stats()
    not_started = ControllerClient(config(daemon.address)).decide(RequestFeatures(segment="chat", **DECIDE_ARGS))
    assert (refused.origin.fallback, refused.origin.source) == ("error", "local_default")
    assert (unbuildable.origin.fallback, unbuildable.origin.source) == ("error", "local_default")
    assert (not_started.origin.fallback, not_started.origin.source) == ("unavailable", "local_default")
    assert (stats.decisions, stats.fallbacks) == (2, {"error": 2})


# --- fallbacks when the controller is gone or slow --------------------------------------------------------


def test_killed_controller_falls_back_within_the_deadline(tmp_path, embedded_redis_url, prefix):
    """`specd controller` as a real process, killed with SIGKILL: decide keeps answering, from memory for a
    segment it has seen and from the local default for one it has not."""
    port = free_port()
    config_file = tmp_path / "controller.yaml"
    config_file.write_text(
        f"listen: 127.0.0.1:{port}\nredis_url: {embedded_redis_url}\npolicy_path: {DEFAULT_POLICY}\n"
        f"state_dir: {tmp_path / 'state'}\nlearning: {{prefix: {prefix}}}\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "specd", "controller", "--config", str(config_file)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with started(config(f"127.0.0.1:{port}")) as client:
            assert client.wait_until_ready(60), "the controller did not start"
            for _ in range(200):  # a cold controller may miss the 5 ms deadline on its first decisions
                seen = client.decide(RequestFeatures(segment="seen", **DECIDE_ARGS))
                if seen.origin.source == "controller":
                    break
            assert seen.origin.source == "controller", seen
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

            outcomes, latencies = [], []
            for i in range(60):
                start = time.perf_counter()
                outcomes.append(client.decide(RequestFeatures(segment="seen" if i % 2 else "unseen", **DECIDE_ARGS)))
                latencies.append(time.perf_counter() - start)
            stats = client.stats()
    finally:
        if process.poll() is None:
            process.kill()
    p50, p99 = p(latencies, 0.5) * 1e3, p(latencies, 0.99) * 1e3
    print(f"fallback latency, controller killed: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    assert p99 < LATENCY_BOUND_S * 1e3
    assert all(o.origin.fallback in ("unavailable", "timeout") for o in outcomes)
    # the seen segment keeps its last decision; the unseen one gets the local default ("none")
    assert {(o.drafter, o.k, o.origin.source) for o in outcomes[1::2]} == {(seen.drafter, seen.k, "last_decision")}
    assert {(o.drafter, o.k, o.origin.source) for o in outcomes[0::2]} == {("none", 0, "local_default")}
    assert stats.fallbacks.get("unavailable", 0) + stats.fallbacks.get("timeout", 0) >= 60


def test_slow_controller_is_a_timeout_within_the_deadline():
    slow = FakeController(decide_delay=0.3)
    with serving(slow) as address, started(config(address)) as client:
        assert client.wait_until_ready(5)
        latencies, outcomes = [], []
        for _ in range(20):
            start = time.perf_counter()
            outcomes.append(client.decide(RequestFeatures(segment="chat", **DECIDE_ARGS)))
            latencies.append(time.perf_counter() - start)
    print(f"timeout fallback latency: p50 {p(latencies, 0.5) * 1e3:.2f} ms, max {max(latencies) * 1e3:.2f} ms")
    assert {(o.origin.fallback, o.origin.source) for o in outcomes} == {("timeout", "local_default")}
    assert min(latencies) >= DEADLINE_MS / 1000 * 0.9  # it did wait for the deadline ...
    assert p(latencies, 0.99) < LATENCY_BOUND_S  # ... and not much longer


def test_never_reachable_controller_gives_local_defaults():
    with started(config(f"127.0.0.1:{free_port()}", default_drafter="prompt_lookup", default_k=5)) as c:
        outcome = c.decide(RequestFeatures(segment="chat", **DECIDE_ARGS))
    assert (outcome.drafter, outcome.k, outcome.reason) == ("prompt_lookup", 5, "local_default")
    assert (outcome.origin.fallback, outcome.origin.source, outcome.stale) == ("unavailable", "local_default", True)


# --- reports ---------------------------------------------------------------------------------------------

# 3 rounds of draft K 3 (accepted 3, 1, 0), 1 of prompt lookup K 4 (2 proposed, 2 accepted), 1 without speculation
REQUEST_ROUNDS = [draft(3, 3, 3), draft(3, 3, 1), draft(3, 3, 0), lookup(4, 2, 2), round_record("none", 0, 0, 0, 1)]


def test_reports_arrive_with_exact_totals(daemon):
    segment = f"rep-{uuid.uuid4().hex[:8]}"
    with started(config(daemon.address)) as client:
        for _ in range(4):  # four requests
            client.report(segment=segment, rounds=REQUEST_ROUNDS, **REPORT_ARGS)
        assert wait_until(lambda: client.stats().aggregates_sent == 12)
        stats = client.stats()
    assert (stats.buffered, stats.aggregates_dropped, stats.send_failures, stats.reports_invalid) == (0, 0, 0, 0)

    seen = segment_stats(stub_for(daemon.address), segment, rounds=20)
    assert seen.rounds == pytest.approx(20)  # 5 rounds per request
    assert k_stats(seen, "draft", 3) == pytest.approx((12, 36, 16))  # 4 x (3 rounds, 9 proposed, 4 accepted)
    assert k_stats(seen, "prompt_lookup", 4) == pytest.approx((4, 8, 8))
    draft_positions = next(d for d in seen.drafters if d.drafter == "draft").positions
    # per request: verified [3, 2, 1], accepted [2, 1, 1] (see the three-rounds-sum conversion)
    assert [q.verified for q in draft_positions] == pytest.approx([12, 8, 4])
    assert [q.accepted for q in draft_positions] == pytest.approx([8, 4, 4])


def test_close_flushes_what_is_buffered(daemon):
    segment = f"flush-{uuid.uuid4().hex[:8]}"
    client = ControllerClient(config(daemon.address, report_interval_s=60))  # the timer alone would never send
    client.start()
    client.report(segment=segment, rounds=REQUEST_ROUNDS, **REPORT_ARGS)
    client.close(flush_timeout_s=5)
    assert client.stats().aggregates_sent == 3
    assert segment_stats(stub_for(daemon.address), segment, rounds=5).rounds == pytest.approx(5)


def test_impossible_rounds_are_counted_not_sent(daemon):
    with started(config(daemon.address)) as client:
        client.report(segment="chat", rounds=[draft(2, 3, 0)], **REPORT_ARGS)  # 3 proposed with K 2
        client.report(segment="no spaces", rounds=REQUEST_ROUNDS, **REPORT_ARGS)  # refused by the segment rules
        stats = client.stats()
    assert (stats.reports_invalid, stats.buffered, stats.aggregates_sent) == (2, 0, 0)


def test_reports_made_while_the_controller_is_down_arrive_once_after_restart(
    tmp_path, embedded_redis_url, prefix, capsys
):
    port = free_port()
    daemon_settings = daemon_config(embedded_redis_url, tmp_path, prefix, port)
    segment = "outage"
    with started(config(f"127.0.0.1:{port}")) as client:
        with running(daemon_settings):
            client.report(segment=segment, rounds=REQUEST_ROUNDS, **REPORT_ARGS)
            assert wait_until(lambda: client.stats().aggregates_sent == 3)
        # the controller is down: these are retried until it is back
        for _ in range(2):
            client.report(segment=segment, rounds=REQUEST_ROUNDS, **REPORT_ARGS)
        assert wait_until(lambda: client.stats().send_failures >= 3)
        assert client.stats().buffered == 6
        with running(daemon_settings) as restarted:
            started_at = time.monotonic()
            assert wait_until(lambda: client.stats().buffered == 0)
            delivered_after = time.monotonic() - started_at
            seen = segment_stats(stub_for(restarted.address), segment, rounds=15)
            stats = client.stats()
    print(f"buffered reports delivered {delivered_after:.2f}s after the restart")
    assert seen.rounds == pytest.approx(15)  # 3 requests x 5 rounds, none counted twice
    assert k_stats(seen, "draft", 3) == pytest.approx((9, 27, 12))
    assert (stats.aggregates_sent, stats.aggregates_dropped) == (9, 0)


def test_a_lost_acknowledgement_is_retried_with_the_same_id_and_counted_once(daemon):
    segment = f"ack-{uuid.uuid4().hex[:8]}"
    proxy = FakeController()
    proxy.forward_to = stub_for(daemon.address)
    proxy.acks_to_lose = 2  # the report is stored, but the worker hears UNAVAILABLE twice
    with serving(proxy) as address, started(config(address)) as client:
        client.report(segment=segment, rounds=REQUEST_ROUNDS, **REPORT_ARGS)
        assert wait_until(lambda: client.stats().reports_sent == 1)
        stats = client.stats()
    assert len(proxy.reports) == 3
    assert len({r.report_id for r in proxy.reports}) == 1  # every attempt is the same report ...
    assert all(r == proxy.reports[0] for r in proxy.reports)  # ... with the same contents
    assert [r.duplicate for r in proxy.responses] == [False, True, True]
    assert stats.send_failures == 2
    assert segment_stats(stub_for(daemon.address), segment, rounds=5).rounds == pytest.approx(5)


def test_buffer_overflow_drops_the_oldest_and_counts_them():
    with started(config(f"127.0.0.1:{free_port()}", max_buffered_aggregates=5)) as client:
        for i in range(8):  # 8 requests of 1 aggregate each, to a controller that never answers
            client.report(segment=f"s{i}", rounds=[draft(2, 2, 1)], **REPORT_ARGS)
        stats = client.stats()
    assert (stats.buffered, stats.aggregates_dropped, stats.aggregates_sent) == (5, 3, 0)
    assert client.stats().aggregates_dropped == 8  # close gave up on the 5 it could not deliver


def test_report_never_waits_for_the_network():
    stuck = FakeController(report_delay=1.0)  # every ReportRounds takes a second
    with serving(stuck) as address, started(config(address, max_aggregates_per_report=1)) as client:
        client.report(segment="chat", rounds=REQUEST_ROUNDS, **REPORT_ARGS)
        assert wait_until(lambda: len(stuck.reports) == 1)  # a send is in flight now
        latencies = []
        for _ in range(100):
            start = time.perf_counter()
            client.report(segment="chat", rounds=REQUEST_ROUNDS, **REPORT_ARGS)
            latencies.append(time.perf_counter() - start)
    assert statistics.median(latencies) < 0.005 and max(latencies) < 0.5  # the stuck send takes 1 s each


# --- tracing ---------------------------------------------------------------------------------------------


@pytest.fixture
def client_spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The worker's side: a provider of its own, as a decode worker in another process would have."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_decide_span_joins_the_controllers_trace(tmp_path, embedded_redis_url, prefix, monkeypatch, client_spans):
    server_spans = InMemorySpanExporter()

    def provider_with_sync_export(service_name: str, exporter) -> TracerProvider:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider

    monkeypatch.setattr(server_module, "make_exporter", lambda kind, endpoint: server_spans)
    monkeypatch.setattr(server_module, "make_provider", provider_with_sync_export)
    provider, exporter = client_spans
    tracer = provider.get_tracer("specd.worker")
    with (
        running(daemon_config(embedded_redis_url, tmp_path, prefix)) as d,
        started(config(d.address, decide_deadline_ms=1000), tracer=tracer) as client,
    ):
        with tracer.start_as_current_span("worker.request") as request_span:
            outcome = client.decide(RequestFeatures(segment="chat", **DECIDE_ARGS))
        assert wait_until(lambda: any(s.name.endswith("/Decide") for s in server_spans.get_finished_spans()), 5)

    (client_span,) = [s for s in exporter.get_finished_spans() if s.name == "specd.controller.decide"]
    (server_span,) = [s for s in server_spans.get_finished_spans() if s.name.endswith("/Decide")]
    # worker.request -> specd.controller.decide (client) -> specd.v1.Controller/Decide (server), one trace
    assert client_span.parent is not None and client_span.parent.span_id == request_span.get_span_context().span_id
    assert client_span.kind == SpanKind.CLIENT
    assert server_span.context.trace_id == client_span.context.trace_id
    assert server_span.parent is not None and server_span.parent.span_id == client_span.context.span_id
    assert server_span.parent.is_remote
    expected = {
        "specd.segment": "chat",
        "specd.drafter": outcome.drafter,
        "specd.k": outcome.k,
        "specd.decision.reason": outcome.reason,
        "specd.fallback": "",  # the controller answered
        "specd.decision.source": "controller",
    }
    assert client_span.attributes is not None
    assert {name: client_span.attributes.get(name) for name in expected} == expected


def test_decide_sends_the_trace_context_in_the_metadata(client_spans):
    provider, exporter = client_spans
    fake = FakeController()
    tracer = provider.get_tracer("specd.worker")
    with serving(fake) as address, started(config(address, decide_deadline_ms=1000), tracer=tracer) as client:
        client.decide(RequestFeatures(segment="chat", **DECIDE_ARGS))
    (span,) = exporter.get_finished_spans()
    traceparent = fake.decide_metadata[0]["traceparent"]
    # W3C: version-trace_id-parent_id-flags, the parent being the client's decide span
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", traceparent)
    assert traceparent.split("-")[1:3] == [f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"]


def test_a_fallback_says_so_in_the_span(client_spans):
    provider, exporter = client_spans
    with started(config(f"127.0.0.1:{free_port()}"), tracer=provider.get_tracer("w")) as client:
        client.decide(RequestFeatures(segment="chat", **DECIDE_ARGS))
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert (span.attributes["specd.fallback"], span.attributes["specd.decision.source"]) == (
        "unavailable",
        "local_default",
    )
    assert span.attributes["specd.decision.reason"] == "local_default"


# --- the documentation's example ---------------------------------------------------------------------------


def test_the_documented_example_runs(daemon):
    """The example in docs/controller_client.md, as a script of its own against the module's daemon."""
    text = (REPO / "docs" / "controller_client.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert example is not None
    code = example.group(1).replace("127.0.0.1:50061", daemon.address)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "source=controller" in done.stdout and "aggregates_sent=1" in done.stdout, done.stdout


def test_reports_wait_for_the_worker_to_be_quiet():
    # A worker passes its decode loop's wait_idle: a report is sent only once no sequence decodes (at most the
    # wait's bound later), so that its serialization and the controller's work never run beside a decode.
    busy = threading.Event()
    busy.set()
    waits: list[float] = []

    def quiet(seconds: float) -> bool:
        waits.append(seconds)
        deadline = time.monotonic() + seconds
        while busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not busy.is_set()

    fake = FakeController()
    with serving(fake) as address, started(config(address), quiet=quiet) as client:
        client.report(segment="quiet", rounds=REQUEST_ROUNDS, **REPORT_ARGS)
        time.sleep(0.5)  # ten report intervals
        assert fake.reports == [], "nothing is sent while the worker decodes"
        assert waits and all(0 < w <= 2.0 for w in waits)
        busy.clear()
        assert wait_until(lambda: len(fake.reports) == 1)
