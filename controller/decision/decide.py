"""Deciding how a request speculates: (policy, segment estimates, costs, request) -> plan. Pure.

The order of the rules is the order of the reasons a plan can carry:
  batch_size_above_threshold, policy_off, policy_forced, no_drafter_available, request_too_short,
  then the learned choice: best_expected_speedup (kept for hysteresis: kept_previous), low_expected_speedup
  (speculation off), or exploration (a probe).

The learned choice scores every (drafter, K) by the speedup model under the posterior means of the per-position
acceptance and the measured costs (specd_api.speedup), scaled by its calibration: the prior of each drafter's
speedup. Where the drafter's requests in this segment realised a speedup (decision/realised.py), that is the data:
each arm's expected speedup is the posterior of the two, and arms are ranked by its lower credible bound, so that an
arm seen only through its prior cannot beat one that was measured unless its prior is well clear of it. The best arm
is chosen when its expected speedup clears ``min_speedup``; nothing else can veto it.

Exploration is Thompson sampling: each drafter's rates and the costs are drawn from their posteriors, its speedup
is the posterior that drawn model and its realised speedup make, and when a draw prefers a drafter other than the
chosen one, the request probes it (at most ``exploration_rate`` of requests). A probe runs its first rounds at
``k_max``, so one probe observes every position for every K; as the posteriors narrow, draws stop disagreeing and
probing stops by itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from controller.decision.cost_model import BucketCosts
from controller.decision.counts import SegmentCounts
from controller.decision.policy import Settings
from controller.decision.realised import PLAIN_ROUNDS, REFERENCE_REQUESTS, Realised, posterior
from controller.decision.timing_histogram import Histogram, add_into
from specd_api.modes import SAMPLED, mode_of
from specd_api.plan import BATCH_RULE_REASON, SCORABLE, Plan, off, speculation_allowed
from specd_api.speedup import (
    best_k,
    chain_cost_ratio,
    cost_component,
    repays_prefill,
    runs_draft_model,
    speedup_curve,
)


@dataclass(frozen=True)
class Request:
    segment: str  # the learning segment (specd_api.modes): the client's segment, per sampling mode
    batch_size: int
    drafters: tuple[str, ...]  # what the worker can run
    max_new_tokens: int
    prompt_tokens: int = 0
    temperature: float = 0.0
    self_repetition: float = 0.0

    @classmethod
    def neutral(cls, segment: str, batch_size: int, drafters: tuple[str, ...], max_new_tokens: int) -> Request:
        """A request of ``segment`` with neutral features (what a decision table or a segment's statistics are made
        for): no prompt, and the temperature of its sampling mode (0, or NEUTRAL_SAMPLED_TEMPERATURE)."""
        temperature = NEUTRAL_SAMPLED_TEMPERATURE if mode_of(segment) == SAMPLED else 0.0
        return cls(segment, batch_size, drafters, max_new_tokens, temperature=temperature)


NEUTRAL_SAMPLED_TEMPERATURE = 1.0


# Pseudo-counts past which a posterior is a point: its draw is its mean (the spread is below 1e-6). Near the float
# limit random.betavariate never returns (gammavariate's 2 * alpha overflows): a policy's prior_strength of 1e308
# would hang every Decide that explored.
POINT_MASS_WEIGHT = 1e12


# A posterior of a rate: (successes, failures), prior pseudo-counts plus what was observed. A plain tuple of floats,
# which the cyclic collector stops tracking after its first pass over it (an instance of a class, a named tuple
# included, stays tracked): the estimates kept for 1,000 segments hold ~150,000 of them, and a full collection that
# walks them holds the interpreter ~100 ms.
Beta = tuple[float, float]


def beta_mean(beta: Beta) -> float:
    successes, failures = beta
    total = successes + failures
    return successes / total if total > 0 else 0.0


def beta_draw(beta: Beta, rng: random.Random) -> float:
    """A draw from the posterior: its mean where it is a point (a certain rate, or past POINT_MASS_WEIGHT)."""
    successes, failures = beta
    if failures <= 0 or successes <= 0:  # a certain rate (a draft model always proposes)
        return beta_mean(beta)
    if not successes + failures <= POINT_MASS_WEIGHT:  # written so that NaN weights take the mean too
        return beta_mean(beta)
    return rng.betavariate(successes, failures)


@dataclass(frozen=True)
class DrafterEstimate:
    """What is believed about one drafter in one segment, per draft position."""

    drafter: str
    conditional: tuple[Beta, ...]  # a_i: accepted / verified at position i
    proposal: tuple[Beta, ...]  # π_i: the drafter had a token for position i
    cost_ratio: float  # c
    prior_weight: float = 0.0  # pseudo-counts of the prior in each position's posterior
    calibration: float = 1.0  # realised / model speedup in this segment (calibration_factor): scales every arm
    scored_rounds: float = 0.0  # rounds scored counterfactually here (not served): what a worker's replay showed
    realised: Realised | None = None  # what this drafter's requests realised here, at the segment's reference
    reference_requests: float = 0.0  # (decayed) requests that timed this segment's plain step at the bucket

    @cached_property
    def _means(self) -> tuple[list[float], list[float]]:
        return [beta_mean(b) for b in self.conditional], [beta_mean(b) for b in self.proposal]

    def means(self) -> tuple[list[float], list[float]]:
        """Posterior means (computed once: estimates are cached and reused across requests)."""
        return self._means

    @cached_property
    def mean_arms(self) -> dict[tuple[int, int, tuple[float, ...]], Arm]:
        """``mean_arm``'s memo: (K bounds, verify table) -> the best arm under the means."""
        return {}

    def sample(self, rng: random.Random) -> tuple[list[float], list[float]]:
        return [beta_draw(b, rng) for b in self.conditional], [beta_draw(b, rng) for b in self.proposal]


def estimate_drafter(
    counts: SegmentCounts,
    drafter: str,
    k_max: int,
    prior_alpha: float,
    prior_proposal: float,
    prior_strength: float,
    cost_ratio: float,
) -> DrafterEstimate:
    """Per-position posteriors from served and counterfactual rounds, shrunk hierarchically: each position towards
    the drafter's pooled rate in this segment, which is itself shrunk towards the prior. A position never verified
    yet (deeper than any K tried) is then estimated from the positions that were, not from the global prior."""
    positions = [counts.evidence(drafter, i) for i in range(k_max)]
    n0 = prior_strength
    pooled_alpha = (sum(p.accepted for p in positions) + n0 * prior_alpha) / (sum(p.verified for p in positions) + n0)
    pooled_proposal = (sum(p.proposed for p in positions) + n0 * prior_proposal) / (
        sum(p.offered for p in positions) + n0
    )
    conditional = tuple(_shrunk(p.accepted, p.verified, pooled_alpha, n0) for p in positions)
    proposal = tuple(_shrunk(p.proposed, p.offered, pooled_proposal, n0) for p in positions)
    scored = counts.counterfactual.get((drafter, 0))
    return DrafterEstimate(
        drafter, conditional, proposal, cost_ratio, n0, scored_rounds=scored.offered if scored else 0.0
    )


def _shrunk(successes: float, trials: float, prior_mean: float, strength: float) -> Beta:
    return (successes + strength * prior_mean, max(trials - successes, 0.0) + strength * (1 - prior_mean))


@dataclass(frozen=True)
class Arm:
    drafter: str
    k: int
    speedup: float  # the expected speedup: the posterior's (realised.posterior), what a plan of this arm promises
    lower: float = 0.0  # its lower credible bound, what arms are ranked by (0: not given, the expected speedup)
    model: float = 0.0  # the speedup model's own (α, c, v(n)), before calibration and realised data (0: not given)

    @property
    def rank(self) -> float:
        """What arms are compared by: the lower credible bound."""
        return self.lower if self.lower > 0 else self.speedup


def best_arm(
    estimate: DrafterEstimate,
    rates: tuple[list[float], list[float]],
    k_min: int,
    k_max: int,
    costs: BucketCosts,
    cost_ratio: float | None = None,
) -> Arm:
    """The drafter's best K in [k_min, k_max] under ``rates`` (means or a posterior draw) and ``cost_ratio`` (a draw
    of its c; None: the estimate's), with the posterior of its speedup: the model's value at that K, calibrated, as
    the prior, and what the drafter realised as the data."""
    conditional, proposal = rates
    c = estimate.cost_ratio if cost_ratio is None else cost_ratio
    curve = speedup_curve(conditional, proposal, k_max, c, costs.verify_table(k_max))
    k, value = best_k(curve, k_min)
    belief = posterior(value * estimate.calibration, estimate.realised)
    return Arm(estimate.drafter, k, belief.speedup, belief.lower(), value)


MEAN_ARMS_KEPT = 64  # per estimate: a segment's requests come in a few K bounds and batch buckets


def mean_arm(estimate: DrafterEstimate, k_min: int, k_max: int, costs: BucketCosts) -> Arm:
    """``best_arm`` under the posterior means, kept on the estimate (which is cached across Decides until the
    segment's counts or costs move) per K bounds and verify table, all that it reads besides the estimate: the
    exploit arms, recomputed identically on every call, would be half of a Decide's work."""
    key = (k_min, k_max, costs.verify_table(k_max))
    kept = estimate.mean_arms.get(key)
    if kept is None:
        kept = best_arm(estimate, estimate.means(), k_min, k_max, costs)
        if len(estimate.mean_arms) < MEAN_ARMS_KEPT:
            estimate.mean_arms[key] = kept
    return kept


CALIBRATION_PRIOR_REQUESTS = 8.0  # pseudo-requests at calibration 1: a few requests move it little
CALIBRATION_MIN_REQUESTS = 3.0  # below this, no calibration: the median of one or two requests is a stall's
CALIBRATION_BOUNDS = (0.25, 2.0)


def calibration_factor(realised_over_model: float, requests: float, toward: float = 1.0) -> float:
    """The factor a segment's speedup model is scaled by: the median realised / model speedup of its recent
    requests, shrunk in log space by CALIBRATION_PRIOR_REQUESTS pseudo-requests towards ``toward`` (the fleet's
    factor for the drafter, hierarchical as α is: a new segment starts where the fleet's requests put the model, not
    at 1), within CALIBRATION_BOUNDS; ``toward`` itself below CALIBRATION_MIN_REQUESTS (the median of one request is
    that request, stalled or not). Whatever the model misses for this segment (acceptance shrunk towards a prior that
    flatters it, costs that differ at its context lengths, rounds the K rule cuts short) is then corrected by what
    its requests realised."""
    low, high = CALIBRATION_BOUNDS
    prior = min(max(toward, low), high) if toward > 0 and math.isfinite(toward) else 1.0
    if not (realised_over_model > 0 and requests >= CALIBRATION_MIN_REQUESTS):
        return prior
    if not math.isfinite(realised_over_model * requests):
        return prior
    n0 = CALIBRATION_PRIOR_REQUESTS
    log_factor = (requests * math.log(realised_over_model) + n0 * math.log(prior)) / (requests + n0)
    return min(max(math.exp(log_factor), low), high)


def component_histogram(tables: Mapping[str, Histogram], drafter: str) -> dict[int, float]:
    """The histograms of every drafter sharing ``drafter``'s cost component (specd_api.speedup.cost_component), added
    up: a chain's calibration is the draft model's, learned from the draft's and the chain's requests together."""
    merged: dict[int, float] = {}
    for name, histogram in tables.items():
        if cost_component(name) == cost_component(drafter):
            add_into(merged, histogram)
    return merged


def drafter_cost(drafter: str, costs: BucketCosts, default: float, lookup_hit: float) -> float:
    """c of ``drafter`` at these costs: the measured c of its component; for a chain, the draft model's on the share
    of rounds prompt lookup finds no match in (``lookup_hit``: lookup's proposal rate at the first position in this
    segment); ``default`` (the policy's guess) before the component is measured."""
    component = cost_component(drafter)
    if component not in costs.cost_ratio:
        return default
    c = costs.cost_ratio[component]
    return chain_cost_ratio(c, lookup_hit) if drafter == "chain" else c


def repays_drafting(arm: Arm, request: Request, settings: Settings, cost_ratio: float) -> bool:
    """Does the expected saving over max_new_tokens exceed the draft model's extra prefill?"""
    return repays_prefill(
        arm.drafter, arm.speedup, request.max_new_tokens, request.prompt_tokens, cost_ratio,
        settings.prefill_cost_per_token,
    )  # fmt: skip


def decide(
    settings: Settings,
    policy_version: str,
    request: Request,
    estimates: Mapping[str, DrafterEstimate],
    costs: BucketCosts,
    previous: Plan | None,
    rng: random.Random,
) -> Plan:
    """The plan for one request. ``previous`` is the segment's last learned (non-probe) plan. The steps: the rules
    (batch size, policy), the arms the request can run, the learned choice, then perhaps a probe instead."""
    return deliberate(settings, policy_version, request, estimates, costs, previous).draw(rng)


class SharedDraws:
    """The random part of a decision table's decisions that its batch buckets share (common random numbers): for
    each of its ``count`` decisions, the uniform that gates exploration and each drafter's posterior draw, drawn once
    for all buckets instead of once a bucket. A bucket's decisions stay independent draws of ``Deliberation.draw``
    (its probe shares unbiased, their spread the same); only across buckets are they correlated, which nothing
    reads. The posteriors do not move with the batch size, so a table's buckets sample each drafter's posterior a
    fifth as often. Drawn from ``rng`` in the order asked, so a table's inputs give the same draws."""

    def __init__(self, rng: random.Random, count: int) -> None:
        self._rng = rng
        self.gates = [rng.random() for _ in range(count)]
        self._rates: dict[tuple[int, str, tuple[Beta, ...], tuple[Beta, ...]], tuple[list[float], list[float]]] = {}

    def rates(self, index: int, estimate: DrafterEstimate) -> tuple[list[float], list[float]]:
        """Decision ``index``'s draw of ``estimate``'s posterior: drawn once, whichever bucket asks first."""
        key = (index, estimate.drafter, estimate.conditional, estimate.proposal)
        drawn = self._rates.get(key)
        if drawn is None:
            drawn = self._rates[key] = estimate.sample(self._rng)
        return drawn


@dataclass(frozen=True)
class Deliberation:
    """A decision before its random part: the plan when the request does not probe (``exploit``), and what a
    Thompson draw needs to say whether it probes instead (nothing, for a plan made by a rule)."""

    exploit: Plan
    settings: Settings
    make: _PlanMaker | None = None
    arms: tuple[Arm, ...] = ()
    bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    probeable: tuple[str, ...] = ()  # what the probe floors and the draws probe: not what scoring shows for free
    # what a draw that prefers it probes: the probeable ones, and a scored drafter that has realised nothing here yet
    # (its acceptance is known, what it realises is not)
    measurable: tuple[str, ...] = ()

    @property
    def may_probe(self) -> bool:
        """Can any draw probe? (A decision table draws only then: most segments, once learned, cannot.)"""
        rate = self.settings.exploration_rate
        if rate <= 0 or not self.measurable or self.make is None:
            return False
        others = any(d != self.exploit.drafter for d in self.measurable)
        return others or (not self.exploit.speculates and min(self.settings.min_exploration_rate, rate) > 0)

    def draw(self, rng: random.Random, shared: tuple[SharedDraws, int] | None = None) -> Plan:
        """The plan for one request: ``exploit``, or a probe when the request's posterior draw says so. With
        ``shared`` (a table's draws and this decision's index in them), the exploration gate and the posterior draws
        are that decision's, and ``rng`` draws the rest."""
        if self.make is None:
            return self.exploit
        make = self.make
        probe = _thompson(
            list(self.bounds), self.probeable, make.estimates, self.bounds, make.costs, self.exploit, self.settings,
            rng, self.arms, self.measurable, shared,
        )  # fmt: skip
        if probe is None:
            return self.exploit
        mean_arm = next(a for a in self.arms if a.drafter == probe)  # report the point estimate, not the lucky draw
        return make.plan(mean_arm, "exploration", self.bounds[probe][1], max(self.settings.probe_rounds, 1))


def deliberate(
    settings: Settings,
    policy_version: str,
    request: Request,
    estimates: Mapping[str, DrafterEstimate],
    costs: BucketCosts,
    previous: Plan | None,
) -> Deliberation:
    """Everything of ``decide`` but the draw: the rules, the arms, the learned choice."""
    scored = _counterfactual_ks(settings, request)
    make = _PlanMaker(settings, policy_version, request.segment, estimates, costs, scored)
    ruled = _ruled(settings, request, make)
    if ruled is not None:
        return Deliberation(ruled, settings)
    bounds = _k_bounds(settings, request, estimates)
    if isinstance(bounds, str):
        return Deliberation(make.off(bounds), settings)
    arms = tuple(mean_arm(estimates[d], *bounds[d], costs) for d in bounds)
    best = max(arms, key=lambda a: a.rank)
    choice = _paying_choice(
        _with_hysteresis(best, list(arms), previous, settings), arms, request, settings, estimates
    )  # fmt: skip
    if isinstance(choice, str):
        return Deliberation(make.off(choice), settings)
    if choice is None:
        exploit = make.off("low_expected_speedup", best.speedup)
    else:
        kept = previous is not None and choice != best and choice.drafter == previous.drafter
        ceiling = min(choice.k + settings.k_headroom, bounds[choice.drafter][1])
        exploit = make.plan(choice, "kept_previous" if kept else "best_expected_speedup", ceiling)
    probeable = tuple(d for d in bounds if not _learned_unprobed(d, scored, estimates[d]))
    measurable = tuple(d for d in bounds if d in probeable or estimates[d].realised is None)
    return Deliberation(exploit, settings, make, arms, bounds, probeable, measurable)


@dataclass(frozen=True)
class _PlanMaker:
    """Builds the plans of one decision: off, or an arm with its K ceiling and what the worker adapts with."""

    settings: Settings
    policy_version: str
    segment: str
    estimates: Mapping[str, DrafterEstimate]
    costs: BucketCosts
    scored: tuple[tuple[str, int], ...]  # the plans' counterfactual_ks

    def off(self, reason: str, speedup: float = 1.0) -> Plan:
        plan = off(reason, self.policy_version, self.segment, speedup)
        return replace(plan, counterfactual_ks=self.scored, max_batch_size=self.settings.max_batch_size)

    def plan(self, arm: Arm, reason: str, k: int, probe_rounds: int = 0) -> Plan:
        estimate = self.estimates[arm.drafter]
        conditional, proposal = estimate.means()
        return Plan(
            drafter=arm.drafter,
            k=k,
            reason=reason,
            policy_version=self.policy_version,
            exploration=probe_rounds > 0,
            expected_speedup=arm.speedup,
            segment=self.segment,
            stop_threshold=self.settings.drafter(arm.drafter).stop_threshold if runs_draft_model(arm.drafter) else 0.0,
            acceptance=tuple(conditional[:k]),
            proposal=tuple(proposal[:k]),
            prior_strength=self.settings.plan_prior_rounds,
            cost_ratio=estimate.cost_ratio,
            verify_cost=self.costs.verify_table(k),
            probe_rounds=probe_rounds,
            plain_rounds=PLAIN_ROUNDS if estimate.reference_requests < REFERENCE_REQUESTS else 0,
            counterfactual_ks=self.scored,
            calibration=arm.speedup / arm.model if arm.model > 0 else estimate.calibration,
            max_batch_size=self.settings.max_batch_size,
        )


def _ruled(settings: Settings, request: Request, make: _PlanMaker) -> Plan | None:
    """The rules before anything learned: the batch-size rule, then the policy's off or forced drafter."""
    if not speculation_allowed(request.batch_size, settings.max_batch_size):
        return make.off(BATCH_RULE_REASON)
    if settings.force == "none":
        return make.off("policy_off")
    if settings.force is not None and settings.force in request.drafters:
        forced = settings.drafter(settings.force)
        k = min(settings.force_k or forced.k_max, max(request.max_new_tokens - 1, 0))
        if k == 0:
            return make.off("request_too_short")
        threshold = forced.stop_threshold if runs_draft_model(settings.force) else 0.0
        return Plan(settings.force, k, "policy_forced", make.policy_version, segment=make.segment,
                    stop_threshold=threshold, counterfactual_ks=make.scored,
                    max_batch_size=settings.max_batch_size)  # fmt: skip
    return None


def _k_bounds(
    settings: Settings, request: Request, estimates: Mapping[str, DrafterEstimate]
) -> dict[str, tuple[int, int]] | str:
    """Each drafter this request can run, with its K range (a round emits up to K + 1 tokens, so K stays under
    max_new_tokens); or why none can (the reason of the plan that switches it off)."""
    candidates = [
        d for d in request.drafters if d in settings.drafters and settings.drafter(d).enabled and d in estimates
    ]
    if not candidates:
        return "no_drafter_available"
    if request.max_new_tokens < settings.min_new_tokens:
        return "request_too_short"
    k_cap = request.max_new_tokens - 1
    bounds: dict[str, tuple[int, int]] = {}
    for d in candidates:
        bounds[d] = (settings.drafter(d).k_min, min(settings.drafter(d).k_max, k_cap))
    usable = {d: b for d, b in bounds.items() if b[0] <= k_cap}
    return usable or "request_too_short"


def _paying_choice(
    choice: Arm | None, arms: Sequence[Arm], request: Request, settings: Settings,
    estimates: Mapping[str, DrafterEstimate],
) -> Arm | str | None:  # fmt: skip
    """``choice`` if its gain over this request repays the draft model's prefill; else the best arm that does
    (prompt lookup has no prefill); else "request_too_short"."""
    if choice is None or repays_drafting(choice, request, settings, estimates[choice.drafter].cost_ratio):
        return choice
    paying = [
        a
        for a in arms
        if a.speedup >= settings.min_speedup and repays_drafting(a, request, settings, estimates[a.drafter].cost_ratio)
    ]
    return max(paying, key=lambda a: a.rank) if paying else "request_too_short"


def _counterfactual_ks(settings: Settings, request: Request) -> tuple[tuple[str, int], ...]:
    """The one-hot drafters scored over the request's rounds whatever runs (prompt lookup, suffix decoding), each at
    its k_max, when the worker has it and the policy allows it."""
    if not settings.counterfactual:
        return ()
    return tuple(
        (d, settings.drafter(d).k_max) for d in SCORABLE if d in request.drafters and settings.drafter(d).enabled
    )


def _learned_unprobed(drafter: str, scored: tuple[tuple[str, int], ...], estimate: DrafterEstimate) -> bool:
    """Is ``drafter`` learned from counterfactual scoring, so that probing it would pay to learn what is seen for
    free? Prompt lookup whenever the plan asks it scored: a worker that offers it scores it on every request. Suffix
    decoding once the segment also holds rounds scored for it: a worker scores it on a share of the requests only
    (``suffix.counterfactual_share``, which may be 0; none while its scoring queue is full), so until such rounds
    arrive only probes show its rate. (What it realises is not seen that way: while it has realised nothing here, a
    draw that prefers it still probes it, ``Deliberation.measurable``.)"""
    if not any(d == drafter for d, _ in scored):
        return False
    return drafter == "prompt_lookup" or estimate.scored_rounds > 0


def _with_hysteresis(best: Arm, arms: list[Arm], previous: Plan | None, settings: Settings) -> Arm | None:
    """Keep the previous drafter unless the best beats it by the margin (in rank); switch on or off only past margins
    (in expected speedup)."""
    margin = 1.0 + settings.hysteresis
    was_on = previous is not None and previous.speculates
    threshold = settings.min_speedup if was_on or previous is None else settings.min_speedup * margin
    if best.speedup < threshold:
        return None
    if was_on and previous is not None:
        kept = next((a for a in arms if a.drafter == previous.drafter), None)
        if kept is not None and kept.rank * margin >= best.rank and kept.speedup >= settings.min_speedup:
            return kept
    return best


def _thompson(
    usable: Sequence[str],
    probeable: Sequence[str],
    estimates: Mapping[str, DrafterEstimate],
    bounds: Mapping[str, tuple[int, int]],
    costs: BucketCosts,
    exploit: Plan,
    settings: Settings,
    rng: random.Random,
    arms: Sequence[Arm] = (),
    measurable: Sequence[str] | None = None,
    shared: tuple[SharedDraws, int] | None = None,
) -> str | None:
    """The drafter to probe, or None. One posterior draw per usable drafter, of its rates and of the costs (a cost
    measured by few requests is uncertain too; plain decoding scores min_speedup): when the draw's winner is a
    ``measurable`` drafter (the probeable ones, by default) other than the exploit plan's, it is probed, on at most
    ``exploration_rate`` of requests.
    Failing that, every probeable drafter but the exploit's keeps a floor of probes (``probe_floor``), whether the
    segment speculates or not: old counts decay, but only new rounds can show that traffic or costs changed, and a
    draw that never favours a drafter again (one stalled request made it look slow) must not end its story."""
    measurable = probeable if measurable is None else measurable
    if settings.exploration_rate <= 0 or not measurable:
        return None
    drawn: dict[str, Arm] = {}

    def draws() -> dict[str, Arm]:
        """The posterior draw, made only when a branch reads it: the share that may probe is decided first (an
        independent uniform, so the same probes follow in distribution), and most Decides then draw nothing. Each
        drafter's model is drawn (its rates, the costs), and its speedup is the posterior that drawn model and what
        the drafter realised make: a drafter the data pins down draws near what it realised, one known by its model
        alone draws as its rates do."""
        if not drawn:
            drawn_costs = costs.draw(rng)
            for d in usable:
                estimate = estimates[d]
                rates = estimate.sample(rng) if shared is None else shared[0].rates(shared[1], estimate)
                c = _drawn_c(d, estimate, costs, drawn_costs)
                drawn[d] = best_arm(estimate, rates, *bounds[d], drawn_costs, c)
        return drawn

    gate = rng.random() if shared is None else shared[0].gates[shared[1]]
    if gate < settings.exploration_rate:
        winner = max(draws().values(), key=lambda a: a.speedup)
        if winner.drafter in measurable and winner.drafter != exploit.drafter and winner.speedup > settings.min_speedup:
            return winner.drafter
    floor_rate = min(settings.min_exploration_rate, settings.exploration_rate)
    if not probeable:
        return None
    if not exploit.speculates and rng.random() < floor_rate:
        return max((draws()[d] for d in probeable), key=lambda a: a.speedup).drafter
    if exploit.speculates and floor_rate > 0:
        mean = {a.drafter: a.speedup for a in arms}
        u = rng.random()
        for d in probeable:
            if d == exploit.drafter or d not in mean:
                continue
            u -= probe_floor(floor_rate, mean[d], exploit.expected_speedup, _evidence(estimates[d]), settings)
            if u < 0:
                return d
    return None


def _drawn_c(drafter: str, estimate: DrafterEstimate, costs: BucketCosts, drawn: BucketCosts) -> float:
    """The drafter's c under a draw of the costs: its estimate's c (the component's, as the segment runs it: a
    chain's is the draft model's for the rounds lookup cannot serve) scaled as the draw moved the component's."""
    component = cost_component(drafter)
    measured, moved = costs.cost_ratio.get(component), drawn.cost_ratio.get(component)
    if measured is None or moved is None or not measured > 0:
        return estimate.cost_ratio
    return estimate.cost_ratio * moved / measured


PROBE_LOSS_SCALE = 0.1  # a probe that would run 10% slower than the exploit plan gets half the floor


def probe_floor(rate: float, speedup: float, exploit_speedup: float, evidence: float, settings: Settings) -> float:
    """The share of a segment's requests that probe a drafter it does not use: ``rate`` (min_exploration_rate),
    scaled down by how well the drafter is known (evidence: the rounds behind its first position's estimate, against
    prior_strength pseudo-rounds; as a posterior's spread, by their square root) and by what a probe costs (its
    expected slowdown against the plan in use), so that the floor's expected regret stays below
    rate * PROBE_LOSS_SCALE per drafter while it never reaches zero: evidence decays, so a drafter left alone is
    probed again."""
    reference = max(settings.prior_strength, 1.0)
    uncertainty = (reference / (reference + max(evidence, 0.0))) ** 0.5  # a posterior's spread: 1 / sqrt(rounds)
    loss = max(0.0, 1.0 - speedup / exploit_speedup) if exploit_speedup > 0 else 0.0
    return rate * uncertainty / (1.0 + loss / PROBE_LOSS_SCALE)


def _evidence(estimate: DrafterEstimate) -> float:
    """Observed rounds (beyond the prior's pseudo-counts) behind the first position's posterior."""
    if not estimate.conditional:
        return 0.0
    successes, failures = estimate.conditional[0]
    return max(successes + failures - estimate.prior_weight, 0.0)
