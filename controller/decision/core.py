"""The controller's decisions and statistics, independent of gRPC: the learner and the policies asked per request,
with the caches that keep a decision's bulk (each drafter's posteriors, the priors' inputs) between calls, and the
hysteresis memory of each segment's last learned plan. The servicer (controller/service.py), the decision tables and
the metrics endpoint call it; the benchmarks call it in-process."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from controller.decision.cost_model import BucketCosts
from controller.decision.counts import SegmentCounts
from controller.decision.decide import (
    Arm,
    DrafterEstimate,
    Request,
    SharedDraws,
    calibration_factor,
    component_histogram,
    decide,
    deliberate,
    drafter_cost,
    estimate_drafter,
    mean_arm,
)
from controller.decision.drift_watch import DriftAlarm
from controller.decision.learner import Learner
from controller.decision.policy import DRAFTERS, PolicyStore, Settings, drafter_set
from controller.decision.realised import realised
from controller.decision.timing_histogram import median, total
from controller.pacing import no_pause
from specd_api.lru import LruMemory
from specd_api.modes import GREEDY, Mode, sampling_mode
from specd_api.plan import Plan
from specd_api.speedup import runs_draft_model, runs_head

TYPICAL_MAX_NEW_TOKENS = 128  # the request that GetSegmentStats's "decision now" is made for
# What the caches key a segment with no counts by: every such segment's estimates are the same (the priors' alone), so
# a client naming a new segment in each Decide shares one entry instead of filling the caches with its names and
# evicting the learned segments' entries (each of which would then cost a learned segment's Decide its full work).
UNSEEN: object = ("unseen segment",)
# Plans made from the statistics (not from a rule): the ones hysteresis remembers.
LEARNED_REASONS = ("best_expected_speedup", "kept_previous", "low_expected_speedup")


@dataclass(frozen=True)
class SegmentView:
    """What is known of one segment at one moment (``Controller.segment_view``)."""

    segment: str
    counts: SegmentCounts
    estimates: dict[str, DrafterEstimate]
    costs: BucketCosts  # at batch 1
    decision: Plan  # what Decide would answer now for a typical request
    arms: dict[str, Arm]  # each drafter's arm for that request, where its settings let it run
    drift: Sequence[DriftAlarm]
    stale: bool


def memory_key(segment: str, drafters: Sequence[str]) -> str:
    """Where the hysteresis memory keeps a plan: its segment and the drafters it was chosen among (a worker's set,
    "none" aside, in one order). Hysteresis holds a choice among the same arms steady; a plan chosen among other
    arms says nothing of it, and a memory two drafter sets' tables shared would move at each one's build and
    recompute every table of both at every refresh."""
    return f"{segment}|{','.join(drafter_set(drafters))}"


class Controller:
    """Decisions and statistics, independent of gRPC (the benchmark calls it in-process)."""

    def __init__(
        self, learner: Learner, policies: PolicyStore, max_remembered: int = 10_000, drafter_sets: int = 1
    ) -> None:
        self.learner = learner
        self.policies = policies
        # the last learned (non-probe) plan per segment and drafter set (memory_key): max_remembered a set
        self._previous: LruMemory[Plan] = LruMemory(max_remembered * drafter_sets)
        self._cache_lock = threading.Lock()
        self._max_remembered = max_remembered
        self._rng = threading.local()
        self._seed: int | None = None  # None: each thread's draws seeded from the OS
        self._estimates: dict[tuple[object, ...], dict[str, DrafterEstimate]] = {}
        self._posteriors: dict[tuple[object, ...], DrafterEstimate] = {}  # _posteriors_of's
        self._inputs: dict[tuple[object, ...], tuple[tuple[str, float, float, float], ...]] = {}
        self._inputs_version: object = None  # the learner's version the kept inputs were made at
        self._drift_announced: LruMemory[bool] = LruMemory(max_remembered)  # alarms already put on a Decide span
        self._offered: set[str] = set()  # the drafters some worker has offered in a Decide or a table's watch

    def rng(self) -> random.Random:
        """This thread's source of the decisions' random draws (Thompson sampling, probes)."""
        if not hasattr(self._rng, "value"):
            self._rng.value = random.Random(self._seed)
        return self._rng.value

    def reseed(self, seed: int) -> None:
        """From now on each thread draws from its own ``random.Random(seed)``: the same requests in the same order
        on one thread (Decide's, the event loop) get the same decisions. For simulations and tests that replay."""
        self._seed = seed
        self._rng = threading.local()

    def estimates(
        self, settings: Settings, request: Request, costs: BucketCosts, remember: bool = True
    ) -> dict[str, DrafterEstimate]:
        """Per-drafter posteriors for this request: cached until the segment's counts or what else they are made of
        (the priors, quantised from the request's features; the policy's settings; the costs at the request's batch
        bucket and sampling mode) change, since they are the bulk of a decision's work. Without ``remember`` a result
        is not cached (a decision table's: the table is kept itself, and a build must not evict Decide's entries)."""
        version, counts = self.learner.versioned_counts(request.segment)  # together: the key names these counts
        made_of = tuple(
            (d, alpha, proposal, fleet, settings.drafter(d).k_max, settings.drafter(d).cost_ratio)
            for d, alpha, proposal, fleet in self.estimate_inputs(settings, request)
        )
        measured_c = tuple(sorted(costs.cost_ratio.items()))
        named = UNSEEN if counts.empty else request.segment
        key = (named, version, settings.prior_strength, made_of, costs.bucket, costs.step_seconds, measured_c)
        cached = self._estimates.get(key)
        if cached is not None:
            return cached
        n0 = settings.prior_strength
        posteriors = {
            d: self._posteriors_of(named, version, counts, d, k_max, alpha, proposal, n0)
            for d, alpha, proposal, _, k_max, _ in made_of
        }
        lookup = posteriors.get("prompt_lookup")
        lookup_hit = lookup.means()[1][0] if lookup is not None and lookup.proposal else 0.0
        plain = counts.plain_step.get(costs.bucket, {})
        estimates: dict[str, DrafterEstimate] = {}
        for d, _, _, fleet, _, default_c in made_of:
            calibration = component_histogram(counts.calibration, d)
            estimates[d] = replace(
                posteriors[d],
                cost_ratio=drafter_cost(d, costs, default_c, lookup_hit),
                calibration=calibration_factor(median(calibration), total(calibration), toward=fleet),
                realised=realised(counts.realised.get((d, costs.bucket), {}), plain, costs.step_seconds),
                reference_requests=total(plain),
            )
        if remember:
            with self._cache_lock:
                if len(self._estimates) >= self._max_remembered:
                    self._estimates.clear()  # mostly dead keys: versions moved on
                self._estimates[key] = estimates
        return estimates

    def _posteriors_of(
        self, segment: object, version: int, counts: SegmentCounts, drafter: str, k_max: int, alpha: float,
        proposal: float, strength: float,
    ) -> DrafterEstimate:  # fmt: skip
        """The drafter's per-position posteriors in the segment (``estimate_drafter``), which the batch size does not
        move (only the cost ratio, set by the caller, does): kept per version of the segment's counts, so that a
        decision table's buckets (5 a segment, 1,000 segments at a decay step) compute them once, not once each."""
        key = (segment, version, drafter, k_max, alpha, proposal, strength)
        kept = self._posteriors.get(key)
        if kept is None:
            kept = estimate_drafter(counts, drafter, k_max, alpha, proposal, strength, 0.0)
            with self._cache_lock:
                if len(self._posteriors) >= 4 * self._max_remembered:
                    self._posteriors.clear()  # mostly dead keys: versions moved on
                self._posteriors[key] = kept
        return kept

    def estimate_inputs(self, settings: Settings, request: Request) -> tuple[tuple[str, float, float, float], ...]:
        """Each drafter's prior acceptance and proposal rate for this request, and the fleet's calibration factor its
        segment's starts from (all quantised): the prior model's prediction from its features, else the fleet's
        acceptance. Kept per version of the learner (the prior and the fleet's figures move with it): a decision
        table asks for the same features for every segment and bucket."""
        key = (
            self.learner.version, settings.prior_strength, tuple(settings.drafter(d).prior_alpha for d in DRAFTERS),
            request.temperature, request.prompt_tokens, request.self_repetition,
        )  # fmt: skip
        cached = self._inputs.get(key)
        if cached is None:
            cached = self._estimate_inputs(settings, request)
            with self._cache_lock:
                if len(self._inputs) >= self._max_remembered or self._inputs_version != key[0]:
                    self._inputs.clear()  # another version's: never asked for again
                self._inputs[key], self._inputs_version = cached, key[0]
        return cached

    def _estimate_inputs(self, settings: Settings, request: Request) -> tuple[tuple[str, float, float, float], ...]:
        prior = self.learner.prior
        mode = sampling_mode(request.temperature)
        inputs = []
        for d in DRAFTERS:
            s = settings.drafter(d)
            predicted = (
                prior.predict(d, request.temperature, request.prompt_tokens, request.self_repetition) if prior else None
            )
            # Prompt lookup can only propose what the prompt repeats; a draft model or a head always proposes.
            always = runs_draft_model(d) or runs_head(d)
            proposal_prior = 1.0 if always else min(max(request.self_repetition, 0.05), 0.95)
            alpha = predicted or self.fleet_alpha(d, s.prior_alpha, settings.prior_strength, mode)
            fleet = calibration_factor(*self.learner.fleet_calibration(d, mode))
            inputs.append((d, round(alpha, 3), round(proposal_prior, 2), round(fleet, 2)))
        return tuple(inputs)

    def fleet_alpha(self, drafter: str, prior_alpha: float, strength: float, mode: Mode = GREEDY) -> float:
        """The drafter's acceptance over every learning segment of sampling ``mode`` (served and scored rounds, all
        positions), shrunk towards the policy's prior_alpha by ``strength`` pseudo-rounds: where a new segment starts
        when no prior model has been trained yet (hierarchical: the segment's own rounds then move it, as
        estimate_drafter shrinks them)."""
        accepted, verified = self.learner.fleet_acceptance(drafter, mode)
        return (accepted + strength * prior_alpha) / (verified + strength) if verified + strength > 0 else prior_alpha

    def offered(self) -> tuple[str, ...]:
        """The drafters a segment's view decides among: those some worker has offered, in policy order; before any
        worker asked, every drafter that needs no head (a head is offered only by a worker given one)."""
        return tuple(d for d in DRAFTERS if d in self._offered) or tuple(d for d in DRAFTERS if not runs_head(d))

    def decide(self, request: Request) -> Plan:
        self._offered.update(d for d in request.drafters if d in DRAFTERS)
        policy = self.policies.current
        settings = policy.for_segment(request.segment)
        tracked = self.learner.tracked_segment(request.segment)
        if tracked != request.segment:
            request = replace(request, segment=tracked)
        costs = self.learner.costs_at(request.batch_size, request.segment)
        memory = memory_key(request.segment, request.drafters)
        previous = self._previous.recall(memory)
        estimates = self.estimates(settings, request, costs)
        plan = decide(settings, policy.version, request, estimates, costs, previous, self.rng())
        # A segment nothing has been counted for decides from the priors alone: nothing to hold steady yet, and a
        # client naming a new segment per call would otherwise push the learned segments' plans out of the memory
        if not plan.exploration and plan.reason in LEARNED_REASONS and self.learner.counted(request.segment):
            self._previous.remember(memory, plan)
        if self.learner.stale:
            plan = replace(plan, stale=True)
        return plan

    def table_decisions(
        self, request: Request, draws: int, rng: random.Random, remember: bool = False,
        shared: SharedDraws | None = None, pace: Callable[[], None] = no_pause,
    ) -> tuple[Plan, list[tuple[Plan, float]]]:  # fmt: skip
        """For a decision table: the plan Decide gives ``request`` when it does not probe, and the probes it sends
        instead, each with its share of such requests (the share of ``draws`` decisions, drawn with ``rng``, that
        probed it; with ``shared``, the table's draws its buckets share, at least ``draws`` of them). With
        ``remember``, the plan updates the hysteresis memory as a Decide's does (a table remembers its batch-1 plan
        only, so that its other buckets do not move the segment's memory at every refresh). ``pace`` is called
        between draws (a bucket's draws take about a millisecond: Decide gets the interpreter within them)."""
        self._offered.update(d for d in request.drafters if d in DRAFTERS)
        policy = self.policies.current
        settings = policy.for_segment(request.segment)
        costs = self.learner.costs_at(request.batch_size, request.segment)
        estimates = self.estimates(settings, request, costs, remember=False)
        memory = memory_key(request.segment, request.drafters)
        previous = self._previous.recall(memory)
        deliberation = deliberate(settings, policy.version, request, estimates, costs, previous)
        plan = deliberation.exploit
        if remember and plan.reason in LEARNED_REASONS:
            self._previous.remember(memory, plan)
        probes: dict[str, Plan] = {}  # a drafter's probe plan is the same whichever draw chose it
        times: Counter[str] = Counter()
        for index in range(draws if deliberation.may_probe else 0):
            pace()
            drawn = deliberation.draw(rng, None if shared is None else (shared, index))
            if drawn.exploration:
                probes[drawn.drafter] = drawn
                times[drawn.drafter] += 1
        return plan, [(probe, times[drafter] / draws) for drafter, probe in probes.items()]

    def previous_plan(self, segment: str, drafters: Sequence[str]) -> Plan | None:
        """The segment's last learned plan among ``drafters`` (the hysteresis memory)."""
        return self._previous.recall(memory_key(segment, drafters))

    def new_drift_alarms(self, segment: str) -> list[DriftAlarm]:
        """The segment's drift alarms not yet announced on a Decide span (each is announced once)."""
        fresh = []
        for alarm in self.learner.drift(segment):
            key = f"{alarm.segment}|{alarm.drafter}|{alarm.since_unix}"
            if self._drift_announced.recall(key) is None:
                self._drift_announced.remember(key, True)
                fresh.append(alarm)
        return fresh

    def segment_view(self, segment: str, max_new_tokens: int = 0, prompt_tokens: int = 0) -> SegmentView:
        """What GetSegmentStats shows of the learning segment ``segment`` (the overflow segment's past the cap): its
        counts, estimates, costs at batch 1, the decision Decide would make now for a request of ``max_new_tokens``
        (0: TYPICAL_MAX_NEW_TOKENS) after a prompt of ``prompt_tokens`` from a worker offering ``offered()``, and its
        drift alarms."""
        segment = self.learner.tracked_segment(segment)
        counts = self.learner.segment_counts(segment)
        request = replace(
            Request.neutral(segment, 1, self.offered(), max_new_tokens or TYPICAL_MAX_NEW_TOKENS),
            prompt_tokens=prompt_tokens,
        )
        settings = self.policies.current.for_segment(segment)
        costs = self.learner.costs_at(1, segment)
        estimates = self.estimates(settings, request, costs)
        decision = self.decide_quietly(request, settings, estimates, costs)
        arms: dict[str, Arm] = {
            d: mean_arm(estimates[d], s.k_min, min(s.k_max, request.max_new_tokens - 1), costs)
            for d in request.drafters
            if d in estimates and (s := settings.drafter(d)).enabled and s.k_min <= request.max_new_tokens - 1
        }
        return SegmentView(segment, counts, estimates, costs, decision, arms, self.learner.drift(segment),
                           self.learner.stale)  # fmt: skip

    def decide_quietly(
        self, request: Request, settings: Settings, estimates: dict[str, DrafterEstimate], costs: BucketCosts
    ) -> Plan:
        """What Decide would answer now, without exploring or touching the hysteresis state."""
        previous = self._previous.recall(memory_key(request.segment, request.drafters))
        exploit = settings.model_copy(update={"exploration_rate": 0.0})
        plan = decide(exploit, self.policies.current.version, request, estimates, costs, previous, self.rng())
        return replace(plan, stale=self.learner.stale)
