"""The gRPC service: validates requests, asks the learner and the policy, and traces every call."""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter as PrometheusCounter

from controller import validation
from controller.cost_model import BucketCosts
from controller.counts import SegmentCounts
from controller.decide import (
    Arm,
    DrafterEstimate,
    Request,
    calibration_factor,
    component_histogram,
    decide,
    deliberate,
    drafter_cost,
    estimate_drafter,
    mean_arm,
)
from controller.decoding import undecodable
from controller.drift_watch import DriftAlarm
from controller.journal import JournalFull
from controller.learner import Learner, ReportOutcome
from controller.pacing import URGENT
from controller.policy import DRAFTERS, PolicyStore, Settings
from controller.realised import realised
from controller.report_budget import ReportBudget, peer_host
from controller.report_head import METHOD, ReceivedReport
from controller.report_process import Invalid, ReportProcess, report_steps
from controller.table_publisher import DecisionPublisher, TooManyWatchers
from controller.timing_histogram import median, total
from controller.views import SegmentView, cost_model, segment_stats
from specd_api.checks import MAX_AGGREGATES, count
from specd_api.lru import LruMemory
from specd_api.modes import validate_learning_segment
from specd_api.plan import Plan
from specd_api.spans import plan_attributes
from specd_api.speedup import runs_draft_model
from specd_api.tracing import context_from_metadata
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError

log = logging.getLogger(__name__)

TYPICAL_MAX_NEW_TOKENS = 128  # the request that GetSegmentStats's "decision now" is made for
# What the caches key a segment with no counts by: every such segment's estimates are the same (the priors' alone), so
# a client naming a new segment in each Decide shares one entry instead of filling the caches with its names and
# evicting the learned segments' entries (issue 22: 6.5x the work of a learned segment's Decide, and the others' too).
UNSEEN: object = ("unseen segment",)
# Plans made from the statistics (not from a rule): the ones hysteresis remembers.
LEARNED_REASONS = ("best_expected_speedup", "kept_previous", "low_expected_speedup")


class Controller:
    """Decisions and statistics, independent of gRPC (the benchmark calls it in-process)."""

    def __init__(self, learner: Learner, policies: PolicyStore, max_remembered: int = 10_000) -> None:
        self.learner = learner
        self.policies = policies
        self._previous: LruMemory[Plan] = LruMemory(max_remembered)  # last learned (non-probe) plan per segment
        self._cache_lock = threading.Lock()
        self._max_remembered = max_remembered
        self._rng = threading.local()
        self._estimates: dict[tuple[object, ...], dict[str, DrafterEstimate]] = {}
        self._posteriors: dict[tuple[object, ...], DrafterEstimate] = {}  # _posteriors_of's
        self._inputs: dict[tuple[object, ...], tuple[tuple[str, float, float, float], ...]] = {}
        self._inputs_version: object = None  # the learner's version the kept inputs were made at
        self._drift_announced: LruMemory[bool] = LruMemory(max_remembered)  # alarms already put on a Decide span

    def rng(self) -> random.Random:
        if not hasattr(self._rng, "value"):
            self._rng.value = random.Random()
        return self._rng.value

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
        inputs = []
        for d in DRAFTERS:
            s = settings.drafter(d)
            predicted = (
                prior.predict(d, request.temperature, request.prompt_tokens, request.self_repetition) if prior else None
            )
            # Prompt lookup can only propose what the prompt repeats; a draft model always proposes.
            proposal_prior = 1.0 if runs_draft_model(d) else min(max(request.self_repetition, 0.05), 0.95)
            alpha = predicted or self.fleet_alpha(d, s.prior_alpha, settings.prior_strength)
            fleet = calibration_factor(*self.learner.fleet_calibration(d))
            inputs.append((d, round(alpha, 3), round(proposal_prior, 2), round(fleet, 2)))
        return tuple(inputs)

    def fleet_alpha(self, drafter: str, prior_alpha: float, strength: float) -> float:
        """The drafter's acceptance over every segment (served and scored rounds, all positions), shrunk towards the
        policy's prior_alpha by ``strength`` pseudo-rounds: where a new segment starts when no prior model has
        been trained yet (hierarchical: the segment's own rounds then move it, as estimate_drafter shrinks them)."""
        accepted, verified = self.learner.fleet_acceptance(drafter)
        return (accepted + strength * prior_alpha) / (verified + strength) if verified + strength > 0 else prior_alpha

    def decide(self, request: Request) -> Plan:
        policy = self.policies.current
        settings = policy.for_segment(request.segment)
        tracked = self.learner.tracked_segment(request.segment)
        if tracked != request.segment:
            request = replace(request, segment=tracked)
        costs = self.learner.costs_at(request.batch_size, request.segment)
        previous = self._previous.recall(request.segment)
        estimates = self.estimates(settings, request, costs)
        plan = decide(settings, policy.version, request, estimates, costs, previous, self.rng())
        # A segment nothing has been counted for decides from the priors alone: nothing to hold steady yet, and a
        # client naming a new segment per call would otherwise push the learned segments' plans out of the memory
        if not plan.exploration and plan.reason in LEARNED_REASONS and self.learner.counted(request.segment):
            self._previous.remember(request.segment, plan)
        if self.learner.stale:
            plan = replace(plan, stale=True)
        return plan

    def table_decisions(
        self, request: Request, draws: int, rng: random.Random, remember: bool = False
    ) -> tuple[Plan, list[tuple[Plan, float]]]:
        """For a decision table: the plan Decide gives ``request`` when it does not probe, and the probes it sends
        instead, each with its share of such requests (the share of ``draws`` decisions, drawn with ``rng``, that
        probed it). With ``remember``, the plan updates the hysteresis memory as a Decide's does (a table remembers
        its batch-1 plan only, so that its other buckets do not move the segment's memory at every refresh)."""
        policy = self.policies.current
        settings = policy.for_segment(request.segment)
        costs = self.learner.costs_at(request.batch_size, request.segment)
        estimates = self.estimates(settings, request, costs, remember=False)
        previous = self._previous.recall(request.segment)
        deliberation = deliberate(settings, policy.version, request, estimates, costs, previous)
        plan = deliberation.exploit
        if remember and plan.reason in LEARNED_REASONS:
            self._previous.remember(request.segment, plan)
        probes: dict[str, Plan] = {}  # a drafter's probe plan is the same whichever draw chose it
        times: Counter[str] = Counter()
        for _ in range(draws if deliberation.may_probe else 0):
            drawn = deliberation.draw(rng)
            if drawn.exploration:
                probes[drawn.drafter] = drawn
                times[drawn.drafter] += 1
        return plan, [(probe, times[drafter] / draws) for drafter, probe in probes.items()]

    def previous_plan(self, segment: str) -> Plan | None:
        """The segment's last learned plan (the hysteresis memory)."""
        return self._previous.recall(segment)

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
        (0: TYPICAL_MAX_NEW_TOKENS) after a prompt of ``prompt_tokens``, and its drift alarms."""
        segment = self.learner.tracked_segment(segment)
        counts = self.learner.segment_counts(segment)
        request = replace(
            Request.neutral(segment, 1, DRAFTERS, max_new_tokens or TYPICAL_MAX_NEW_TOKENS), prompt_tokens=prompt_tokens
        )
        settings = self.policies.current.for_segment(segment)
        costs = self.learner.costs_at(1, segment)
        estimates = self.estimates(settings, request, costs)
        decision = self.decide_quietly(request, settings, estimates, costs)
        arms: dict[str, Arm] = {
            d: mean_arm(estimates[d], s.k_min, min(s.k_max, request.max_new_tokens - 1), costs)
            for d in DRAFTERS
            if d in estimates and (s := settings.drafter(d)).enabled and s.k_min <= request.max_new_tokens - 1
        }
        return SegmentView(segment, counts, estimates, costs, decision, arms, self.learner.drift(segment),
                           self.learner.stale)  # fmt: skip

    def decide_quietly(
        self, request: Request, settings: Settings, estimates: dict[str, DrafterEstimate], costs: BucketCosts
    ) -> Plan:
        """What Decide would answer now, without exploring or touching the hysteresis state."""
        previous = self._previous.recall(request.segment)
        exploit = settings.model_copy(update={"exploration_rate": 0.0})
        plan = decide(exploit, self.policies.current.version, request, estimates, costs, previous, self.rng())
        return replace(plan, stale=self.learner.stale)


class ControllerServicer(pb_grpc.ControllerServicer):
    """gRPC glue: validation errors become INVALID_ARGUMENT; every RPC is a span joined to the caller's trace."""

    def __init__(
        self,
        controller: Controller,
        tracer: trace.Tracer,
        publisher: DecisionPublisher | None = None,
        budget: ReportBudget | None = None,
        reports: ReportProcess | None = None,
    ) -> None:
        self.controller = controller
        self.reports = reports  # validates and stores reports in a child process; None: the daemon does
        self.tracer = tracer
        self.publisher = publisher  # None: WatchDecisions is not served (UNIMPLEMENTED)
        self.budget = budget  # each client host's budget of report work; None: none
        if budget is not None:
            registry = controller.learner.registry
            self._over_budget = PrometheusCounter(
                "specd_controller_reports_over_budget", "ReportRounds refused with RESOURCE_EXHAUSTED because the "
                "client host's report budget (learning.report_aggregates_per_second_per_peer) was spent",
                registry=registry,
            )  # fmt: skip
            self._aggregates_over_budget = PrometheusCounter(
                "specd_controller_report_aggregates_over_budget", "aggregates in the reports refused over budget",
                registry=registry,
            )  # fmt: skip

    @contextmanager
    def _span(self, name: str, context: grpc.ServicerContext) -> Iterator[trace.Span]:
        parent = context_from_metadata(context.invocation_metadata())
        with self.tracer.start_as_current_span(
            f"specd.v1.Controller/{name}", context=parent, kind=SpanKind.SERVER
        ) as span:
            yield span

    def _invalid(self, span: trace.Span, context: grpc.ServicerContext, error: Exception) -> NoReturn:
        span.set_status(Status(StatusCode.ERROR, str(error)))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("abort returned")  # it raises

    def Decide(self, request: pb.DecideRequest, context: grpc.ServicerContext) -> pb.Decision:
        with URGENT.serving(), self._span("Decide", context) as span:  # reports, refreshes and builds wait for it
            try:
                req = validation.request_from_proto(request)
            except ValueError as e:
                span.set_attribute("specd.segment", request.segment[:128])
                self._invalid(span, context, e)
            plan = self.controller.decide(req)
            span.set_attributes(plan_attributes(plan))
            span.set_attribute("specd.batch_size", req.batch_size)
            for alarm in self.controller.new_drift_alarms(plan.segment):
                span.add_event(
                    "specd.alpha_drift",
                    {"specd.drafter": alarm.drafter, "specd.drift.direction": alarm.direction,
                     "specd.drift.since_unix": alarm.since_unix, "specd.drift.alpha_before": alarm.alpha_before,
                     "specd.drift.alpha_since": alarm.alpha_since},
                )  # fmt: skip
            return plan.to_proto()

    def WatchDecisions(
        self, request: pb.WatchDecisionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DecisionTables | bytes]:
        """The stream's messages (``table_publisher.Watch``: its heartbeats are made on the serving loop, by
        ``grpc_server.stream_in_pool``; a shared change message goes as its bytes, ``grpc_server.passing_bytes``)."""
        with self._span("WatchDecisions", context) as span:
            try:
                drafters = validation.watched_drafters(request)
            except ValueError as e:
                self._invalid(span, context, e)
            span.set_attributes({"specd.worker_id": request.worker_id, "specd.drafters": list(drafters)})
            publisher = self.publisher
            if publisher is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "this controller does not serve WatchDecisions")
                raise AssertionError("abort returned")  # it raises
            try:
                watch = publisher.watch(drafters, context.is_active, wire=True, host=peer_host(context.peer()))
            except TooManyWatchers as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            context.add_callback(publisher.wake)  # a stream the worker closed ends now, not at the next refresh
            return watch

    def ReportRounds(
        self, request: ReceivedReport | pb.ReportRoundsRequest, context: grpc.ServicerContext
    ) -> pb.ReportRoundsResponse:
        """``request`` is the report's bytes and its head (controller/report_head.py: the daemon's server reads it so):
        the report process parses the rest, or the daemon does when the report stays with it. A server that
        registers this servicer without that deserializer hands it the whole message, taken here as if it came so."""
        if isinstance(request, pb.ReportRoundsRequest):
            request = ReceivedReport.of(request)
        with self._span("ReportRounds", context) as span:
            self._charge_budget(len(request.head.aggregates), span, context)
            stored = self._in_report_process(request, span, context)
            if stored is not None:
                report_id, outcome = stored
            else:
                report_id, outcome = self._in_daemon(request, span, context)
            span.set_attributes(
                {
                    "specd.report_id": report_id,
                    "specd.rounds": outcome.rounds,
                    "specd.duplicate": outcome.duplicate,
                    "specd.journaled": outcome.journaled,
                    "specd.report_process": stored is not None,
                }
            )
            return pb.ReportRoundsResponse(
                rounds_accepted=outcome.rounds, duplicate=outcome.duplicate, journaled=outcome.journaled
            )

    def _in_report_process(
        self, request: ReceivedReport, span: trace.Span, context: grpc.ServicerContext
    ) -> tuple[str, ReportOutcome] | None:
        """The report validated and stored by the report process (controller/report_process.py), or None when the
        daemon must do it: there is none (or it is not ready), the journal holds a backlog the report queues
        behind, Redis is known to be down (stale), the report is over the size bound, or the child did not store it
        (``ReportProcess.ingest``: it died, answered late, or Redis failed there). A report it finds invalid is
        refused here."""
        learner = self.controller.learner
        if self.reports is None or not self.reports.ready or len(learner.journal) or learner.stale:
            return None  # (stale: Redis did not answer the last refresh; the daemon journals the report at once)
        if len(request.head.aggregates) > MAX_AGGREGATES:
            return None  # refused at once by the daemon's validation, before any lookup per aggregate
        answer = self.reports.ingest(request.data, report_steps(request.head, learner.step_seconds))
        if isinstance(answer, Invalid):
            self._invalid(span, context, ValueError(answer.reason))
        if answer is None:
            return None
        return answer.report_id, ReportOutcome(answer.rounds, answer.duplicate, journaled=False)

    def _in_daemon(
        self, request: ReceivedReport, span: trace.Span, context: grpc.ServicerContext
    ) -> tuple[str, ReportOutcome]:
        try:
            report_id, aggregates = validation.report(request.message())
        except DecodeError as e:  # its head parsed (on the loop), the rest does not
            self._invalid(span, context, ValueError(undecodable(METHOD, e)))
        except ValueError as e:
            self._invalid(span, context, e)
        try:
            return report_id, self.controller.learner.report(report_id, aggregates)
        except JournalFull as e:  # Redis is down and the journal is at its bound: not acknowledged, so the
            # worker's client keeps the report and retries it (same id) with backoff; nothing is dropped here
            span.set_status(Status(StatusCode.ERROR, str(e)))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"telemetry not stored, retry later: {e}")
            raise AssertionError("abort returned") from None  # it raises

    def _charge_budget(self, cost: int, span: trace.Span, context: grpc.ServicerContext) -> None:
        """Spend the report's ``cost`` (its aggregates) from its client host's budget, or refuse it with
        RESOURCE_EXHAUSTED before any of its work (controller/report_budget.py). A report past the size bound is not
        charged: validation refuses it with INVALID_ARGUMENT."""
        if self.budget is None or cost > MAX_AGGREGATES:
            return
        over = self.budget.charge(peer_host(context.peer()), cost)
        if over is None:
            return
        self._over_budget.inc()
        self._aggregates_over_budget.inc(cost)
        message = (
            f"report budget spent: client host {over.peer} may report {self.budget.rate:g} aggregates a second "
            f"(bursts of {self.budget.burst:g}); this report's {cost} fit in {over.retry_after_seconds:.2f} s: retry "
            "it then (nothing of it was stored)"
        )
        if over.log:
            log.warning("%s (logged at most once a minute per client host)", message)
        span.set_status(Status(StatusCode.ERROR, message))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def GetSegmentStats(self, request: pb.GetSegmentStatsRequest, context: grpc.ServicerContext) -> pb.SegmentStats:
        with self._span("GetSegmentStats", context) as span:
            try:
                segment = validate_learning_segment(request.segment)
            except ValueError as e:
                self._invalid(span, context, e)
            span.set_attribute("specd.segment", segment)
            try:
                count("max_new_tokens", request.max_new_tokens)
                count("prompt_tokens", request.prompt_tokens)
            except ValueError as e:
                self._invalid(span, context, e)
            view = self.controller.segment_view(segment, request.max_new_tokens, request.prompt_tokens)
            return segment_stats(view)

    def ListSegments(self, request: pb.ListSegmentsRequest, context: grpc.ServicerContext) -> pb.ListSegmentsResponse:
        with self._span("ListSegments", context):
            return pb.ListSegmentsResponse(
                segments=[segment_stats(self.controller.segment_view(s)) for s in self.controller.learner.segments()]
            )

    def GetPolicy(self, request: pb.GetPolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        with self._span("GetPolicy", context) as span:
            policy = self.controller.policies.current
            span.set_attribute("specd.policy_version", policy.version)
            return policy_info(policy)

    def GetCosts(self, request: pb.GetCostsRequest, context: grpc.ServicerContext) -> pb.CostModel:
        with self._span("GetCosts", context):
            return cost_model(self.controller.learner.cost_model, self.controller.learner.stale)

    def ReloadPolicy(self, request: pb.ReloadPolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        with self._span("ReloadPolicy", context) as span:
            try:
                policy = self.controller.policies.reload()
            except ConfigError as e:
                self._invalid(span, context, e)
            span.set_attribute("specd.policy_version", policy.version)
            return policy_info(policy)


def policy_info(policy: Any) -> pb.PolicyInfo:
    return pb.PolicyInfo(version=policy.version, path=policy.path, text=policy.text, loaded_unix=policy.loaded_unix)
