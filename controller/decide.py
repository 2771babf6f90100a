"""Deciding how a request speculates: (policy, segment estimates, request) -> decision. Pure.

The order of the rules is the order of the reasons a decision can carry:
  batch_size_above_threshold, policy_off, policy_forced, no_drafter_available, request_too_short,
  then the learned choice: best_expected_speedup (kept for hysteresis: kept_previous),
  low_expected_speedup / alpha_below_floor (speculation off), or exploration (a bounded probe).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from controller.counts import PositionCounts, SegmentCounts
from controller.policy import Settings
from controller.speedup import VerifyCost, speedup_curve


@dataclass(frozen=True)
class Request:
    segment: str
    batch_size: int
    drafters: tuple[str, ...]  # what the worker can run
    max_new_tokens: int
    prompt_tokens: int = 0
    temperature: float = 0.0
    self_repetition: float = 0.0


@dataclass(frozen=True)
class Decision:
    drafter: str
    num_draft_tokens: int
    reason: str
    policy_version: str
    exploration: bool = False
    expected_speedup: float = 1.0
    stale: bool = False
    segment: str = ""

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.num_draft_tokens > 0


@dataclass(frozen=True)
class Beta:
    """Posterior of a rate: prior pseudo-counts plus observed successes and failures."""

    successes: float
    failures: float

    @property
    def mean(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total > 0 else 0.0

    def sample(self, rng: random.Random) -> float:
        if self.failures <= 0 or self.successes <= 0:  # a certain rate (a draft model always proposes)
            return self.mean
        return rng.betavariate(self.successes, self.failures)


@dataclass(frozen=True)
class DrafterEstimate:
    """What is believed about one drafter in one segment, per draft position."""

    drafter: str
    conditional: tuple[Beta, ...]  # a_i: accepted / verified at position i
    proposal: tuple[Beta, ...]  # π_i: the drafter had a token for position i
    cost_ratio: float  # c

    @cached_property
    def _means(self) -> tuple[list[float], list[float]]:
        return [b.mean for b in self.conditional], [b.mean for b in self.proposal]

    def means(self) -> tuple[list[float], list[float]]:
        """Posterior means (computed once: estimates are cached and reused across requests)."""
        return self._means

    def sample(self, rng: random.Random) -> tuple[list[float], list[float]]:
        return [b.sample(rng) for b in self.conditional], [b.sample(rng) for b in self.proposal]


def estimate_drafter(
    counts: SegmentCounts,
    drafter: str,
    k_max: int,
    prior_alpha: float,
    prior_proposal: float,
    prior_strength: float,
    cost_ratio: float,
) -> DrafterEstimate:
    """Per-position posteriors, shrunk hierarchically: each position towards the drafter's pooled rate in
    this segment, which is itself shrunk towards the prior. A position never verified yet (deeper than any
    K tried) is then estimated from the positions that were, not from the global prior alone."""
    positions = [counts.positions.get((drafter, i), PositionCounts()) for i in range(k_max)]
    n0 = prior_strength
    pooled_alpha = (sum(p.accepted for p in positions) + n0 * prior_alpha) / (sum(p.verified for p in positions) + n0)
    pooled_proposal = (sum(p.proposed for p in positions) + n0 * prior_proposal) / (
        sum(p.offered for p in positions) + n0
    )
    conditional = tuple(_shrunk(p.accepted, p.verified, pooled_alpha, n0) for p in positions)
    proposal = tuple(_shrunk(p.proposed, p.offered, pooled_proposal, n0) for p in positions)
    return DrafterEstimate(drafter, conditional, proposal, cost_ratio)


def _shrunk(successes: float, trials: float, prior_mean: float, strength: float) -> Beta:
    return Beta(successes + strength * prior_mean, max(trials - successes, 0.0) + strength * (1 - prior_mean))


@dataclass(frozen=True)
class Arm:
    drafter: str
    k: int
    speedup: float


def score_arms(
    estimate: DrafterEstimate,
    conditional: list[float],
    proposal: list[float],
    k_min: int,
    k_max: int,
    verify: VerifyCost,
) -> list[Arm]:
    curve = speedup_curve(conditional, proposal, k_max, estimate.cost_ratio, verify)
    return [Arm(estimate.drafter, k, curve[k - 1]) for k in range(k_min, k_max + 1)]


def repays_drafting(arm: Arm, request: Request, settings: Settings, cost_ratio: float) -> bool:
    """Does the expected saving over max_new_tokens exceed the draft model's extra prefill?"""
    saved_steps = request.max_new_tokens * (1.0 - 1.0 / arm.speedup) if arm.speedup > 0 else 0.0
    prefill_steps = (
        cost_ratio * request.prompt_tokens * settings.prefill_cost_per_token if arm.drafter == "draft" else 0.0
    )
    return saved_steps > prefill_steps


def decide(
    settings: Settings,
    policy_version: str,
    request: Request,
    estimates: Mapping[str, DrafterEstimate],
    verify: VerifyCost,
    previous: Decision | None,
    rng: random.Random,
) -> Decision:
    """The decision for one request. ``previous`` is the segment's last non-exploration decision."""

    def off(reason: str, speedup: float = 1.0) -> Decision:
        return Decision("none", 0, reason, policy_version, expected_speedup=speedup, segment=request.segment)

    if request.batch_size > settings.max_batch_size:
        return off("batch_size_above_threshold")
    if settings.force == "none":
        return off("policy_off")
    candidates = [
        d for d in request.drafters if d in settings.drafters and settings.drafter(d).enabled and d in estimates
    ]
    if settings.force is not None and settings.force in request.drafters:
        forced = settings.drafter(settings.force)
        k = min(settings.force_k or forced.k_max, max(request.max_new_tokens - 1, 0))
        if k == 0:
            return off("request_too_short")
        return Decision(settings.force, k, "policy_forced", policy_version, segment=request.segment)
    if not candidates:
        return off("no_drafter_available")
    if request.max_new_tokens < settings.min_new_tokens:
        return off("request_too_short")

    k_cap = request.max_new_tokens - 1  # a round emits up to K + 1 tokens
    arms: list[Arm] = []
    for d in candidates:
        s = settings.drafter(d)
        if s.k_min > k_cap:
            continue
        conditional, proposal = estimates[d].means()
        arms += score_arms(estimates[d], conditional, proposal, s.k_min, min(s.k_max, k_cap), verify)
    if not arms:
        return off("request_too_short")
    best = max(arms, key=lambda a: a.speedup)
    choice = _with_hysteresis(best, arms, previous, settings)
    if choice is not None and not repays_drafting(choice, request, settings, estimates[choice.drafter].cost_ratio):
        # Worth running, but not over this request: fall back to an arm whose gain repays the draft
        # model's prefill (prompt lookup has none); with none left, the request is too short.
        paying = [
            a
            for a in arms
            if a.speedup >= settings.min_speedup
            and repays_drafting(a, request, settings, estimates[a.drafter].cost_ratio)
        ]
        if not paying:
            return off("request_too_short")
        choice = max(paying, key=lambda a: a.speedup)
    exploit: Decision
    if choice is None:
        exploit = off("low_expected_speedup", best.speedup)
    elif estimates[choice.drafter].conditional[0].mean < settings.drafter(choice.drafter).alpha_floor:
        # α in the i.i.d. sense of the literature: the per-token rate, measured at the first position
        exploit = off("alpha_below_floor", choice.speedup)
    else:
        kept = (
            previous is not None
            and choice != best
            and (choice.drafter, choice.k)
            == (
                previous.drafter,
                previous.num_draft_tokens,
            )
        )
        reason = "kept_previous" if kept else "best_expected_speedup"
        exploit = Decision(
            choice.drafter, choice.k, reason, policy_version, False, choice.speedup, segment=request.segment
        )

    if rng.random() < settings.exploration_rate:
        probe = _thompson_arm(candidates, estimates, settings, k_cap, verify, rng)
        if probe is not None and (probe.drafter, probe.k) != (exploit.drafter, exploit.num_draft_tokens):
            # report the point estimate of the probed arm, not the lucky sample
            speedup = next((a.speedup for a in arms if (a.drafter, a.k) == (probe.drafter, probe.k)), 1.0)
            return Decision(
                probe.drafter, probe.k, "exploration", policy_version, True, speedup, segment=request.segment
            )
    return exploit


def _with_hysteresis(best: Arm, arms: list[Arm], previous: Decision | None, settings: Settings) -> Arm | None:
    """Keep the previous arm unless the best beats it by the margin; switch on or off only past margins."""
    margin = 1.0 + settings.hysteresis
    was_on = previous is not None and previous.speculates
    threshold = settings.min_speedup if was_on or previous is None else settings.min_speedup * margin
    if best.speedup < threshold:
        return None
    if was_on and previous is not None:
        kept = next((a for a in arms if (a.drafter, a.k) == (previous.drafter, previous.num_draft_tokens)), None)
        if kept is not None and kept.speedup * margin >= best.speedup and kept.speedup >= settings.min_speedup:
            return kept
    return best


def _thompson_arm(
    candidates: Sequence[str],
    estimates: Mapping[str, DrafterEstimate],
    settings: Settings,
    k_cap: int,
    verify: VerifyCost,
    rng: random.Random,
) -> Arm | None:
    """A probe: a drafter chosen uniformly (so a wrong prior cannot starve one), then the best K under one
    posterior sample of its rates (Thompson sampling)."""
    usable = [d for d in candidates if settings.drafter(d).k_min <= k_cap]
    if not usable:
        return None
    d = rng.choice(usable)
    s = settings.drafter(d)
    conditional, proposal = estimates[d].sample(rng)
    return max(score_arms(estimates[d], conditional, proposal, s.k_min, min(s.k_max, k_cap), verify),
               key=lambda a: a.speedup)  # fmt: skip
