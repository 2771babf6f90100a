"""The worker's core, independent of HTTP: models, the scheduler, the controller client, metrics and traces.

``WorkerService.run_request`` takes a parsed request through the whole path: segment, decision (the
controller within its deadline, else a fallback), queue, prefill, decode, report, metrics and spans, and
yields events as tokens arrive. The HTTP layer (decoder.worker.app) only translates.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from controller.client import ClientConfig, ControllerClient, DecisionOutcome, self_repetition
from controller.tracing import make_exporter, make_provider, no_tracer
from decoder.batch_engine import BatchEngine
from decoder.drafters import PromptLookupConfig
from decoder.engine import GenerationResult
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.sampling import SamplingParams
from decoder.stopping import StopRules
from decoder.worker.config import WorkerConfig
from decoder.worker.metrics import WorkerMetrics
from decoder.worker.scheduler import Job, JobOutcome, QueueFull, Scheduler, ShuttingDown, StepObservation
from decoder.worker.segments import classify_prompt
from decoder.worker.text_stream import TextStream

__all__ = ["QueueFull", "RequestSpec", "ShuttingDown", "WorkerService"]


@dataclass(frozen=True)
class RequestSpec:
    """A request as the HTTP layer parsed it."""

    prompt_text: str | None  # None when the client sent token ids
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_strings: tuple[str, ...]
    segment: str | None  # as named by the caller (body or header); None: infer
    trace_context: Context | None = None


@dataclass
class Event:
    kind: str  # "text" | "done" | "error"
    text: str = ""
    finish_reason: str | None = None
    status: int = 200
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    specd: dict[str, Any] = field(default_factory=dict)


def local_decision(cfg: WorkerConfig, batch_size: int) -> DecisionOutcome:
    """The decision when no controller is configured."""
    speculate = batch_size <= cfg.speculation_max_batch
    return DecisionOutcome(
        drafter=cfg.controller.default_drafter if speculate else "none",
        num_draft_tokens=cfg.controller.default_num_draft_tokens if speculate else 0,
        reason="local_default",
        policy_version="",
        exploration=False,
        expected_speedup=1.0,
        stale=False,
        fallback=None,
        source="local_default",
        latency_s=0.0,
    )


class WorkerService:
    def __init__(self, config: WorkerConfig) -> None:
        self.cfg = config
        self.metrics = WorkerMetrics()
        self.engine: BatchEngine | None = None
        self.scheduler: Scheduler | None = None
        self.client: ControllerClient | None = None
        self.tracer: trace.Tracer = no_tracer()
        self._provider: Any = None
        self.started_unix = time.time()
        self.draining = False

    # -- lifecycle -----------------------------------------------------------------------------------------

    def startup(self, worker_id: str | None = None) -> None:
        """Load the models, start the decode thread, connect to the controller, set up tracing."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device, dtype = resolve_device(cfg.device), parse_dtype(cfg.dtype)
        target = load_model(cfg.target, device, dtype)
        draft = load_model(cfg.draft, device, dtype) if cfg.draft is not None else None
        lookup = PromptLookupConfig(cfg.prompt_lookup.min_ngram, cfg.prompt_lookup.max_ngram)
        self.engine = BatchEngine(target, draft, lookup, max_batch=cfg.max_batch)
        self.scheduler = Scheduler(self.engine, cfg.max_queue, cfg.speculation_max_batch, self._on_step)
        exporter = make_exporter(cfg.telemetry.exporter, cfg.telemetry.endpoint)
        if exporter is not None:
            self._provider = make_provider(cfg.telemetry.service_name, exporter)
            self.tracer = self._provider.get_tracer("specd.worker")
        link = cfg.controller
        if link.address is not None:
            self.client = ControllerClient(
                ClientConfig(
                    address=link.address,
                    worker_id=cfg.worker_id or worker_id or socket.gethostname(),
                    decide_deadline_ms=link.decide_deadline_ms,
                    default_drafter=link.default_drafter,
                    default_num_draft_tokens=link.default_num_draft_tokens,
                    fallback_max_batch_size=cfg.speculation_max_batch,
                    report_interval_s=link.report_interval_seconds,
                    max_buffered_aggregates=link.max_buffered_aggregates,
                ),
                tracer=self.tracer if exporter is not None else None,
            )
            self.client.start()
        self.scheduler.start()

    def shutdown(self) -> None:
        """Finish admitted requests (up to the grace period), flush telemetry and spans, stop."""
        self.draining = True
        if self.scheduler is not None:
            self.scheduler.drain(self.cfg.shutdown_grace_seconds)
            self.scheduler.stop()
        if self.client is not None:
            self.client.close(flush_timeout_s=min(5.0, self.cfg.shutdown_grace_seconds + 1))
        if self._provider is not None:
            self._provider.shutdown()

    @property
    def healthy(self) -> bool:
        return self.scheduler is not None and self.scheduler.failure is None and not self.draining

    @property
    def model_name(self) -> str:
        return self.cfg.model_name

    def encode(self, text: str) -> list[int]:
        assert self.engine is not None
        return self.engine.encode(text)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: 0 .. vocab_size - 1 (the rows of the target's embedding table)."""
        assert self.engine is not None
        return int(self.engine.target.model.get_input_embeddings().num_embeddings)

    @property
    def tokenizer(self) -> Any:
        assert self.engine is not None
        return self.engine.target.tokenizer

    def _on_step(self, step: StepObservation) -> None:
        self.metrics.observe_step(step)

    # -- one request ---------------------------------------------------------------------------------------

    async def run_request(self, spec: RequestSpec) -> AsyncGenerator[Event, None]:
        """Decode one request; yields "text" events, then one "done" or "error". Raises QueueFull/ShuttingDown
        before anything is yielded when the request cannot be queued."""
        assert self.engine is not None and self.scheduler is not None
        engine, scheduler = self.engine, self.scheduler
        started = time.perf_counter()
        repetition = self_repetition(spec.prompt_ids)
        segment = spec.segment or self._infer_segment(spec, repetition)
        span = self.tracer.start_span("specd.worker.request", context=spec.trace_context, kind=SpanKind.SERVER)
        span_ctx = trace.set_span_in_context(span, spec.trace_context)
        span.set_attributes({"specd.segment": segment, "specd.prompt_tokens": len(spec.prompt_ids)})
        try:
            decision = await self._decide(spec, segment, repetition, span_ctx)
        except BaseException:
            span.end()
            raise
        self._observe_decision(segment, decision)
        span.set_attributes(
            {
                "specd.drafter": decision.drafter,
                "specd.num_draft_tokens": decision.num_draft_tokens,
                "specd.decision.reason": decision.reason,
                "specd.decision.source": decision.source,
                "specd.fallback": decision.fallback or "",
                "specd.fallback_used": decision.fallback is not None,
            }
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        decode_span: list[trace.Span] = []

        def on_started(prefill_seconds: float) -> None:
            if job.cancelled:  # the request was already accounted for as cancelled
                return
            now = time.time_ns()
            prefill = self.tracer.start_span(
                "specd.prefill", context=span_ctx, start_time=now - int(prefill_seconds * 1e9)
            )
            prefill.set_attribute("specd.prompt_tokens", len(spec.prompt_ids))
            prefill.end(end_time=now)
            decode_span.append(self.tracer.start_span("specd.decode", context=span_ctx, start_time=now))

        drafter = decision.drafter if decision.drafter in engine.drafters else "none"
        rules = StopRules(spec.max_new_tokens, engine.target.eos_token_ids, spec.stop_strings)
        job = Job(
            prompt_ids=spec.prompt_ids,
            params=spec.params,
            rules=rules,
            drafter=drafter,
            num_draft_tokens=decision.num_draft_tokens if drafter != "none" else 0,
            timeout_seconds=self.cfg.request_timeout_seconds,
            on_tokens=lambda tokens: put("tokens", tokens),
            on_started=on_started,
            on_finish=lambda outcome: put("finish", outcome),
        )
        try:
            scheduler.submit(job)
        except (QueueFull, ShuttingDown) as e:
            self.metrics.rejected.labels("queue_full" if isinstance(e, QueueFull) else "shutting_down").inc()
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            raise
        stream = TextStream(self._decode, spec.stop_strings)
        outcome: JobOutcome | None = None
        try:
            while outcome is None:
                kind, value = await events.get()
                if kind == "tokens":
                    delta = stream.push(value)
                    if delta:
                        yield Event("text", text=delta)
                else:
                    outcome = value
        finally:
            if outcome is None:  # the consumer went away (client disconnected): stop decoding it, count it now
                job.cancel()  # (nothing reads this request's events any more, so its on_finish would go unseen)
                cancelled = JobOutcome("cancelled", error="the client went away")
                self._finish(segment, decision, repetition, spec, cancelled, started, span, decode_span)
        result = outcome.result
        final_text = result.text if result is not None else ""
        rest = stream.finish(final_text)
        if rest:
            yield Event("text", text=rest)
        info = self._finish(segment, decision, repetition, spec, outcome, started, span, decode_span)
        if outcome.status == "finished" and result is not None:
            yield Event(
                "done",
                finish_reason=result.finish_reason,
                prompt_tokens=len(spec.prompt_ids),
                completion_tokens=len(result.token_ids),
                specd=info,
            )
        else:
            status = {"timeout": 504, "cancelled": 499, "error": 400, "failed": 500}.get(outcome.status, 500)
            yield Event("error", status=status, error=outcome.error or outcome.status, specd=info)

    async def _decide(self, spec: RequestSpec, segment: str, repetition: float, ctx: Context) -> DecisionOutcome:
        assert self.engine is not None and self.scheduler is not None
        # The decision holds for the request's life while the batch grows and shrinks; the scheduler switches
        # speculation off for every step the batch is above speculation_max_batch. So the controller is asked
        # what to run when speculating is allowed: a request arriving in a full batch still gets a drafter and
        # speculates once the batch shrinks.
        batch_size = min(self.scheduler.load(), max(1, self.cfg.speculation_max_batch))
        started = time.perf_counter()
        if self.client is None:
            decision = local_decision(self.cfg, batch_size)
        else:
            client = self.client
            p = spec.params

            def call() -> DecisionOutcome:
                return client.decide(
                    segment=segment,
                    batch_size=batch_size,
                    drafters=[d for d in self.engine.drafters if d != "none"] if self.engine else [],
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    prompt_tokens=len(spec.prompt_ids),
                    max_new_tokens=spec.max_new_tokens,
                    self_repetition=repetition,
                )

            # The client's span must be a child of the request span: run it inside that context.
            token = otel_context.attach(ctx)
            try:
                context = contextvars.copy_context()
            finally:
                otel_context.detach(token)
            decision = await asyncio.get_running_loop().run_in_executor(None, context.run, call)
        # The controller call as the client timed it (the deadline applies to it), and the whole wait,
        # which adds the hop to a thread and back (it grows when the CPU is saturated).
        self.metrics.decide_seconds.observe(decision.latency_s)
        self.metrics.decision_wait_seconds.observe(time.perf_counter() - started)
        return decision

    def _observe_decision(self, segment: str, decision: DecisionOutcome) -> None:
        self.metrics.decisions.labels(segment, decision.drafter, decision.reason, decision.source).inc()
        if decision.fallback is not None:
            self.metrics.fallbacks.labels(decision.fallback).inc()

    def _finish(
        self,
        segment: str,
        decision: DecisionOutcome,
        repetition: float,
        spec: RequestSpec,
        outcome: JobOutcome,
        started: float,
        span: trace.Span,
        decode_span: list[trace.Span],
    ) -> dict[str, Any]:
        result: GenerationResult | None = outcome.result
        stats = result.stats if result is not None else None
        self.metrics.observe_request(segment, outcome.status, stats, time.perf_counter() - started)
        batch = outcome.steps_in_batch
        batch_size = max(1, round(sum(batch) / len(batch))) if batch else 1
        if stats is not None and stats.rounds and self.client is not None:
            self.client.report(
                segment=segment,
                rounds=stats.rounds,
                batch_size=batch_size,
                temperature=spec.params.temperature,
                prompt_tokens=len(spec.prompt_ids),
                self_repetition=repetition,
            )
        info: dict[str, Any] = {
            "segment": segment,
            "drafter": decision.drafter,
            "num_draft_tokens": decision.num_draft_tokens,
            "decision_reason": decision.reason,
            "decision_source": decision.source,
            "fallback": decision.fallback,
            "decide_ms": round(decision.latency_s * 1000, 3),
            "exploration": decision.exploration,
            "batch_size": batch_size,
        }
        if stats is not None:
            info.update(
                num_rounds=stats.num_rounds,
                num_draft_tokens_proposed=stats.num_draft_tokens,
                num_accepted=stats.num_accepted,
                alpha=stats.alpha,
                mean_accepted_length=stats.mean_accepted_length,
                tokens_per_second=round(stats.tokens_per_second, 2),
                prefill_seconds=round(stats.prefill_seconds, 6),
                decode_seconds=round(stats.decode_seconds, 6),
            )
        attributes = {
            "specd.rounds": info.get("num_rounds", 0),
            "specd.proposed": info.get("num_draft_tokens_proposed", 0),
            "specd.accepted": info.get("num_accepted", 0),
            "specd.alpha": info.get("alpha") if info.get("alpha") is not None else -1.0,
            "specd.tokens_per_second": info.get("tokens_per_second", 0.0),
            "specd.batch_size": batch_size,
            "specd.segment": segment,
            "specd.drafter": decision.drafter,
            "specd.num_draft_tokens": decision.num_draft_tokens,
            "specd.fallback_used": decision.fallback is not None,
            "specd.status": outcome.status,
        }
        for d in decode_span:
            d.set_attributes(attributes)
            d.end()
        span.set_attributes(attributes)
        if outcome.status != "finished":
            span.set_status(Status(StatusCode.ERROR, outcome.error or outcome.status))
        span.end()
        return info

    def _infer_segment(self, spec: RequestSpec, repetition: float) -> str:
        if self.cfg.segment_classifier == "none":
            return self.cfg.default_segment
        text = spec.prompt_text if spec.prompt_text is not None else self._decode(spec.prompt_ids)
        return classify_prompt(text, repetition)

    def _decode(self, token_ids: Any) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
