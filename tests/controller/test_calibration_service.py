"""Robust costs and calibration over the real path (a daemon on a loopback socket, the embedded Redis): a stalled report
moves no learned cost, calibration (realised / expected speedup) reaches GetSegmentStats, and a new segment starts from
the fleet's acceptance."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest

from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon

T = TypeVar("T")
STEP = 0.001  # one plain step, seconds
V4 = 1.5  # v(4)


def until(read: Callable[[], T], ready: Callable[[T], bool], seconds: float = 5.0) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if ready(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def draft_request(segment: str, stall: float = 0.0, expected: float = 0.0, accepted: int = 2) -> pb.RoundsAggregate:
    """12 rounds at K = 4 (``accepted`` of 4 per round, 12 ms of drafting) and 8 plain rounds, as the shipped pair
    runs them (1 ms a step, v(4) 1.5); ``stall`` seconds added to one verification."""
    verify_4 = 12 * STEP * V4 + stall
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=4, rounds=20, num_drafted=48, num_accepted=12 * accepted,
        proposed_per_position=[12] * 4, verified_per_position=[12 if i <= accepted else 0 for i in range(4)],
        accepted_per_position=[12 if i < accepted else 0 for i in range(4)], tokens_emitted=12 * (accepted + 1) + 8,
        draft_seconds=0.012, verify_seconds=8 * STEP + verify_4, batch_size=1,
        rounds_by_drafted=[8, 0, 0, 0, 12], verify_seconds_by_drafted=[8 * STEP, 0, 0, 0, verify_4],
        expected_speedup=expected,
    )  # fmt: skip


def send(stub: pb_grpc.ControllerStub, *aggregates: pb.RoundsAggregate) -> None:
    stub.ReportRounds(
        pb.ReportRoundsRequest(report_id=f"r-{uuid.uuid4().hex}", worker_id="t", aggregates=list(aggregates)),
        timeout=RPC_TIMEOUT,
    )


def batch_one(stub: pb_grpc.ControllerStub) -> pb.BucketCosts | None:
    return next((b for b in stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT).buckets if b.batch_bucket == 1),
                None)  # fmt: skip


@pytest.fixture(scope="module")
def stub(embedded_redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("calibration")
    with running_daemon(embedded_redis_url, folder, DEFAULT_POLICY.read_text()) as d, connected(d) as channel:
        yield pb_grpc.ControllerStub(channel)


def test_a_stalled_report_moves_no_learned_cost_and_calibration_is_served(stub) -> None:
    for _ in range(10):
        send(stub, draft_request("quiet"))
    costs = until(lambda: batch_one(stub), lambda b: b is not None and b.step_seconds > 0)
    assert costs is not None and costs.step_seconds == pytest.approx(STEP, rel=0.05)
    before = (costs.step_seconds, costs.verify_cost[4], costs.cost_ratio["draft"])
    assert before[1] == pytest.approx(V4, rel=0.05) and before[2] == pytest.approx(0.25, rel=0.05)
    assert costs.spread > 0

    send(stub, draft_request("quiet", stall=1.5))  # one round 1,000x its neighbours
    time.sleep(0.5)  # several refreshes
    after = batch_one(stub)
    assert after is not None and sum(after.verify_rounds) > sum(costs.verify_rounds)  # the stall was counted
    for b, a in zip(before, (after.step_seconds, after.verify_cost[4], after.cost_ratio["draft"]), strict=True):
        assert a == pytest.approx(b, rel=0.10)

    # Realised: 44 tokens in (12 + 8 + 18) ms at 1 ms a step = 44 / 38 = 1.158; promised 1.447: calibration 0.8.
    for _ in range(5):
        send(stub, draft_request("calibrated", expected=44 / 38 / 0.8))
    stats = until(
        lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="calibrated"), timeout=RPC_TIMEOUT),
        lambda s: any(d.calibration_requests >= 5 for d in s.drafters),
    )
    draft = next(d for d in stats.drafters if d.drafter == "draft")
    assert draft.calibration_requests == pytest.approx(5) and draft.calibration == pytest.approx(0.8, rel=0.05)
    # and the segment's decisions carry it: the model's expectation scaled by the factor (shrunk: 5 requests)
    from controller.decision.decide import calibration_factor

    request = pb.DecideRequest(segment="calibrated", batch_size=1, drafters=["draft"], max_new_tokens=128)
    decision = stub.Decide(request, timeout=RPC_TIMEOUT)
    fleet = calibration_factor(draft.calibration, 5)  # the only segment whose requests measured it so far
    assert decision.calibration == pytest.approx(calibration_factor(draft.calibration, 5, toward=fleet), rel=0.01)


def test_a_new_segment_starts_from_the_fleets_calibration(stub) -> None:
    # The fleet's requests so far realised 0.8 of what the model promised (the 'calibrated' segment's 5 above): a
    # segment never seen starts there, not at 1, and its first request, stalled, does not move it.
    from controller.decision.decide import calibration_factor

    def decide() -> pb.Decision:
        request = pb.DecideRequest(segment="never-seen", batch_size=1, drafters=["draft"], max_new_tokens=128)
        return until(lambda: stub.Decide(request, timeout=RPC_TIMEOUT), lambda d: not d.exploration)

    first = decide()
    assert first.drafter == "draft" and first.calibration == pytest.approx(calibration_factor(0.8, 5), rel=0.03)
    send(stub, draft_request("never-seen", stall=1.5, expected=44 / 38 / 0.8))  # realised 0.03 of its promise
    time.sleep(0.5)  # several refreshes
    after = decide()
    assert after.calibration == pytest.approx(calibration_factor(0.8, 6), rel=0.03), after.calibration


def test_a_new_segment_starts_from_the_fleets_acceptance(stub) -> None:
    # Every segment so far accepts nothing of the draft: a segment never seen is not sent to the draft on the
    # policy's prior (0.6) alone.
    def fresh() -> pb.Decision:
        request = pb.DecideRequest(segment=f"new-{uuid.uuid4().hex[:6]}", batch_size=1, drafters=["draft"],
                                   max_new_tokens=128)  # fmt: skip
        return stub.Decide(request, timeout=RPC_TIMEOUT)

    first = fresh()
    assert first.drafter == "draft"  # the prior's plan (and the fleet's acceptance of 0.5 so far)
    for i in range(30):
        send(stub, draft_request(f"hopeless-{i % 3}", accepted=0))
    decision = until(fresh, lambda d: d.drafter == "none" or d.exploration)
    decisions = [decision] + [fresh() for _ in range(20)]
    assert sum(d.drafter == "none" for d in decisions) >= 15, [(d.drafter, d.reason) for d in decisions]


def test_a_workers_start_up_calibration_sets_the_costs_and_no_segment(embedded_redis_url, tmp_path) -> None:
    # A fresh controller: the calibration aggregates (decoder.calibration) are its first costs, before any traffic,
    # and they make no segment (not listed, not counted against the cap).
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as d, connected(d) as channel:
        fresh = pb_grpc.ControllerStub(channel)
        assert batch_one(fresh) is None
        timings = [_start_up_timings(draft_request("_calibration")) for _ in range(4)]
        send(fresh, *timings)
        costs = until(lambda: batch_one(fresh), lambda b: b is not None and b.measured)
        assert costs is not None and costs.step_seconds == pytest.approx(STEP, rel=0.05)
        assert costs.verify_cost[4] == pytest.approx(V4, rel=0.05)
        segments = fresh.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT).segments
        assert [s.segment for s in segments] == []
        stats = fresh.GetSegmentStats(pb.GetSegmentStatsRequest(segment="_calibration"), timeout=RPC_TIMEOUT)
        assert stats.rounds == 0


def _start_up_timings(message: pb.RoundsAggregate) -> pb.RoundsAggregate:
    marked = pb.RoundsAggregate()
    marked.CopyFrom(message)
    marked.start_up_timings = True
    return marked
