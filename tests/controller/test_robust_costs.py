"""Costs a stall cannot move, their uncertainty in the decision, probes that never die, calibration.

The timings below are what the shipped pair does on 2 CPU cores: a plain step of about 1 ms, v(4) about 1.5, the
draft model at c about 0.2, each request's mean ±20% (the machine's noise). A stall is one round of 1.5 s.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.decision.cost_model import (
    DEFAULT_VERIFY_SLOPE,
    MIN_REQUESTS,
    TABLE_SIZE,
    _verify_table,
    build_cost_model,
)
from controller.decision.counts import Aggregate, CostCounts, SegmentCounts
from controller.decision.decide import Request, decide, deliberate, estimate_drafter, probe_floor
from controller.decision.policy import Settings
from controller.decision.timing_histogram import bin_of, draw_median, median, quantile, relative_spread, total

STEP = 0.001  # seconds of one plain step
V = {0: 1.0, 1: 1.25, 2: 1.35, 3: 1.45, 4: 1.5}  # v(n)
C_DRAFT = 0.2


PLAIN = 6  # rounds per request that drafted nothing (the draft's stop rule, or prompt lookup without a match)


def request(rng: random.Random, stall: float = 0.0, n: int = 4, rounds: int = 12, drafter: str = "draft") -> Aggregate:
    """One request's aggregate: ``rounds`` rounds that drafted ``n`` and PLAIN plain rounds, its pace off by ±20%;
    ``stall`` seconds added to one of its drafted rounds."""
    pace = rng.uniform(0.8, 1.2)
    verify_n = rounds * STEP * V[n] * pace + stall
    plain = PLAIN * STEP * pace
    by_drafted = tuple((PLAIN, plain) if i == 0 else ((rounds, verify_n) if i == n else (0, 0.0)) for i in range(n + 1))
    return Aggregate(
        segment="s", drafter=drafter, k=n, rounds=rounds + PLAIN, num_drafted=rounds * n, num_accepted=rounds * n // 2,
        proposed_per_position=(rounds,) * n, verified_per_position=(rounds,) * n,
        accepted_per_position=(rounds // 2,) * n, tokens_emitted=rounds * (n // 2 + 1) + PLAIN,
        draft_seconds=rounds * n * C_DRAFT * STEP * pace, verify_seconds=plain + verify_n, by_drafted=by_drafted,
    )  # fmt: skip


def cost_counts(aggregates: list[Aggregate]) -> CostCounts:
    counts = CostCounts()
    for a in aggregates:
        counts.add_fields(a.cost_fields())
    return counts


def learned(aggregates: list[Aggregate]) -> tuple[float, float, float]:
    """(step seconds, v(4), c(draft)) at batch 1."""
    bucket = build_cost_model(cost_counts(aggregates)).at(1)
    return bucket.step_seconds, bucket.verify[4], bucket.c("draft", -1.0)


@pytest.mark.parametrize("stalled", [1, 2, 4])
def test_a_minority_of_stalled_requests_moves_no_learned_cost_by_10_percent(stalled: int) -> None:
    rng = random.Random(stalled)
    quiet = [request(rng) for _ in range(40)]
    stalls = [request(rng, stall=1.5) for _ in range(stalled)]  # each: one round 1,500x its neighbours
    for before, after, name in zip(learned(quiet), learned(quiet + stalls), ("step", "v(4)", "c(draft)"), strict=True):
        assert after == pytest.approx(before, rel=0.10), (name, before, after)
    # and the learned figures are the machine's, not a guess: within 10% of what the requests ran at on average
    step, v4, c = learned(quiet + stalls)
    assert step == pytest.approx(STEP, rel=0.1)
    assert v4 == pytest.approx(V[4], rel=0.1)
    assert c == pytest.approx(C_DRAFT, rel=0.1)


def test_the_first_request_alone_does_not_set_the_costs() -> None:
    # Fewer requests than MIN_REQUESTS in a histogram: its median is not trusted yet, the plain mean is used; once
    # there are enough, one stalled request among them is one rank.
    rng = random.Random(7)
    first = [request(rng, stall=1.5)]
    assert total(cost_counts(first).verify_hist[(4, 1)]) < MIN_REQUESTS
    crowd = first + [request(rng) for _ in range(4)]
    _, v4, _ = learned(crowd)
    assert v4 == pytest.approx(V[4], rel=0.15)


def test_costs_without_histogram_entries_are_the_plain_mean() -> None:
    # Sums with no histogram entries (e.g. timings no bin holds): the histogram holds fewer requests than
    # MIN_REQUESTS, so the plain mean of the sums is read.
    rng = random.Random(3)
    counts = CostCounts()
    for a in [request(rng) for _ in range(10)]:
        counts.add_fields({k: v for k, v in a.cost_fields().items() if not k.startswith("h")})
    assert not counts.verify_hist
    bucket = build_cost_model(counts).at(1)
    assert bucket.verify[4] == pytest.approx(V[4], rel=0.1) and bucket.timings is not None


def test_a_cost_measured_by_few_requests_is_drawn_widely_and_by_many_is_a_point() -> None:
    rng = random.Random(11)
    few = build_cost_model(cost_counts([request(rng) for _ in range(4)])).at(1)
    many = build_cost_model(cost_counts([request(rng) for _ in range(400)])).at(1)
    draws = random.Random(0)

    def spread(bucket: object) -> float:
        values = [bucket.draw(draws).c("draft", 0.0) for _ in range(300)]  # type: ignore[attr-defined]
        return (max(values) - min(values)) / median_of(values)

    assert spread(few) > 0.10  # 4 requests: c is drawn over a wide range, exploration can overturn it
    assert spread(many) < 0.10  # 400: about a point
    assert many.timings is not None and many.timings.spread() < few.timings.spread()  # type: ignore[union-attr]


def test_each_draw_prices_a_drafter_at_its_drawn_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Thompson draw of the costs moves the drafter's c as well as v(n): with c measured by 4 requests, the c the
    draws price the draft at spreads as the cost draws do (a draw that kept the measured c would take it as certain,
    and no draw could overturn a draft that looks too dear)."""
    import controller.decision.decide as decide_module

    few = build_cost_model(cost_counts([request(random.Random(11)) for _ in range(4)])).at(1)
    settings = Settings(exploration_rate=0.5, min_exploration_rate=0.3)
    seg = lookup_settled(50)
    deliberation = deliberate(settings, "v1", Request("s", 1, ("draft", "prompt_lookup"), 128),
                              estimates(seg, settings, few.c("draft", 0.2)), few, None)  # type: ignore[arg-type]  # fmt: skip
    priced: list[float] = []
    best_arm = decide_module.best_arm

    def recording(estimate, rates, k_min, k_max, costs, cost_ratio=None):  # type: ignore[no-untyped-def]
        if estimate.drafter == "draft":  # the c this arm is priced at
            priced.append(estimate.cost_ratio if cost_ratio is None else cost_ratio)
        return best_arm(estimate, rates, k_min, k_max, costs, cost_ratio)

    monkeypatch.setattr(decide_module, "best_arm", recording)
    for seed in range(300):
        deliberation.draw(random.Random(seed))
    assert len(priced) > 50
    assert len(set(priced)) > len(priced) // 2, "each draw its own c"
    assert (max(priced) - min(priced)) / median_of(priced) > 0.03


def median_of(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_histogram_quantiles_and_draws() -> None:
    hist: dict[int, float] = {}
    for x in (1e-3 * (1 + i / 100) for i in range(100)):  # 1.00 .. 1.99 ms
        b = bin_of(x)
        assert b is not None
        hist[b] = hist.get(b, 0.0) + 1
    assert median(hist) == pytest.approx(1.5e-3, rel=0.05)
    assert quantile(hist, 0.0) <= quantile(hist, 0.25) <= median(hist) <= quantile(hist, 0.9)
    hist[bin_of(2.0)] = 5.0  # type: ignore[index]  # five stalls of 2 s among 100
    assert median(hist) == pytest.approx(1.52e-3, rel=0.05)
    draws = [draw_median(hist, random.Random(s)) for s in range(200)]
    assert all(1.3e-3 < d < 1.8e-3 for d in draws)
    assert 0 < relative_spread(hist) < 0.05
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert bin_of(bad) is None
    assert median({}) == 0.0 and draw_median({}, random.Random(0)) == 0.0
    assert median({3: float("nan"), 4: -2.0}) == 0.0  # corrupt weights count as nothing


def test_corrupt_histogram_fields_are_ignored() -> None:
    counts = CostCounts()
    counts.add_fields({"hw|4|1|99999999": 5.0, "hw|x|1|3": 1.0, "he|draft|1|-160": float("nan"), "hw|4|1|-160": 2.0})
    assert dict(counts.verify_hist) == {(4, 1, "greedy"): {-160: 2.0}}
    assert all(w == 0.0 for h in counts.draft_hist.values() for w in h.values())


# -- exploration that never dies --------------------------------------------------------------------------------


def estimates(seg: SegmentCounts, settings: Settings, c_draft: float) -> dict[str, object]:
    return {
        d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.5, 0.5, settings.prior_strength, c)
        for d, c in (("draft", c_draft), ("prompt_lookup", 0.0))
    }


def lookup_settled(draft_rounds: float) -> SegmentCounts:
    """A segment that settled on prompt lookup (α 0.8, always a match) whose draft looks worse (α 0.5), with
    ``draft_rounds`` rounds of evidence about the draft."""
    from controller.decision.counts import PositionCounts

    seg = SegmentCounts()
    for i in range(16):
        seg.counterfactual[("prompt_lookup", i)] = PositionCounts(1e5, 1e5, 1e5 * 0.8**i, 1e5 * 0.8 ** (i + 1))
        seg.positions[("draft", i)] = PositionCounts(draft_rounds, draft_rounds, draft_rounds * 0.5**i,
                                                     draft_rounds * 0.5 ** (i + 1))  # fmt: skip
    return seg


def probes(seg: SegmentCounts, settings: Settings, c_draft: float = 0.3, n: int = 4000) -> int:
    from controller.decision.cost_model import BucketCosts

    costs = BucketCosts(1, 0.001, verify=tuple(1.0 + 0.02 * i for i in range(65)))
    req = Request("s", 1, ("draft", "prompt_lookup"), 128)
    est = estimates(seg, settings, c_draft)
    deliberation = deliberate(settings, "v1", req, est, costs, None)  # type: ignore[arg-type]
    plans = [deliberation.draw(random.Random(s)) for s in range(n)]  # what decide() does, its rules weighed once
    assert all(p.exploration or p.drafter == "prompt_lookup" for p in plans)
    return sum(p.exploration and p.drafter == "draft" for p in plans)


def test_a_drafter_the_segment_settled_against_is_still_probed() -> None:
    # The segment runs prompt lookup; the draft is known to be worse (2,000 rounds): no Thompson draw prefers it,
    # yet it keeps a floor of probes, lower the better it is known and the more a probe would cost. (The known
    # draft's floor is ~2.5e-4 of requests here: 20,000 decisions expect 5 probes of it, 4,000 expected one, and
    # which seeds gave it depended on the order the decision read its random numbers in.)
    settings = Settings(exploration_rate=0.25, min_exploration_rate=0.02)
    n = 20_000
    known = probes(lookup_settled(2000), settings, n=n)
    little = probes(lookup_settled(50), settings, n=n)
    assert known > 0, "a drafter the segment settled against is never probed again"
    assert little > known
    assert little <= 0.02 * n + 3 * (0.02 * n) ** 0.5
    no_floor = Settings(exploration_rate=0.25, min_exploration_rate=0.0)
    assert probes(lookup_settled(2000), no_floor, n=n) == 0


def test_the_probe_floor_is_regret_bounded_and_never_zero() -> None:
    s = Settings()
    rate = 0.02
    assert probe_floor(rate, 1.3, 1.3, 0.0, s) == pytest.approx(rate)  # unknown and as good: the whole floor
    assert probe_floor(rate, 1.3, 1.3, 1e9, s) > 0  # known: small, never zero
    for loss in (0.05, 0.2, 0.5, 0.9):
        for evidence in (0.0, 10.0, 1e3):
            floor = probe_floor(rate, 1.3 * (1 - loss), 1.3, evidence, s)
            assert floor * loss <= rate * 0.1 + 1e-12  # expected cost of the floor's probes per request
    assert probe_floor(rate, 1.0, 1.3, 50.0, s) < probe_floor(rate, 1.2, 1.3, 50.0, s)  # dearer probes: fewer


def test_four_requests_one_stalled_give_the_machines_cost() -> None:
    # The draft's c was measured by 4 requests, one of them stalled, so its median-based estimate is uncertain:
    # decisions probe it (a draw of the cost is cheap enough), which the mean of summed timings never allowed.
    rng = random.Random(5)
    model = build_cost_model(cost_counts([request(rng, stall=1.5)] + [request(rng) for _ in range(3)]))
    costs = model.at(1)
    assert costs.c("draft", 0) == pytest.approx(C_DRAFT, rel=0.25)


# -- calibration ------------------------------------------------------------------------------------------------


def test_calibration_is_the_median_of_realised_over_expected() -> None:
    # 20 tokens emitted in 2 ms of drafting and 8 ms of verification at 1 ms a plain step: 20 tokens in 10 steps'
    # time, a realised speedup of 2.0. The plan promised 2.5: calibration 0.8. One stalled request among 21 (its
    # realised speedup 0.02) is one rank of the median.
    def aggregate(verify_seconds: float, expected: float = 2.5, drafter: str = "draft") -> Aggregate:
        return Aggregate("s", drafter, 4, 10, 40, 10, (10,) * 4, (10,) * 4, (3, 3, 2, 2), tokens_emitted=20,
                         draft_seconds=0.002, verify_seconds=verify_seconds, expected_speedup=expected)  # fmt: skip

    assert aggregate(0.008).realised_speedup(0.001) == pytest.approx(2.0)
    seg = SegmentCounts()
    for i in range(21):
        seg.add_fields(aggregate(1.0 if i == 0 else 0.008).calibration_fields(0.001))
    assert median(seg.calibration["draft"]) == pytest.approx(0.8, rel=0.05)
    assert total(seg.calibration["draft"]) == 21
    assert aggregate(0.008, drafter="none").calibration_fields(0.001) == {}  # nothing speculated: nothing to check
    assert aggregate(0.008, expected=0.0).calibration_fields(0.001) == {}  # no expectation known
    assert aggregate(0.008).calibration_fields(0.0) == {}  # no plain step measured yet


def test_calibration_reads_the_requests_totals_where_the_aggregate_carries_them() -> None:
    # The round policy ran this request at K 4 for 10 rounds (20 tokens in 10 ms), then stopped drafting for 10 plain
    # rounds (10 tokens in 10 ms): the request realised 30 tokens in 20 steps' time, 1.5x; its K 4 rounds alone read
    # 2.0. The observation is the request's (an aggregate without the totals: its own rounds).
    carrier = Aggregate("s", "draft", 4, 10, 40, 10, (10,) * 4, (10,) * 4, (3, 3, 2, 2), tokens_emitted=20,
                        draft_seconds=0.002, verify_seconds=0.008, expected_speedup=2.5, request_tokens_emitted=30,
                        request_seconds=0.020)  # fmt: skip
    assert carrier.realised_speedup(0.001) == pytest.approx(1.5)
    seg = SegmentCounts()
    seg.add_fields(carrier.calibration_fields(0.001))
    assert median(seg.calibration["draft"]) == pytest.approx(1.5 / 2.5, rel=0.05)
    own_only = replace(carrier, request_tokens_emitted=0, request_seconds=0.0)
    assert own_only.realised_speedup(0.001) == pytest.approx(2.0)


def test_a_k_never_measured_is_priced_at_the_measured_slope() -> None:
    # v(0..4) measured (1.0 .. 1.5): v(8), never measured, extends the measured mean slope (0.125 a token), not the
    # GPU's 0.02 (which made K 8 look almost free and drew the controller to long K on a CPU).
    rng = random.Random(4)
    bucket = build_cost_model(cost_counts([request(rng) for _ in range(30)])).at(1)
    assert bucket.verify[4] == pytest.approx(1.5, rel=0.05)
    assert bucket.verify[8] == pytest.approx(1.5 + 4 * 0.125, rel=0.05)
    assert bucket.verify[2] == pytest.approx(1.25, rel=0.05)  # between measured points: linear (v(0) and v(4))


def test_the_calibration_factor_is_shrunk_and_bounded() -> None:
    from controller.decision.decide import CALIBRATION_BOUNDS, CALIBRATION_PRIOR_REQUESTS, calibration_factor

    assert calibration_factor(0.5, 0.0) == 1.0  # no request: the model as it is
    assert calibration_factor(0.5, CALIBRATION_PRIOR_REQUESTS) == pytest.approx(0.5**0.5)  # half way, in log space
    assert calibration_factor(0.5, 1e6) == pytest.approx(0.5, rel=1e-4)  # many requests: what they realised
    assert (
        calibration_factor(1e-9, 1e6) == CALIBRATION_BOUNDS[0] and calibration_factor(1e9, 1e6) == CALIBRATION_BOUNDS[1]
    )
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert calibration_factor(bad, 10.0) == 1.0


def test_a_segment_whose_requests_realise_less_than_the_model_is_switched_off() -> None:
    # The model expects the draft at about 1.2x; the segment's requests realised 0.7 of what it expected, over many
    # requests: the decision scales the arm by that and switches speculation off, saying so in the plan.
    from dataclasses import replace

    from controller.decision.cost_model import BucketCosts
    from controller.decision.counts import PositionCounts
    from controller.decision.decide import calibration_factor

    seg = SegmentCounts()
    for i in range(16):
        seg.positions[("draft", i)] = PositionCounts(1e5, 1e5, 1e5 * 0.6**i, 1e5 * 0.6 ** (i + 1))
    settings = Settings(exploration_rate=0.0)
    costs = BucketCosts(1, 0.001, verify=tuple(1.0 + 0.1 * i for i in range(65)))
    req = Request("s", 1, ("draft",), 128)
    model = estimate_drafter(seg, "draft", 8, 0.5, 1.0, settings.prior_strength, 0.2)
    trusted = decide(settings, "v1", req, {"draft": model}, costs, None, random.Random(0))
    assert trusted.drafter == "draft" and 1.1 < trusted.expected_speedup < 1.4 and trusted.calibration == 1.0
    factor = calibration_factor(0.7, 500.0)
    calibrated = replace(model, calibration=factor)
    plan = decide(settings, "v1", req, {"draft": calibrated}, costs, None, random.Random(0))
    assert plan.drafter == "none" and plan.reason == "low_expected_speedup"
    assert plan.expected_speedup == pytest.approx(trusted.expected_speedup * factor, rel=1e-6)
    mild = replace(model, calibration=calibration_factor(0.95, 500.0))
    kept = decide(settings, "v1", req, {"draft": mild}, costs, None, random.Random(0))
    assert kept.drafter == "draft" and kept.calibration == pytest.approx(mild.calibration)
    assert kept.model_speedup == pytest.approx(trusted.expected_speedup, rel=1e-6)  # what the worker reports back


def test_a_segment_s_calibration_starts_at_the_fleet_s_and_moves_to_its_own() -> None:
    # Hierarchical, as α: a new segment (no request of its own, or one, stalled or not) starts at the fleet's factor for
    # the drafter, not at 1; its own requests then move it, half way after CALIBRATION_PRIOR_REQUESTS of them.
    from controller.decision.decide import CALIBRATION_BOUNDS, CALIBRATION_PRIOR_REQUESTS, calibration_factor

    assert calibration_factor(0.0, 0.0, toward=0.8) == pytest.approx(0.8)  # nothing of its own: the fleet's
    assert calibration_factor(0.1, 1.0, toward=0.8) == pytest.approx(0.8)  # one stalled request decides nothing
    assert calibration_factor(1.25, CALIBRATION_PRIOR_REQUESTS, toward=0.8) == pytest.approx(1.0)  # half way in logs
    assert calibration_factor(1.25, 1e6, toward=0.8) == pytest.approx(1.25, rel=1e-4)  # its own, given enough
    assert calibration_factor(1.0, 0.0, toward=1e-9) == CALIBRATION_BOUNDS[0]  # the fleet's is bounded too
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert calibration_factor(1.0, 0.0, toward=bad) == 1.0


def interpolated(points: dict[int, float], n: int) -> float:
    """v(n) by its definition, one n at a time: the point, else linear between the nearest measured neighbours, else
    beyond the largest at the measured mean slope, never below the default."""
    if n in points:
        return points[n]
    below = max(m for m in points if m < n)
    above = [m for m in points if m > n]
    if not above:
        largest = max(points)
        slope = max((points[largest] - points[0]) / largest, DEFAULT_VERIFY_SLOPE) if largest else DEFAULT_VERIFY_SLOPE
        return points[below] + slope * (n - below)
    hi = min(above)
    return points[below] + (points[hi] - points[below]) * (n - below) / (hi - below)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(1, TABLE_SIZE - 1), st.floats(0.5, 40.0, allow_nan=False, allow_infinity=False), max_size=TABLE_SIZE
    )
)
def test_the_verify_table_in_one_pass_is_each_v_n_by_its_definition(measured: dict[int, float]) -> None:
    points = {0: 1.0} | measured
    assert _verify_table(points, TABLE_SIZE) == tuple(interpolated(points, n) for n in range(TABLE_SIZE))
