"""Sampling modes and the one reference, over the real path (a daemon on a loopback socket, the embedded Redis):
a segment's sampled requests are learned apart (``<segment>#sampled``) and priced at the sampled rounds' costs, and
a request's realised speedup is stored at the same reference a decision reads what a plan realised at."""

from __future__ import annotations

import math
import uuid

import pytest

from controller.decision.timing_histogram import bin_low, bin_of
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_calibration_service import until
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon

STEP = 0.001  # the fleet's plain step, seconds
WAIT_S = 30.0  # for the refreshes to take reports in, on a loaded machine


def rounds(segment: str, temperature: float, draft_seconds_per_token: float, *, k: int = 4, accepted: int = 3,
           start_up_timings: bool = False, plain_rounds: int = 8, step: float = STEP,
           totals: tuple[int, float] | None = None, expected: float = 0.0) -> pb.RoundsAggregate:  # fmt: skip
    """12 rounds at K ``k`` (``accepted`` kept each, verification 1.5 steps) and ``plain_rounds`` plain rounds of
    ``step`` seconds; ``totals``: the request's (tokens, seconds), on the aggregate that carries them."""
    verify_k = 12 * step * 1.5
    extra = {} if totals is None else {"request_tokens_emitted": totals[0], "request_seconds": totals[1]}
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=k, rounds=12 + plain_rounds, num_drafted=12 * k,
        num_accepted=12 * accepted, proposed_per_position=[12] * k,
        verified_per_position=[12 if i <= accepted else 0 for i in range(k)],
        accepted_per_position=[12 if i < accepted else 0 for i in range(k)],
        tokens_emitted=12 * (accepted + 1) + plain_rounds, draft_seconds=12 * k * draft_seconds_per_token,
        verify_seconds=plain_rounds * step + verify_k, batch_size=1,
        rounds_by_drafted=[plain_rounds] + [0] * (k - 1) + [12],
        verify_seconds_by_drafted=[plain_rounds * step] + [0.0] * (k - 1) + [verify_k],
        temperature=temperature, start_up_timings=start_up_timings, expected_speedup=expected, **extra,
    )  # fmt: skip


def send(stub: pb_grpc.ControllerStub, *aggregates: pb.RoundsAggregate) -> None:
    request = pb.ReportRoundsRequest(report_id=f"r-{uuid.uuid4().hex}", worker_id="t", aggregates=list(aggregates))
    stub.ReportRounds(request, timeout=RPC_TIMEOUT)


def bucket(stub: pb_grpc.ControllerStub, mode: str) -> pb.BucketCosts | None:
    buckets = stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT).buckets
    return next((b for b in buckets if b.batch_bucket == 1 and b.mode == mode and b.measured), None)


@pytest.fixture(scope="module")
def stub(embedded_redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("modes")
    with running_daemon(embedded_redis_url, folder, DEFAULT_POLICY.read_text()) as d, connected(d) as channel:
        yield pb_grpc.ControllerStub(channel)


def test_sampled_requests_are_learned_apart_and_priced_at_their_own_costs(stub) -> None:
    # The worker's start-up calibration: a drafted token costs 0.2 steps greedy, 0.6 sampled (each sampled token is
    # drawn from the draft's softmax).
    for _ in range(4):
        send(stub, rounds("_calibration", 0.0, 0.2 * STEP, start_up_timings=True),
             rounds("_calibration", 1.0, 0.6 * STEP, start_up_timings=True))  # fmt: skip
    greedy = until(lambda: bucket(stub, "greedy"), lambda b: b is not None, WAIT_S)
    sampled = until(lambda: bucket(stub, "sampled"), lambda b: b is not None, WAIT_S)
    assert greedy is not None and sampled is not None
    assert greedy.cost_ratio["draft"] == pytest.approx(0.2, rel=0.05)
    assert sampled.cost_ratio["draft"] == pytest.approx(0.6, rel=0.05)
    # one segment, both modes: greedy the draft keeps 3 of 4, sampled 1 of 4
    for _ in range(6):
        send(stub, rounds("mixed", 0.0, 0.2 * STEP, accepted=3), rounds("mixed", 1.2, 0.6 * STEP, accepted=1))
    counted = until(
        lambda: {
            s.segment: s.rounds for s in stub.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT).segments
        },
        lambda found: found.get("mixed") == found.get("mixed#sampled") == 6 * 20,
        WAIT_S,
    )
    assert counted["mixed"] == counted["mixed#sampled"] == 6 * 20, "each mode's rounds under its own name"

    def decide(temperature: float) -> pb.Decision:
        request = pb.DecideRequest(segment="mixed", batch_size=1, drafters=["draft"], max_new_tokens=128,
                                   sampling=pb.SamplingParams(temperature=temperature))  # fmt: skip
        return stub.Decide(request, timeout=RPC_TIMEOUT)

    greedy_plan, sampled_plan = decide(0.0), decide(1.2)
    assert greedy_plan.segment == "mixed" and sampled_plan.segment == "mixed#sampled"
    assert greedy_plan.cost_ratio == pytest.approx(0.2, rel=0.05)
    assert sampled_plan.cost_ratio == pytest.approx(0.6, rel=0.05)
    assert list(sampled_plan.verify_cost) == pytest.approx(list(sampled.verify_cost)[: len(sampled_plan.verify_cost)])
    assert greedy_plan.acceptance[1] > 0.7 > 0.4 > sampled_plan.acceptance[1], "each mode's acceptance is its own"
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="mixed#sampled"), timeout=RPC_TIMEOUT)
    assert stats.segment == "mixed#sampled" and stats.rounds == 6 * 20


def test_expected_and_realised_speedups_are_read_at_one_reference(stub) -> None:
    # The fleet's plain step is 1 ms (the calibration above); this segment's own plain rounds take 2 ms (its longer
    # contexts). Its requests then speculate at 1 ms a token, promising 1.6x. The controller stores each request's
    # realised / expected at its reference for the segment, and a decision reads what the draft realised at the
    # reference: the same one, so realised = calibration x expected.
    for _ in range(8):
        send(stub, rounds("_calibration", 0.0, 0.2 * STEP, start_up_timings=True))
    for _ in range(5):
        send(stub, rounds("ref", 0.0, 0.2 * STEP, plain_rounds=6, step=2 * STEP))
    until(
        lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="ref"), timeout=RPC_TIMEOUT),
        lambda s: s.rounds >= 5 * 18,
        WAIT_S,
    )
    expected = 1.6
    for _ in range(8):
        send(stub, rounds("ref", 0.0, 0.2 * STEP, plain_rounds=0, totals=(100, 100 * STEP), expected=expected))
    stats = until(
        lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="ref"), timeout=RPC_TIMEOUT),
        lambda s: any(d.drafter == "draft" and d.realised_requests >= 8 for d in s.drafters),
        WAIT_S,
    )
    draft = next(d for d in stats.drafters if d.drafter == "draft")
    assert draft.realised_requests == pytest.approx(8) and draft.calibration_requests == pytest.approx(8)
    # one bin's width (4.4 %) of each histogram is all that may part them
    assert draft.calibration * expected == pytest.approx(draft.realised_speedup, rel=0.09)
    # and that reference is neither the fleet's 1 ms nor the segment's own 2 ms alone, but between: 5 own requests
    # against REFERENCE_PRIOR_REQUESTS of the fleet's
    b = bin_of(STEP)
    assert b is not None
    assert 1.15 < draft.realised_speedup / math.sqrt(bin_low(b) * bin_low(b + 1)) * STEP < 1.9
