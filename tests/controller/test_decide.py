"""decide() as a table: each row is a situation and the decision it must produce, with why."""

from __future__ import annotations

import random

import pytest

from controller.counts import PositionCounts, SegmentCounts
from controller.decide import Decision, Request, decide, estimate_drafter
from controller.policy import Settings, SettingsOverride, apply_override
from controller.speedup import VerifyCost

VERIFY = VerifyCost(intercept_seconds=1.0, slope_seconds=0.02)
BOTH = ("draft", "prompt_lookup")
N = 1e6  # so many observations that the prior does not matter


def counts(**rates: tuple[float, float]) -> SegmentCounts:
    """Counts where drafter d has conditional acceptance a and proposal rate π at every position."""
    c = SegmentCounts()
    for drafter, (a, pi) in rates.items():
        for i in range(16):
            c.positions[(drafter, i)] = PositionCounts(offered=N, proposed=pi * N, verified=pi * N, accepted=a * pi * N)
    return c


def run(
    seg: SegmentCounts,
    settings: Settings | None = None,
    previous: Decision | None = None,
    seed: int = 0,
    c_draft: float = 0.05,
    **request: object,
) -> Decision:
    settings = settings or Settings(exploration_rate=0.0)
    req = Request(**{"segment": "s", "batch_size": 1, "drafters": BOTH, "max_new_tokens": 128, **request})  # type: ignore[arg-type]
    estimates = {
        d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.5, 0.5, settings.prior_strength, c)
        for d, c in (("draft", c_draft), ("prompt_lookup", 0.0))
    }
    return decide(settings, "v1", req, estimates, VERIFY, previous, random.Random(seed))


def with_(**changes: object) -> Settings:
    return apply_override(Settings(exploration_rate=0.0), SettingsOverride(**changes))  # type: ignore[arg-type]


GOOD_DRAFT = counts(draft=(0.9, 1.0), prompt_lookup=(0.3, 0.3))


@pytest.mark.parametrize(
    ("kwargs", "drafter", "reason", "why"),
    [
        ({"batch_size": 9}, "none", "batch_size_above_threshold", "default threshold 8: batch 9 is off"),
        ({"batch_size": 8}, "draft", "best_expected_speedup", "batch 8 is still on"),
        ({"settings": with_(force="none")}, "none", "policy_off", "the policy switches the segment off"),
        ({"settings": with_(force="prompt_lookup", force_k=3)}, "prompt_lookup", "policy_forced", "forced drafter"),
        ({"drafters": ()}, "none", "no_drafter_available", "the worker has no drafter"),
        ({"drafters": ("prompt_lookup",)}, "prompt_lookup", "best_expected_speedup", "only what the worker has"),
        ({"max_new_tokens": 3}, "none", "request_too_short", "below min_new_tokens (4)"),
        ({"settings": with_(drafters={"draft": {"enabled": False}})}, "prompt_lookup", "best_expected_speedup",
         "a disabled drafter is never chosen"),
    ],
)  # fmt: skip
def test_rules(kwargs, drafter, reason, why):
    decision = run(GOOD_DRAFT, **kwargs)
    assert (decision.drafter, decision.reason) == (drafter, reason), why
    assert decision.policy_version == "v1"


def test_forced_k_is_used():
    decision = run(GOOD_DRAFT, settings=with_(force="prompt_lookup", force_k=3))
    assert decision.num_draft_tokens == 3


@pytest.mark.parametrize(
    ("seg", "drafter", "reason", "why"),
    [
        (counts(draft=(0.9, 1.0), prompt_lookup=(0.3, 0.3)), "draft", "best_expected_speedup", "high α draft"),
        (counts(draft=(0.5, 1.0), prompt_lookup=(0.95, 0.9)), "prompt_lookup", "best_expected_speedup",
         "extractive: lookup proposes and is accepted, at no drafting cost"),
        (counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05)), "none", "low_expected_speedup",
         "nothing agrees with the target: off"),
        (counts(draft=(0.45, 1.0), prompt_lookup=(0.05, 0.05)), "none", "alpha_below_floor",
         "draft α 0.45 would still pay a little with c = 0.05, but is under the 0.5 floor"),
    ],
)  # fmt: skip
def test_learned_choice(seg, drafter, reason, why):
    decision = run(seg)
    assert (decision.drafter, decision.reason) == (drafter, reason), why


def test_best_k_grows_with_alpha():
    ks = [run(counts(draft=(a, 1.0), prompt_lookup=(0.0, 0.0))).num_draft_tokens for a in (0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] < ks[-1], ks


def test_expected_speedup_is_reported():
    decision = run(GOOD_DRAFT)
    assert decision.expected_speedup > 2.0  # α 0.9, c 0.05: several tokens per round


def test_hysteresis_keeps_a_nearly_as_good_previous_choice():
    best = run(GOOD_DRAFT)
    previous = Decision("draft", best.num_draft_tokens - 1, "best_expected_speedup", "v1")
    decision = run(GOOD_DRAFT, previous=previous)
    assert (decision.drafter, decision.num_draft_tokens, decision.reason) == (
        "draft", best.num_draft_tokens - 1, "kept_previous",
    )  # fmt: skip


def test_hysteresis_switches_when_the_gain_is_large():
    previous = Decision("prompt_lookup", 2, "best_expected_speedup", "v1")
    assert run(GOOD_DRAFT, previous=previous).drafter == "draft"


def test_switched_off_segment_needs_the_margin_to_come_back():
    # α 0.55, c 0.42: K = 1 gives 1.55 / (0.42 + 1.02) = 1.076, above 1.05 but below 1.05 x 1.05
    seg = counts(draft=(0.55, 1.0), prompt_lookup=(0.0, 0.0))
    fresh = run(seg, c_draft=0.42)
    assert fresh.drafter == "draft" and 1.05 <= fresh.expected_speedup < 1.05 * 1.05, fresh
    was_off = Decision("none", 0, "low_expected_speedup", "v1")
    assert run(seg, c_draft=0.42, previous=was_off).reason == "low_expected_speedup"


def test_exploration_is_bounded_and_probes_switched_off_segments():
    seg = counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05))
    settings = with_(exploration_rate=0.1)
    decisions = [run(seg, settings=settings, seed=s) for s in range(2000)]
    probes = [d for d in decisions if d.exploration]
    assert 0.05 * 2000 < len(probes) <= 0.1 * 2000 + 3 * (2000 * 0.1 * 0.9) ** 0.5
    assert all(d.reason == "exploration" and d.drafter != "none" for d in probes)
    assert all(d.drafter == "none" for d in decisions if not d.exploration)


def test_no_exploration_when_the_rate_is_zero():
    seg = counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05))
    assert not any(run(seg, seed=s).exploration for s in range(300))


def test_long_prompt_short_answer_does_not_repay_a_draft_prefill():
    seg = counts(draft=(0.7, 1.0), prompt_lookup=(0.0, 0.0))
    # 20,000 prompt tokens x c 0.05 x 0.02 = 20 steps of draft prefill; 8 new tokens save fewer than that
    assert run(seg, max_new_tokens=8, prompt_tokens=20_000, drafters=("draft",)).reason == "request_too_short"
    assert run(seg, max_new_tokens=8, prompt_tokens=100, drafters=("draft",)).drafter == "draft"


def test_k_never_exceeds_what_the_request_can_use():
    assert run(GOOD_DRAFT, max_new_tokens=5).num_draft_tokens <= 4


def test_prior_decides_for_an_unseen_segment():
    # no data at all: prior α 0.5 per position, c 0.05 -> a short draft still pays
    decision = run(SegmentCounts(), drafters=("draft",))
    assert decision.drafter in ("draft", "none") and decision.reason in ("best_expected_speedup", "alpha_below_floor")
