"""The round policy: each round's K, from the plan held whole, the batch size and the budget left. Tables: why each
row's answer is right is in its last column."""

from __future__ import annotations

import pytest

from specd_api.plan import Plan, requested
from specd_api.position_tally import PositionTally
from specd_api.round_policy import PLAIN_ROUNDS_FROM, RoundPolicy, adapted_k

CPU_V = (1.0, 1.39, 1.71, 1.58, 1.21, 1.9, 2.3, 2.7, 3.1)  # non-monotonic, as measured on a CPU in float32
ADAPTIVE = Plan("draft", 8, acceptance=(0.9,) * 8, proposal=(1.0,) * 8, prior_strength=8.0, cost_ratio=0.1,
                verify_cost=CPU_V)  # fmt: skip


def observed(rounds: int, drafted: int, accepted: int) -> PositionTally:
    seen = PositionTally()
    for _ in range(rounds):
        seen.add(drafted, accepted)
    return seen


@pytest.mark.parametrize(
    ("plan", "seen", "ceiling", "k", "why"),
    [
        (Plan("draft", 4), PositionTally(), 4, 4, "no estimates: every round at the ceiling"),
        (ADAPTIVE, PositionTally(), 8, 4, "the estimates alone: v(n) makes K = 4 the best, not the largest"),
        (ADAPTIVE, PositionTally(), 3, 3, "the budget cuts the ceiling"),
        (ADAPTIVE, observed(30, 4, 0), 8, 0, "this request rejects everything: plain steps"),
        (ADAPTIVE, observed(2, 4, 0), 8, 4, "two bad rounds do not outweigh eight pseudo-rounds of 0.9"),
        (Plan(**{**ADAPTIVE.__dict__, "probe_rounds": 4}), observed(3, 4, 0), 8, 8, "a probe runs at k first"),
        (Plan(**{**ADAPTIVE.__dict__, "probe_rounds": 4}), observed(30, 4, 0), 8, 0, "... then adapts"),
        (Plan(**{**ADAPTIVE.__dict__, "acceptance": (0.3,) * 8}), observed(30, 4, 4), 8, 4,
         "this request accepts everything where the segment rarely does: it drafts"),
        (Plan(**{**ADAPTIVE.__dict__, "verify_cost": (1.0,) * 9}), PositionTally(), 8, 8, "flat v(n): the largest K"),
    ],
)  # fmt: skip
def test_adapted_k(plan, seen, ceiling, k, why):
    assert adapted_k(plan, seen, ceiling) == k, why


@pytest.mark.parametrize(
    ("plan", "batch", "budget", "k", "why"),
    [
        (Plan("draft", 4), 64, 10, 4, "no threshold: no batch rule (an engine used on its own)"),
        (Plan("draft", 4, max_batch_size=8), 8, 10, 4, "at the plan's threshold: on"),
        (Plan("draft", 4, max_batch_size=8), 9, 10, 0, "above it: off"),
        (Plan("draft", 4, max_batch_size=0), 1, 10, 0, "a policy that never speculates"),
        (Plan("draft", 4), 1, 2, 2, "the budget cuts the ceiling"),
        (Plan("draft", 4), 1, 0, 0, "no budget left: a plain step"),
        (Plan("none", 0), 1, 10, 0, "no speculation"),
        (Plan(**{**ADAPTIVE.__dict__, "k": 2}), 1, 10, 2, "the plan's rule, never above the plan's k"),
        (ADAPTIVE, 1, 10, 4, "the plan's rule under its ceiling"),
    ],
)  # fmt: skip
def test_round_k(plan, batch, budget, k, why):
    assert RoundPolicy.open(plan, plan.drafter).round_k(batch, budget) == k, why


def test_the_batch_rule_follows_the_batch_as_it_grows_and_shrinks():
    policy = RoundPolicy.open(Plan("prompt_lookup", 3, max_batch_size=4), "prompt_lookup")
    assert [policy.round_k(batch, 10) for batch in (1, 4, 5, 8, 4, 2)] == [3, 3, 0, 0, 3, 3]


def test_a_callers_schedule_runs_each_ceiling_in_turn_and_cycles():
    policy = RoundPolicy.open(requested("draft", 8, [3, 0, 8]), "draft")
    ks = []
    for _ in range(5):
        ks.append(policy.round_k(1, 5))
        policy.observe(ks[-1], 0)
    assert ks == [3, 0, 5, 3, 0], "each in turn, cut to the budget (5), cycled"


def test_the_policy_learns_the_requests_rounds_and_stops_drafting_when_they_fail():
    policy = RoundPolicy.open(ADAPTIVE, "draft")
    assert policy.round_k(1, 10) == 4 and policy.stop_threshold == ADAPTIVE.stop_threshold
    for _ in range(30):
        policy.observe(4, 0)
    assert policy.observed.rounds == 30 and policy.round_k(1, 10) == 0


def test_a_plans_plain_rounds_come_once_the_request_is_steady_and_are_not_its_probe_rounds() -> None:
    # The controller asks for one plain round (the segment's plain step in the request's context), and a probe's
    # rounds at k: the probe's come first, the plain round at PLAIN_ROUNDS_FROM (the first steps after the prefill run
    # slower than a steady step), and it does not count as one of the probe's.
    plan = Plan(**{**ADAPTIVE.__dict__, "plain_rounds": 1, "probe_rounds": 2})
    policy = RoundPolicy.open(plan, "draft")
    ks = []
    for _ in range(PLAIN_ROUNDS_FROM + 3):
        ks.append(policy.round_k(1, 20))
        policy.observe(ks[-1], ks[-1])
    assert PLAIN_ROUNDS_FROM >= 2
    assert ks == [8, 8] + [4] * (PLAIN_ROUNDS_FROM - 2) + [0, 4, 4], "the probe at k twice, the rule, plain once"
    late = Plan(**{**ADAPTIVE.__dict__, "plain_rounds": 1, "probe_rounds": PLAIN_ROUNDS_FROM + 1})
    policy = RoundPolicy.open(late, "draft")
    ks = []
    for _ in range(PLAIN_ROUNDS_FROM + 3):
        ks.append(policy.round_k(1, 20))
        policy.observe(ks[-1], ks[-1])
    assert ks == [8] * PLAIN_ROUNDS_FROM + [0, 8, 4], "a probe's rounds go on after the plain round"
    assert Plan.from_proto(plan.to_proto()).plain_rounds == 1, "on the wire"
