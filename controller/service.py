"""The gRPC service: validates requests, asks the learner and the policy, and traces every call."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter as PrometheusCounter

from controller.decision.core import Controller
from controller.decision.learner import ReportOutcome
from controller.pacing import URGENT
from controller.serving import validation
from controller.serving.report_budget import ReportBudget, peer_host
from controller.serving.report_head import METHOD, ReceivedReport
from controller.serving.report_process import Held, Invalid, ReportProcess, report_steps
from controller.serving.table_publisher import DecisionPublisher, TooManyWatchers
from controller.serving.unparsable import undecodable
from controller.serving.views import cost_model, segment_stats
from controller.storage.journal import JournalFull
from specd_api.checks import MAX_AGGREGATES, REPORT_HELD, count
from specd_api.modes import validate_learning_segment
from specd_api.spans import plan_attributes
from specd_api.tracing import context_from_metadata
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError

log = logging.getLogger(__name__)


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
        """``request`` is the report's bytes and its head (serving/report_head.py: the daemon's server reads it so):
        the report process parses the rest, or the daemon does when the report stays with it. A server that
        registers this servicer without that deserializer hands it the whole message, taken here as if it came so."""
        if isinstance(request, pb.ReportRoundsRequest):
            request = ReceivedReport.of(request)
        with self._span("ReportRounds", context) as span:
            holder = (peer_host(context.peer()), request.head.report_id)
            if self.reports is None or not self.reports.holds(holder):  # a retry of a held report adds no work
                self._charge_budget([a.segment for a in request.head.aggregates], span, context)
            stored = self._in_report_process(request, holder, span, context)
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
        self, request: ReceivedReport, holder: tuple[str, str], span: trace.Span, context: grpc.ServicerContext
    ) -> tuple[str, ReportOutcome] | None:
        """The report validated and stored by the report process (serving/report_process.py), or None when the
        daemon must do it: there is none (or it is not ready), the journal holds a backlog the report queues
        behind, Redis is known to be down (stale), the report is over the size bound, or the child did not store it
        (``ReportProcess.ingest``: it died, or Redis failed there). A report it finds invalid is refused here; one
        it holds past its answer time is answered UNAVAILABLE, and the retry waits on the same work."""
        learner = self.controller.learner
        if self.reports is None or not self.reports.ready or len(learner.journal) or learner.stale:
            return None  # (stale: Redis did not answer the last refresh; the daemon journals the report at once)
        if len(request.head.aggregates) > MAX_AGGREGATES:
            return None  # refused at once by the daemon's validation, before any lookup per aggregate
        answer = self.reports.ingest(request.data, report_steps(request.head, learner.step_seconds), holder)
        if isinstance(answer, Invalid):
            self._invalid(span, context, ValueError(answer.reason))
        if isinstance(answer, Held):
            message = ("the report is queued in the report process, behind other work: retry it (the same report id "
                       "waits on the same work and is counted once)")  # fmt: skip
            span.set_status(Status(StatusCode.ERROR, message))
            context.set_trailing_metadata(((REPORT_HELD, "1"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, message)
            raise AssertionError("abort returned")  # it raises
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

    def _charge_budget(self, segments: list[str], span: trace.Span, context: grpc.ServicerContext) -> None:
        """Spend the report's cost (its aggregates, by ``segments``, and the segments they touch) from its client
        host's budget, or refuse it with RESOURCE_EXHAUSTED before any of its work (serving/report_budget.py). A
        report past the size bound is not charged: validation refuses it with INVALID_ARGUMENT."""
        if self.budget is None or len(segments) > MAX_AGGREGATES:
            return
        cost = self.budget.cost_of(segments)
        over = self.budget.charge(peer_host(context.peer()), cost)
        if over is None:
            return
        self._over_budget.inc()
        self._aggregates_over_budget.inc(len(segments))
        message = (
            f"report budget spent: client host {over.peer} may report {self.budget.rate:g} aggregates a second "
            f"(bursts of {self.budget.burst:g}); this report's {cost} ({len(segments)} aggregates over "
            f"{len(set(segments))} segments) fit in {over.retry_after_seconds:.2f} s: retry it then (nothing of it "
            "was stored)"
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
