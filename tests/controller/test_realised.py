"""Realised speedup as the decision's currency (decision/realised.py, decision/decide.py): one reference for
expected and realised speedups, the model as the prior and what a plan realised as the data, arms ranked by a lower
credible bound; a chain priced and calibrated as the draft model it runs."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from itertools import pairwise

import pytest

from controller.decision.cost_model import BucketCosts
from controller.decision.counts import Aggregate, PositionCounts, SegmentCounts
from controller.decision.decide import Request, best_arm, component_histogram, decide, drafter_cost, estimate_drafter
from controller.decision.policy import Settings
from controller.decision.realised import (
    LOWER_Z,
    MIN_REQUESTS,
    MODEL_LOG_SD,
    REFERENCE_PRIOR_REQUESTS,
    REQUEST_LOG_SD,
    plain_reference,
    posterior,
    realised,
)
from controller.decision.timing_histogram import bin_low, bin_of
from specd_api.speedup import chain_cost_ratio, cost_component

COSTS = BucketCosts(1, 0.001, {"draft": 0.2}, verify=tuple(1.0 + 0.1 * n for n in range(65)))


def histogram(*seconds: float) -> dict[int, float]:
    """One observation per value, as the store counts them."""
    hist: dict[int, float] = {}
    for s in seconds:
        b = bin_of(s)
        assert b is not None
        hist[b] = hist.get(b, 0.0) + 1.0
    return hist


def at_bin(seconds: float) -> float:
    """The value a histogram of one bin reads back as its median (the middle of the bin, in logs)."""
    b = bin_of(seconds)
    assert b is not None
    return math.sqrt(bin_low(b) * bin_low(b + 1))


# -- the reference ------------------------------------------------------------------------------------------------


def test_the_reference_moves_from_the_fleets_plain_step_to_the_segments_own() -> None:
    fleet, own = 0.001, 0.002
    assert plain_reference({}, fleet) == fleet  # nothing of its own: the fleet's
    assert plain_reference(histogram(own), 0.0) == pytest.approx(at_bin(own))  # no fleet figure: its own
    assert plain_reference({}, 0.0) == 0.0
    # REFERENCE_PRIOR_REQUESTS of its own requests: half way between the two, in logs (no jump at a count)
    halfway = plain_reference(histogram(*[own] * int(REFERENCE_PRIOR_REQUESTS)), fleet)
    assert halfway == pytest.approx(math.sqrt(at_bin(own) * fleet), rel=1e-6)
    many = plain_reference(histogram(*[own] * 1000), fleet)
    assert many == pytest.approx(at_bin(own), rel=0.01)
    steps = [plain_reference(histogram(*[own] * n), fleet) for n in range(8)]
    assert steps == sorted(steps) and all(b / a < 1.25 for a, b in pairwise(steps))


def test_a_plan_realises_the_reference_over_its_seconds_per_token() -> None:
    plain = histogram(*[0.002] * 10)
    plan = histogram(*[0.001] * 9, 1.5)  # nine requests at 1 ms a token, one stalled: one rank of the median
    found = realised(plan, plain, fleet_seconds=0.002)
    assert found is not None and found.requests == 10
    assert found.speedup == pytest.approx(at_bin(0.002) / at_bin(0.001), rel=0.01)
    # its standard error: no smaller than one request's spread over sqrt(n) (identical timings are not certainty)
    assert found.log_se >= 1.2533 * REQUEST_LOG_SD / math.sqrt(10)
    assert realised(histogram(*[0.001] * (int(MIN_REQUESTS) - 1)), plain, 0.002) is None  # too few requests
    assert realised(plan, {}, 0.0) is None  # no reference at all


def test_the_posterior_is_the_prior_without_data_and_the_data_given_enough() -> None:
    alone = posterior(1.5, None)
    assert alone.speedup == pytest.approx(1.5) and alone.sd_log == MODEL_LOG_SD
    assert alone.lower() == pytest.approx(1.5 * math.exp(-LOWER_Z * MODEL_LOG_SD))
    data = realised(histogram(*[0.001] * 400), histogram(*[0.0012] * 400), 0.0012)
    assert data is not None
    measured = posterior(1.5, data)
    assert measured.speedup == pytest.approx(data.speedup, rel=0.02)
    assert measured.sd_log < 0.05
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert posterior(bad, None).speedup == 1.0  # a model that is not a number promises nothing


# -- ranking by the lower credible bound --------------------------------------------------------------------------


def rates(drafter: str, a: float, pi: float = 1.0) -> SegmentCounts:
    c = SegmentCounts()
    for i in range(16):
        c.positions[(drafter, i)] = PositionCounts(1e6, pi * 1e6, pi * 1e6, a * pi * 1e6)
    return c


def estimate(seg: SegmentCounts, drafter: str, c: float, **changes: object) -> object:
    return replace(estimate_drafter(seg, drafter, 8, 0.5, 0.5, 20, c), **changes)


def test_an_arm_known_only_by_its_prior_does_not_beat_a_measured_arm() -> None:
    # The draft model realised 1.3x over 30 requests here; prompt lookup's model promises 1.45x but no request ran
    # it. Its lower bound (1.45 e^-0.25 = 1.13) is under the draft's (1.3 less a few per cent): the draft stays,
    # though lookup's expected speedup is higher. Thompson's draws still probe lookup (exploration is on in serving).
    seg = SegmentCounts()
    seg.add(rates("draft", 0.7))
    seg.add(rates("prompt_lookup", 0.6, 0.4))
    settings = Settings(exploration_rate=0.0)
    draft = estimate(seg, "draft", 0.2)
    model = best_arm(draft, draft.means(), 1, 8, COSTS).model  # type: ignore[attr-defined]
    plain = histogram(*[0.002] * 30)
    measured = realised(histogram(*[0.002 / 1.3] * 30), plain, 0.002)
    assert measured is not None and measured.speedup == pytest.approx(1.3, rel=0.05)
    lookup = estimate(seg, "prompt_lookup", 0.0)
    lookup_model = best_arm(lookup, lookup.means(), 1, 8, COSTS).model  # type: ignore[attr-defined]
    scale = 1.45 / lookup_model  # calibrate lookup's model to promise 1.45x
    estimates = {
        "draft": replace(draft, realised=measured, calibration=1.3 / model),  # type: ignore[type-var]
        "prompt_lookup": replace(lookup, calibration=scale),  # type: ignore[type-var]
    }
    req = Request("s", 1, ("draft", "prompt_lookup"), 128)
    plan = decide(settings, "v1", req, estimates, COSTS, None, random.Random(0))  # type: ignore[arg-type]
    assert plan.drafter == "draft", "a measured 1.3x beats a prior of 1.45x"
    assert plan.expected_speedup == pytest.approx(1.3, rel=0.05)
    # a prior well clear of what was measured (2x) wins, and is then measured in turn
    estimates["prompt_lookup"] = replace(lookup, calibration=2.0 / lookup_model)  # type: ignore[type-var]
    clear = decide(settings, "v1", req, estimates, COSTS, None, random.Random(0))  # type: ignore[arg-type]
    assert clear.drafter == "prompt_lookup"


def test_a_measured_arm_that_realised_less_than_none_switches_the_segment_off() -> None:
    # The model promises 1.4x; 40 requests realised 0.85x: the posterior is under min_speedup, speculation is off.
    seg = rates("draft", 0.7)
    draft = estimate(seg, "draft", 0.2)
    model = best_arm(draft, draft.means(), 1, 8, COSTS).model  # type: ignore[attr-defined]
    slow = realised(histogram(*[0.002 / 0.85] * 40), histogram(*[0.002] * 40), 0.002)
    estimates = {"draft": replace(draft, calibration=1.4 / model, realised=slow)}  # type: ignore[type-var]
    plan = decide(Settings(exploration_rate=0.0), "v1", Request("s", 1, ("draft",), 128), estimates, COSTS, None,
                  random.Random(0))  # type: ignore[arg-type]  # fmt: skip
    assert plan.drafter == "none" and plan.reason == "low_expected_speedup"
    assert plan.expected_speedup < 0.95


def test_a_plan_says_what_it_promises_and_what_its_model_alone_said() -> None:
    # expected_speedup is the posterior; model_speedup (expected / calibration) the model's own, which the worker
    # reports back with the request so that the controller's calibration measures the model, not the posterior.
    seg = rates("draft", 0.7)
    draft = estimate(seg, "draft", 0.2)
    arm = best_arm(draft, draft.means(), 1, 8, COSTS)  # type: ignore[arg-type]
    data = realised(histogram(*[0.002 / 1.1] * 50), histogram(*[0.002] * 50), 0.002)
    estimates = {"draft": replace(draft, realised=data)}  # type: ignore[type-var]
    plan = decide(Settings(exploration_rate=0.0), "v1", Request("s", 1, ("draft",), 128), estimates, COSTS, None,
                  random.Random(0))  # type: ignore[arg-type]  # fmt: skip
    assert plan.model_speedup == pytest.approx(arm.model, rel=1e-9)
    assert plan.expected_speedup == pytest.approx(posterior(arm.model, data).speedup, rel=1e-9)


# -- one component: the draft model ------------------------------------------------------------------------------


def test_a_chain_is_priced_as_the_draft_model_on_the_rounds_lookup_cannot_serve() -> None:
    assert cost_component("chain") == cost_component("draft") == "draft"
    assert cost_component("prompt_lookup") == "prompt_lookup"
    costs = BucketCosts(1, 0.001, {"draft": 0.3, "chain": 0.05, "prompt_lookup": 0.01})
    # lookup proposes in a quarter of the rounds: the draft model runs in the other three quarters
    assert drafter_cost("chain", costs, 0.05, lookup_hit=0.25) == pytest.approx(0.3 * 0.75)
    assert drafter_cost("draft", costs, 0.1, lookup_hit=0.25) == pytest.approx(0.3)
    assert drafter_cost("prompt_lookup", costs, 0.0, lookup_hit=0.25) == pytest.approx(0.01)
    unmeasured = BucketCosts(1, 0.001, {"chain": 0.05})
    assert drafter_cost("chain", unmeasured, 0.07, lookup_hit=0.25) == 0.07  # the policy's guess until measured
    assert chain_cost_ratio(0.3, math.nan) == pytest.approx(0.3) and chain_cost_ratio(0.3, 2.0) == 0.0


def test_a_chain_shares_the_draft_models_calibration() -> None:
    # The draft's requests realised 0.6 of what the model promised; the chain runs the same model: its prior is
    # corrected by the same factor, though no chain request was ever measured.
    seg = SegmentCounts()
    b = bin_of(0.6)
    assert b is not None
    seg.calibration["draft"][b] = 40.0
    chain = component_histogram(seg.calibration, "chain")
    assert chain == {b: 40.0}
    assert component_histogram(seg.calibration, "prompt_lookup") == {}


# -- the request's own frame: what one report adds -----------------------------------------------------------------


def test_a_request_adds_its_seconds_per_token_under_its_drafter_and_nothing_for_none() -> None:
    carrier = Aggregate("s", "draft", 4, 10, 40, 10, (10,) * 4, (10,) * 4, (3, 3, 2, 2), tokens_emitted=20,
                        draft_seconds=0.002, verify_seconds=0.008, expected_speedup=2.0, request_tokens_emitted=30,
                        request_seconds=0.020)  # fmt: skip
    assert carrier.seconds_per_token == pytest.approx(0.020 / 30)
    seg = SegmentCounts()
    seg.add_fields(carrier.segment_fields())
    assert dict(seg.realised) == {("draft", 1): histogram(0.020 / 30)}
    for other in (replace(carrier, drafter="none"), replace(carrier, request_tokens_emitted=0),
                  replace(carrier, counterfactual=True)):  # fmt: skip
        none = SegmentCounts()
        none.add_fields(other.segment_fields())
        assert not none.realised


def test_a_segment_with_few_plain_rounds_of_its_own_has_its_plans_time_one() -> None:
    # Its reference is the fleet's until its own plain rounds come from REFERENCE_REQUESTS requests: until then each
    # plan runs one plain round first, in the request's own context; after, none.
    from controller.decision.realised import PLAIN_ROUNDS, REFERENCE_REQUESTS

    draft = estimate(rates("draft", 0.8), "draft", 0.1)
    req = Request("s", 1, ("draft",), 128)

    def plan_for(reference: float) -> object:
        estimates = {"draft": replace(draft, reference_requests=reference)}  # type: ignore[type-var]
        return decide(Settings(exploration_rate=0.0), "v1", req, estimates, COSTS, None, random.Random(0))  # type: ignore[arg-type]

    young, settled = plan_for(REFERENCE_REQUESTS - 1), plan_for(REFERENCE_REQUESTS)
    assert young.drafter == settled.drafter == "draft"  # type: ignore[attr-defined]
    assert young.plain_rounds == PLAIN_ROUNDS >= 1 and settled.plain_rounds == 0  # type: ignore[attr-defined]


def test_a_scored_drafter_that_realised_nothing_is_probed_when_a_draw_prefers_it() -> None:
    # Prompt lookup is scored on every request: its acceptance is known, so it is never probed for that. What it
    # realises is not known until requests run it: while it has realised nothing here, a draw that prefers it
    # probes it (the draft model is measured at 1.2x; lookup's model promises more, but its prior alone does not
    # take the exploit plan from a measured arm). Once it has realised a speedup, only what scoring cannot see
    # would make it worth a probe: none.
    seg = SegmentCounts()
    seg.add(rates("draft", 0.6))
    for i in range(16):
        seg.counterfactual[("prompt_lookup", i)] = PositionCounts(1e6, 0.3e6, 0.3e6, 0.21e6)  # model 1.38x
    draft = estimate(seg, "draft", 0.2)
    model = best_arm(draft, draft.means(), 1, 8, COSTS).model  # type: ignore[attr-defined]
    measured = realised(histogram(*[0.002 / 1.2] * 30), histogram(*[0.002] * 30), 0.002)
    lookup = estimate(seg, "prompt_lookup", 0.0, scored_rounds=1e6)
    estimates = {"draft": replace(draft, realised=measured, calibration=1.2 / model), "prompt_lookup": lookup}
    settings = Settings(exploration_rate=0.25, min_exploration_rate=0.0)
    req = Request("s", 1, ("draft", "prompt_lookup"), 128)

    def probes(lookup_estimate: object) -> list[str]:
        both = {**estimates, "prompt_lookup": lookup_estimate}
        plans = [decide(settings, "v1", req, both, COSTS, None, random.Random(s)) for s in range(400)]  # type: ignore[arg-type]
        assert all(p.drafter == "draft" for p in plans if not p.exploration), "the measured arm is the exploit"
        return [p.drafter for p in plans if p.exploration]

    unmeasured = probes(lookup)
    assert unmeasured and set(unmeasured) == {"prompt_lookup"}
    assert 0.1 * 400 < len(unmeasured) <= 0.25 * 400 + 30
    seen = realised(histogram(*[0.002 / 1.1] * 30), histogram(*[0.002] * 30), 0.002)  # less than its model said
    assert probes(replace(lookup, realised=seen)) == [], "scored and measured: nothing left to probe it for"  # type: ignore[type-var]
