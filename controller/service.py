"""The gRPC service: validates requests, asks the learner and the policy, and traces every call."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from controller import validation
from controller.counts import SegmentCounts
from controller.decide import Decision, DrafterEstimate, Request, decide, estimate_drafter
from controller.journal import JournalFull
from controller.learner import Learner
from controller.policy import DRAFTERS, PolicyStore, Settings
from controller.speedup import speedup_curve, wilson_interval
from controller.tracing import context_from_metadata
from controller.yaml_config import ConfigError
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc

TYPICAL_MAX_NEW_TOKENS = 128
# Decisions made from the statistics (not from a rule): the ones hysteresis remembers.
LEARNED_REASONS = (
    "best_expected_speedup",
    "kept_previous",
    "low_expected_speedup",
    "alpha_below_floor",
)  # the request that GetSegmentStats's "decision now" is made for


class Controller:
    """Decisions and statistics, independent of gRPC (the benchmark calls it in-process)."""

    def __init__(self, learner: Learner, policies: PolicyStore, max_remembered: int = 10_000) -> None:
        self.learner = learner
        self.policies = policies
        self._previous: OrderedDict[str, Decision] = OrderedDict()  # last non-exploration decision
        self._previous_lock = threading.Lock()
        self._max_remembered = max_remembered
        self._rng = threading.local()
        self._estimates: dict[tuple[object, ...], dict[str, DrafterEstimate]] = {}

    def rng(self) -> random.Random:
        if not hasattr(self._rng, "value"):
            self._rng.value = random.Random()
        return self._rng.value

    def estimates(self, settings: Settings, counts: SegmentCounts, request: Request) -> dict[str, DrafterEstimate]:
        """Per-drafter posteriors for this request: cached until the learner, the policy or the prior
        (request features, quantised) change, since they are the bulk of a decision's work."""
        prior = self.learner.prior
        inputs = []
        for d in DRAFTERS:
            s = settings.drafter(d)
            predicted = (
                prior.predict(d, request.temperature, request.prompt_tokens, request.self_repetition) if prior else None
            )
            # Prompt lookup can only propose what the prompt repeats; a draft model always proposes.
            proposal_prior = 1.0 if d == "draft" else min(max(request.self_repetition, 0.05), 0.95)
            inputs.append((d, round(predicted or s.prior_alpha, 3), round(proposal_prior, 2)))
        key = (request.segment, self.learner.version, self.policies.current.version, tuple(inputs))
        cached = self._estimates.get(key)
        if cached is not None:
            return cached
        model = self.learner.cost_model
        estimates: dict[str, DrafterEstimate] = {
            d: estimate_drafter(
                counts, d, settings.drafter(d).k_max, alpha, proposal, settings.prior_strength,
                model.c(d, settings.drafter(d).cost_ratio),
            )
            for d, alpha, proposal in inputs
        }  # fmt: skip
        with self._previous_lock:
            if len(self._estimates) >= self._max_remembered:
                self._estimates.clear()  # versions moved on; old keys are dead anyway
            self._estimates[key] = estimates
        return estimates

    def decide(self, request: Request) -> Decision:
        policy = self.policies.current
        settings = policy.for_segment(request.segment)
        tracked = self.learner.tracked_segment(request.segment)
        if tracked != request.segment:
            request = replace(request, segment=tracked)
        counts = self.learner.segment_counts(request.segment)
        with self._previous_lock:
            previous = self._previous.get(request.segment)
        decision = decide(
            settings,
            policy.version,
            request,
            self.estimates(settings, counts, request),
            self.learner.cost_model.verify(request.batch_size),
            previous,
            self.rng(),
        )
        if not decision.exploration and decision.reason in LEARNED_REASONS:
            self._remember(request.segment, decision)
        if self.learner.stale:
            decision = replace(decision, stale=True)
        return decision

    def _remember(self, segment: str, decision: Decision) -> None:
        with self._previous_lock:
            self._previous[segment] = decision
            self._previous.move_to_end(segment)
            while len(self._previous) > self._max_remembered:
                self._previous.popitem(last=False)

    def segment_stats(self, segment: str) -> pb.SegmentStats:
        segment = self.learner.tracked_segment(segment)  # over the cap: the overflow segment's statistics
        counts = self.learner.segment_counts(segment)
        request = Request(segment, 1, DRAFTERS, TYPICAL_MAX_NEW_TOKENS)
        settings = self.policies.current.for_segment(segment)
        estimates = self.estimates(settings, counts, request)
        verify = self.learner.cost_model.verify(1)
        msg = pb.SegmentStats(
            segment=segment, rounds=counts.rounds, last_update_unix=counts.last_update, stale=self.learner.stale
        )
        for d in sorted(set(counts.drafters()) | set(DRAFTERS)):
            drafter = msg.drafters.add(drafter=d)
            if d in estimates:
                drafter.cost_ratio = estimates[d].cost_ratio
                conditional, proposal = estimates[d].means()
                curve = speedup_curve(conditional, proposal, len(conditional), estimates[d].cost_ratio, verify)
            for i, pos in enumerate(counts.position_list(d)):
                drafter.positions.add(
                    position=i,
                    offered=pos.offered,
                    proposed=pos.proposed,
                    verified=pos.verified,
                    accepted=pos.accepted,
                    conditional_alpha=pos.accepted / pos.verified if pos.verified else 0.0,
                    alpha=pos.accepted / pos.offered if pos.offered else 0.0,
                )
            for (name, k), kc in sorted(counts.by_k.items()):
                if name != d:
                    continue
                low, high = wilson_interval(kc.accepted, kc.proposed)
                drafter.by_k.add(
                    drafter=d,
                    num_draft_tokens=k,
                    rounds=kc.rounds,
                    proposed=kc.proposed,
                    accepted=kc.accepted,
                    alpha=kc.accepted / kc.proposed if kc.proposed else 0.0,
                    alpha_ci_low=low,
                    alpha_ci_high=high,
                    mean_accepted_length=(kc.accepted + kc.rounds) / kc.rounds if kc.rounds else 0.0,
                    expected_speedup=curve[k - 1] if d in estimates and 0 < k <= len(curve) else 1.0,
                )
        msg.decision.CopyFrom(decision_to_proto(self.decide_quietly(request, settings, counts, estimates)))
        return msg

    def decide_quietly(
        self, request: Request, settings: Settings, counts: SegmentCounts, estimates: dict[str, DrafterEstimate]
    ) -> Decision:
        """What Decide would answer now, without exploring or touching the hysteresis state."""
        with self._previous_lock:
            previous = self._previous.get(request.segment)
        exploit = settings.model_copy(update={"exploration_rate": 0.0})
        decision = decide(
            exploit,
            self.policies.current.version,
            request,
            estimates,
            self.learner.cost_model.verify(1),
            previous,
            self.rng(),
        )
        return replace(decision, stale=self.learner.stale)


def decision_to_proto(d: Decision) -> pb.Decision:
    return pb.Decision(
        drafter=d.drafter,
        num_draft_tokens=d.num_draft_tokens,
        reason=d.reason,
        policy_version=d.policy_version,
        exploration=d.exploration,
        expected_speedup=d.expected_speedup,
        stale=d.stale,
        segment=d.segment,
    )


def decision_attributes(d: Decision) -> dict[str, Any]:
    return {
        "specd.segment": d.segment,
        "specd.drafter": d.drafter,
        "specd.num_draft_tokens": d.num_draft_tokens,
        "specd.reason": d.reason,
        "specd.policy_version": d.policy_version,
        "specd.exploration": d.exploration,
        "specd.expected_speedup": d.expected_speedup,
        "specd.stale": d.stale,
    }


class ControllerServicer(pb_grpc.ControllerServicer):
    """gRPC glue: validation errors become INVALID_ARGUMENT; every RPC is a span joined to the caller's trace."""

    def __init__(self, controller: Controller, tracer: trace.Tracer) -> None:
        self.controller = controller
        self.tracer = tracer

    @contextmanager
    def _span(self, name: str, context: grpc.ServicerContext) -> Iterator[trace.Span]:
        parent = context_from_metadata(context.invocation_metadata())
        with self.tracer.start_as_current_span(
            f"specd.v1.Controller/{name}", context=parent, kind=SpanKind.SERVER
        ) as span:
            yield span

    def _invalid(self, span: trace.Span, context: grpc.ServicerContext, error: Exception) -> None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def Decide(self, request: pb.DecideRequest, context: grpc.ServicerContext) -> pb.Decision:
        with self._span("Decide", context) as span:
            try:
                req = validation.decide_request(request)
            except ValueError as e:
                span.set_attribute("specd.segment", request.segment[:128])
                self._invalid(span, context, e)
            decision = self.controller.decide(req)
            span.set_attributes(decision_attributes(decision))
            span.set_attribute("specd.batch_size", req.batch_size)
            return decision_to_proto(decision)

    def ReportRounds(self, request: pb.ReportRoundsRequest, context: grpc.ServicerContext) -> pb.ReportRoundsResponse:
        with self._span("ReportRounds", context) as span:
            try:
                report_id, aggregates = validation.report(request)
            except ValueError as e:
                self._invalid(span, context, e)
            try:
                outcome = self.controller.learner.report(report_id, aggregates)
            except JournalFull as e:
                span.set_status(Status(StatusCode.ERROR, str(e)))
                context.abort(grpc.StatusCode.UNAVAILABLE, f"telemetry not stored, retry later: {e}")
            span.set_attributes(
                {
                    "specd.report_id": report_id,
                    "specd.rounds": outcome.rounds,
                    "specd.duplicate": outcome.duplicate,
                    "specd.journaled": outcome.journaled,
                }
            )
            return pb.ReportRoundsResponse(
                rounds_accepted=outcome.rounds, duplicate=outcome.duplicate, journaled=outcome.journaled
            )

    def GetSegmentStats(self, request: pb.GetSegmentStatsRequest, context: grpc.ServicerContext) -> pb.SegmentStats:
        with self._span("GetSegmentStats", context) as span:
            try:
                segment = validation.validate_segment(request.segment)
            except ValueError as e:
                self._invalid(span, context, e)
            span.set_attribute("specd.segment", segment)
            return self.controller.segment_stats(segment)

    def ListSegments(self, request: pb.ListSegmentsRequest, context: grpc.ServicerContext) -> pb.ListSegmentsResponse:
        with self._span("ListSegments", context):
            return pb.ListSegmentsResponse(
                segments=[self.controller.segment_stats(s) for s in self.controller.learner.segments()]
            )

    def GetPolicy(self, request: pb.GetPolicyRequest, context: grpc.ServicerContext) -> pb.PolicyInfo:
        with self._span("GetPolicy", context) as span:
            policy = self.controller.policies.current
            span.set_attribute("specd.policy_version", policy.version)
            return policy_info(policy)

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
