"""Learning from an engine's request totals (``totals_only``): the per-position counts inferred under a constant
conditional acceptance obey every rule a detailed report obeys and add up to the totals; α per K is the engine's own
count; over a real daemon (loopback gRPC, the embedded Redis) the totals teach a segment what its plan realised and
teach the cost model nothing."""

from __future__ import annotations

import random
import uuid

import pytest

from controller.decision.totals import conditional_rate, positions_from_totals
from controller.serving.validation import aggregate
from specd_api.checks import _positions_hold, check_aggregate
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_calibration_service import batch_one, send, until
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon

STEP = 0.002  # one plain step of the engine, seconds


def test_inferred_counts_obey_every_rule_and_add_up_to_the_totals() -> None:
    r = random.Random(7)
    for _ in range(5_000):
        k = r.randint(1, 12)
        rounds = r.randint(0, 400)
        drafted = r.randint(0, rounds * k)
        accepted = r.randint(0, drafted)
        proposed, verified, accepted_at = positions_from_totals(rounds, k, drafted, accepted)
        assert (sum(proposed), sum(accepted_at)) == (drafted, accepted), (rounds, k, drafted, accepted)
        assert _positions_hold(proposed, verified, accepted_at, rounds), (proposed, verified, accepted_at)


def test_a_constant_rate_is_recovered_from_the_totals_of_its_rounds() -> None:
    r = random.Random(3)
    for a, k in ((0.3, 2), (0.7, 4), (0.85, 8)):
        accepted = 0
        rounds = 4_000
        for _ in range(rounds):
            n = 0
            while n < k and r.random() < a:
                n += 1
            accepted += n
        assert conditional_rate(accepted / rounds, k) == pytest.approx(a, abs=0.02)
        proposed, verified, accepted_at = positions_from_totals(rounds, k, rounds * k, accepted)
        # each position's inferred count is its expectation under the recovered rate, to within one
        recovered = conditional_rate(accepted / rounds, k)
        for i in range(k):
            assert abs(accepted_at[i] - rounds * recovered ** (i + 1)) <= 1.0 + 1e-6, (a, k, i, accepted_at)
            assert verified[i] == (rounds if i == 0 else accepted_at[i - 1])
    # and for any totals, not only these
    for rounds, k, drafted, accepted in ((13, 8, 100, 30), (7, 5, 35, 11), (300, 12, 3_000, 1_234)):
        proposed, _, accepted_at = positions_from_totals(rounds, k, drafted, accepted)
        drafting = proposed[0]
        recovered = conditional_rate(accepted / drafting, k)
        for i in range(k):
            assert abs(accepted_at[i] - drafting * recovered ** (i + 1)) <= 1.0 + 1e-6, (rounds, k, i, accepted_at)


def test_rounds_that_drafted_nothing_lower_the_proposal_not_the_acceptance() -> None:
    # 40 steps, 10 of which drafted 4 (lookup found a match): the proposal rate is 1/4, the acceptance of those 10
    proposed, verified, accepted_at = positions_from_totals(40, 4, 40, 20)
    assert proposed == [10, 10, 10, 10]
    assert conditional_rate(20 / 10, 4) == pytest.approx(0.7413, abs=1e-3)
    assert verified[0] == 10 and sum(accepted_at) == 20


def test_the_ends_of_the_rate() -> None:
    assert conditional_rate(0.0, 4) == 0.0 and conditional_rate(4.0, 4) == 1.0 and conditional_rate(1.0, 0) == 0.0
    assert positions_from_totals(10, 3, 30, 30) == ([10] * 3, [10] * 3, [10] * 3)
    assert positions_from_totals(10, 3, 30, 0) == ([10] * 3, [10, 0, 0], [0, 0, 0])
    assert positions_from_totals(10, 3, 0, 0) == ([0] * 3, [0] * 3, [0] * 3)


def totals(segment: str, k: int, steps: int, drafted: int, accepted: int, seconds: float, expected: float = 1.2):
    """What an engine adapter reports for one request: ``steps`` decode steps after the first token."""
    tokens = steps + accepted
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=k, rounds=steps, num_drafted=drafted, num_accepted=accepted,
        tokens_emitted=tokens, batch_size=1, expected_speedup=expected, request_tokens_emitted=tokens,
        request_seconds=seconds, totals_only=True,
    )  # fmt: skip


def plain(segment: str, steps: int) -> pb.RoundsAggregate:
    return pb.RoundsAggregate(
        segment=segment, drafter="none", k=0, rounds=steps, tokens_emitted=steps, verify_seconds=steps * STEP,
        batch_size=1, rounds_by_drafted=[steps], verify_seconds_by_drafted=[steps * STEP],
    )  # fmt: skip


def test_the_door_refuses_totals_with_detail_or_without_the_requests_seconds() -> None:
    good = totals("s", 4, 30, 120, 60, 0.05)
    check_aggregate(good)
    for change, field in (
        (lambda a: a.accepted_per_position.extend([1]), "per-position"),
        (lambda a: setattr(a, "draft_seconds", 0.01), "split timings"),
        (lambda a: setattr(a, "request_seconds", 0.0), "request_seconds"),
        (lambda a: setattr(a, "request_tokens_emitted", 0), "request_tokens_emitted"),
        (
            lambda a: (
                a.MergeFrom(pb.RoundsAggregate(drafter="none"))
                or a.ClearField("k")
                or a.ClearField("num_drafted")
                or a.ClearField("num_accepted")
            ),
            "full form",
        ),
        (lambda a: setattr(a, "counterfactual", True), "counterfactual"),
        (lambda a: setattr(a, "tokens_emitted", 29), "tokens_emitted"),
        (lambda a: setattr(a, "num_drafted", 121), "num_drafted"),
    ):
        bad = pb.RoundsAggregate()
        bad.CopyFrom(good)
        change(bad)
        with pytest.raises(ValueError, match=field):
            check_aggregate(bad)
    built = aggregate(good)
    assert built.totals_only and sum(built.accepted_per_position) == 60 and built.cost_fields() == {}


@pytest.fixture(scope="module")
def stub(embedded_redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("totals")
    with running_daemon(embedded_redis_url, folder, DEFAULT_POLICY.read_text()) as d, connected(d) as channel:
        yield pb_grpc.ControllerStub(channel)


def test_a_segment_learns_its_engines_acceptance_and_realised_speedup_from_totals(stub) -> None:
    segment = f"engine-{uuid.uuid4().hex[:6]}"
    for _ in range(6):
        send(stub, plain(segment, 47))
    costs = until(lambda: batch_one(stub), lambda b: b is not None and b.step_seconds > 0)
    assert costs is not None and costs.step_seconds == pytest.approx(STEP, rel=0.05)
    # K 4, 30 steps that drafted 120 and kept 60: 90 tokens in 30 steps' time and a little more (1.6 steps' worth per
    # round): 90 x 2 ms / (30 x 1.6 x 2 ms) = 1.875x
    for _ in range(5):
        send(stub, totals(segment, 4, 30, 120, 60, 30 * 1.6 * STEP))
    stats = until(
        lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT),
        lambda s: any(d.realised_requests >= 5 for d in s.drafters),
    )
    draft = next(d for d in stats.drafters if d.drafter == "draft")
    by_k = next(b for b in draft.by_k if b.k == 4)
    assert by_k.alpha == pytest.approx(0.5) and by_k.rounds == pytest.approx(150)  # the engine's own counts
    assert [round(p.accepted) for p in draft.positions] == [5 * x for x in positions_from_totals(30, 4, 120, 60)[2]]
    assert draft.realised_speedup == pytest.approx(90 / (30 * 1.6), rel=0.05)
    # and no cost was learned from them: the drafting cost is still what the plain rounds left it
    after = batch_one(stub)
    assert after is not None and dict(after.cost_ratio) == pytest.approx(dict(costs.cost_ratio))
    assert list(after.verify_rounds) == pytest.approx(list(costs.verify_rounds), rel=1e-3)  # decayed meanwhile
    decision = stub.Decide(pb.DecideRequest(segment=segment, batch_size=1, drafters=["draft"], max_new_tokens=64),
                           timeout=RPC_TIMEOUT)  # fmt: skip
    assert decision.drafter == "draft" and decision.expected_speedup > 1.3
