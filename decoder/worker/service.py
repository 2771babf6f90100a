"""The worker's core, independent of HTTP: models, the scheduler, the controller client, metrics and traces.

``WorkerService.run_request`` takes a parsed request through the whole path: segment, decision (the
controller within its deadline, else a fallback), queue, prefill, decode, report, metrics and spans, and
yields events as tokens arrive. The HTTP layer (decoder.worker.app) only translates.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from decoder.batch_engine import BatchEngine
from decoder.calibration import CALIBRATION_SEGMENT, TimedSequence, calibration_prompt, measure_costs
from decoder.drafters import PromptLookupConfig, SuffixCache
from decoder.engine import GenerationResult
from decoder.heads import load_head
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from decoder.telemetry import RequestStats
from decoder.worker.client_segments import SegmentAdmission
from decoder.worker.config import WorkerConfig
from decoder.worker.fault_injection import StallPicker
from decoder.worker.metrics import WorkerMetrics
from decoder.worker.scheduler import Job, JobOutcome, QueueFull, Scheduler, ShuttingDown, StepObservation
from decoder.worker.segments import CLASSIFIER_SEGMENTS, WINDOW_CHARS, classify_prompt
from decoder.worker.text_stream import TextStream
from specd_api.plan import Plan, local_plan, requested, runnable, seeded
from specd_api.request_features import RequestFeatures
from specd_api.spans import plan_attributes
from specd_api.sparse_log import SparseLog
from specd_api.tracing import make_exporter, make_provider, no_tracer
from specd_client import ClientConfig, ControllerClient, self_repetition

log = logging.getLogger("specd.worker")

__all__ = ["QueueFull", "RequestSpec", "ShuttingDown", "Speculation", "WorkerService"]

# Requests waiting for their work after the answer (scoring, report, suffix cache: a few ms each): past this, a request
# is reported (without suffix decoding's score) and shared at once, so a burst cannot queue unbounded work.
MAX_PENDING_SCORES = 64
# How long that work waits for the decode loop to be idle (Scheduler.wait_idle) before it runs beside the decodes.
BACKGROUND_DEFER_SECONDS = 2.0


@dataclass(frozen=True)
class RequestSpec:
    """A request as the HTTP layer parsed it."""

    prompt_text: str | None  # None when the client sent token ids
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_strings: tuple[str, ...]
    segment: str | None  # as named by the caller (body or header); None: infer
    inferred_prefix: str = ""  # put before an inferred segment: a tenant's own ("<tenant>/", auth.tenants)
    trace_context: Context | None = None
    speculation: Speculation | None = None  # the caller chose the drafter and K: no controller asked
    stream: bool = True  # text as it is decoded; False: the whole text once done (nothing decoded per step)
    share_outputs: bool = True  # False: its output never enters the suffix cache (other requests cannot read it)


@dataclass(frozen=True)
class Speculation:
    """A caller's own choice of drafter and K for one request (A/B tests, benchmarks): every round runs at ``k``.
    With ``report`` false its rounds are not reported to the controller."""

    drafter: str
    k: int
    report: bool = True


# What a request's event stream says, in order: "accepted" (queued: the first event), "text" (any number), then one of
# "done" or "error".
EventKind = Literal["accepted", "text", "done", "error"]


@dataclass
class Event:
    kind: EventKind
    text: str = ""
    finish_reason: str | None = None
    status: int = 200
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    specd: dict[str, Any] = field(default_factory=dict)


@dataclass
class InFlight:
    """One request between its plan and its answer: what ``_finish`` needs to account for it."""

    spec: RequestSpec
    segment: str
    repetition: float
    plan: Plan
    started: float
    span: trace.Span
    span_ctx: Context
    decode_span: list[trace.Span] = field(default_factory=list)
    received: float = 0.0  # perf_counter when the request reached the worker's service (before its segment, its plan)
    first_token: float = 0.0  # perf_counter when its first token was decoded (0: none yet)


class WorkerService:
    def __init__(self, config: WorkerConfig, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """``on_failure``: called (on the decode thread) if the decode loop dies; the process exits on it."""
        self.cfg = config
        self.on_failure = on_failure or (lambda _: None)
        self.metrics = WorkerMetrics()
        self.stalls = StallPicker(config.fault_injection)  # off unless configured
        if self.stalls.active:
            log.warning("fault injection: %.0f%% of requests stall %.0f ms in their second round",
                        100 * self.stalls.share, 1000 * self.stalls.seconds)  # fmt: skip
        self.engine: BatchEngine | None = None
        self.scheduler: Scheduler | None = None
        self.client: ControllerClient | None = None
        self._calibration: list[TimedSequence] = []  # start-up timings, reported once the client is up
        self.tracer: trace.Tracer = no_tracer()
        self._provider: Any = None
        self.started_unix = time.time()
        self.draining = False
        # Suffix decoding's counterfactual scoring, after the answer: one thread, at most MAX_PENDING_SCORES waiting.
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-scoring")
        self._scoring_lock = threading.Lock()
        self._scores_pending = 0
        self._suffix_due = 1.0  # counterfactual_share accumulated over the requests asked for it: score at 1
        inferred = (config.default_segment, *CLASSIFIER_SEGMENTS)  # what the worker names itself: never counted
        self.segment_admission = SegmentAdmission(config.client_segments, inferred)
        self._ignored = SparseLog(log, logging.WARNING, 60.0)  # the requests served under an inferred segment

    # -- lifecycle -----------------------------------------------------------------------------------------

    def startup(self, worker_id: str | None = None) -> None:
        """Load the models, start the decode thread, connect to the controller, set up tracing."""
        cfg = self.cfg
        self.scheduler = Scheduler(self._load_engine, cfg.max_queue, self._on_step, self.on_failure)
        self.scheduler.start()  # the models load in the decode thread (see Scheduler)
        self.engine = self.scheduler.engine
        if self.engine is not None:
            self.metrics.observe_forward_pass(self.engine.target_pool.forward_pass)
            draft = self.engine.draft_pool
            passes = {"target": self.engine.target_pool.forward_pass}
            self.metrics.watch_forward_passes(passes if draft is None else {**passes, "draft": draft.forward_pass})
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
                    default_k=link.default_k,
                    fallback_max_batch_size=cfg.speculation_max_batch,
                    report_interval_s=link.report_interval_seconds,
                    max_buffered_aggregates=link.max_buffered_aggregates,
                    credentials=link.credentials(),
                    watch_decisions=self._watched_drafters() if link.watch_decisions else (),
                ),
                tracer=self.tracer if exporter is not None else None,
                quiet=self.scheduler.wait_idle,
            )
            self.client.start()
            self.metrics.watch_client(self.client.stats)
            self._report_calibration()

    def _report_calibration(self) -> None:
        """The start-up cost calibration, as the controller's first timings (costs only, in no segment)."""
        assert self.client is not None and self.engine is not None
        prompt_tokens = len(calibration_prompt(self.engine.target.vocab_size))
        for sequence in self._calibration:
            self.client.report(segment=CALIBRATION_SEGMENT, rounds=sequence.rounds, temperature=sequence.temperature,
                               prompt_tokens=prompt_tokens, self_repetition=0.0, start_up_timings=True)  # fmt: skip
        self._calibration = []

    def _watched_drafters(self) -> tuple[str, ...]:
        assert self.engine is not None
        return tuple(d for d in self.engine.drafters if d != "none")

    def _load_engine(self) -> BatchEngine:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = resolve_device(cfg.device)
        dtype = parse_dtype(cfg.dtype, device)
        target = load_model(cfg.target, device, dtype, cfg.runner)
        draft = load_model(cfg.draft, device, dtype, cfg.runner) if cfg.draft is not None else None
        lookup = PromptLookupConfig(
            cfg.prompt_lookup.min_ngram, cfg.prompt_lookup.max_ngram, cfg.prompt_lookup.branches
        )
        cache = SuffixCache(cfg.suffix.config())  # one per worker: filled by ``_share`` as requests finish
        head = load_head(cfg.head, target) if cfg.head is not None else None
        engine = BatchEngine(target, draft, lookup, max_batch=cfg.max_batch, suffix_cache=cache, head=head)
        if cfg.warm_up:
            started = time.perf_counter()
            captured = engine.capture_graphs()  # before any round: the warm-up's rounds then replay them
            if captured:
                log.info("CUDA graphs: %d captured (target and draft pools, every bucket) in %.1fs", captured,
                         time.perf_counter() - started)  # fmt: skip
            started = time.perf_counter()
            rounds = engine.warm_up()
            log.info("warm-up: %d rounds of %s in %.1fs", rounds, "/".join(engine.drafters),
                     time.perf_counter() - started)  # fmt: skip
            if cfg.controller.address is None:  # the timings are the controller's first costs: nobody to report to
                return engine
            started = time.perf_counter()
            self._calibration = measure_costs(engine)
            log.info("cost calibration: %d timed rounds in %.1fs (reported to the controller as its first costs)",
                     sum(len(s.rounds) for s in self._calibration), time.perf_counter() - started)  # fmt: skip
        return engine

    def shutdown(self) -> None:
        """Finish admitted requests (up to the grace period), flush telemetry and spans, stop."""
        self.draining = True
        if self.scheduler is not None:
            self.scheduler.drain(self.cfg.shutdown_grace_seconds)
            self.scheduler.stop()
        self._scoring.shutdown(wait=True)  # scored requests report (and share) before the client flushes
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

    def encode(self, text: str, cap: int | None = None) -> list[int]:
        """``Engine.encode``: raises ``PromptTooLong`` past ``cap`` tokens."""
        assert self.engine is not None
        return self.engine.encode(text, cap)

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
        """Decode one request; yields "accepted" once it is queued, "text" events, then one "done" or "error".
        Raises QueueFull/ShuttingDown before anything is yielded when the request cannot be queued."""
        request = await self._plan(spec)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        job = self._submit(request, put if spec.stream else _only_the_finish(put))
        stream = TextStream(self._decode, spec.stop_strings)
        outcome: JobOutcome | None = None
        try:
            yield Event("accepted")  # the caller can answer now, and watch for a client that goes away
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
                self._finish(request, JobOutcome("cancelled", error="the client went away"))
        rest = stream.finish(outcome.result.text if outcome.result is not None else "")
        if rest:
            yield Event("text", text=rest)
        yield self._answer(request, outcome, self._finish(request, outcome))

    async def _plan(self, spec: RequestSpec) -> InFlight:
        """Step 1: the segment, the request span, and the plan (the controller's, a fallback, or the caller's)."""
        received = time.perf_counter()
        # Off the event loop: both read the whole prompt (32,768 tokens: 30 ms of self-repetition alone).
        repetition, segment = await asyncio.to_thread(self._segment_of, spec)
        span = self.tracer.start_span("specd.worker.request", context=spec.trace_context, kind=SpanKind.SERVER)
        span_ctx = trace.set_span_in_context(span, spec.trace_context)
        span.set_attributes({"specd.segment": segment, "specd.prompt_tokens": len(spec.prompt_ids)})
        started = time.perf_counter()
        try:
            plan = await self._decide(spec, segment, repetition, span_ctx)
        except BaseException:
            span.end()
            raise
        self._observe_decision(segment, plan)
        span.set_attributes({**plan_attributes(plan, segment), "specd.fallback_used": plan.origin.fallback is not None})
        return InFlight(spec, segment, repetition, plan, started, span, span_ctx, received=received)

    def _submit(self, request: InFlight, put: Callable[[str, Any], None]) -> Job:
        """Step 2: queue the job with the plan as this worker runs it (no speculation with a drafter it does not
        offer; the plan's batch threshold, else ``speculation_max_batch``); its callbacks feed the request's event
        queue from the decode thread."""
        assert self.engine is not None and self.scheduler is not None
        spec = request.spec
        plan = runnable(request.plan, self.engine.drafters, self.cfg.speculation_max_batch)
        if plan.segment != request.segment:  # suffix decoding reads the outputs of the plan's segment
            plan = replace(plan, segment=request.segment)

        def on_started(prefill_seconds: float) -> None:
            if job.cancelled:  # the request was already accounted for as cancelled
                return
            now = time.time_ns()
            prefill = self.tracer.start_span(
                "specd.prefill", context=request.span_ctx, start_time=now - int(prefill_seconds * 1e9)
            )
            prefill.set_attribute("specd.prompt_tokens", len(spec.prompt_ids))
            prefill.end(end_time=now)
            request.decode_span.append(self.tracer.start_span("specd.decode", context=request.span_ctx, start_time=now))

        def on_tokens(tokens: list[int]) -> None:
            if tokens and not request.first_token:
                request.first_token = time.perf_counter()
            put("tokens", tokens)

        job = Job(
            prompt_ids=spec.prompt_ids,
            params=spec.params,
            rules=StopConditions(spec.max_new_tokens, self.engine.target.eos_token_ids, spec.stop_strings),
            plan=plan,
            timeout_seconds=self.cfg.request_timeout_seconds,
            on_tokens=on_tokens,
            on_started=on_started,
            on_finish=lambda outcome: put("finish", outcome),
            stall_seconds=self.stalls.draw(),
        )
        try:
            self.scheduler.submit(job)
        except (QueueFull, ShuttingDown) as e:
            self.metrics.rejected.labels("queue_full" if isinstance(e, QueueFull) else "shutting_down").inc()
            request.span.set_status(Status(StatusCode.ERROR, str(e)))
            request.span.end()
            raise
        return job

    def _answer(self, request: InFlight, outcome: JobOutcome, info: dict[str, Any]) -> Event:
        """Step 4: the last event, "done" or "error"."""
        result = outcome.result
        if outcome.status == "finished" and result is not None:
            return Event(
                "done",
                finish_reason=result.finish_reason,
                prompt_tokens=len(request.spec.prompt_ids),
                completion_tokens=len(result.token_ids),
                specd=info,
            )
        status = {"timeout": 504, "cancelled": 499, "error": 400, "failed": 500}.get(outcome.status, 500)
        return Event("error", status=status, error=outcome.error or outcome.status, specd=info)

    async def _decide(self, spec: RequestSpec, segment: str, repetition: float, ctx: Context) -> Plan:
        assert self.engine is not None and self.scheduler is not None
        # The plan holds for the request's life while the batch grows and shrinks; its round policy switches
        # speculation off for every step the batch is above the plan's threshold (speculation_max_batch when the
        # plan carries none). So the controller is asked what to run when speculating is allowed: a request
        # arriving in a full batch still gets a drafter and speculates once the batch shrinks.
        batch_size = min(self.scheduler.load(), max(1, self.cfg.speculation_max_batch))
        offered = [d for d in self.engine.drafters if d != "none"]
        started = time.perf_counter()
        if spec.speculation is not None:
            plan = requested(spec.speculation.drafter, spec.speculation.k)
        elif spec.params.seed is not None and not spec.params.is_greedy:
            plan = seeded()  # reproducible whatever else runs
        elif self.client is None:
            link = self.cfg.controller
            plan = local_plan(
                link.default_drafter, link.default_k, offered, batch_size,
                self.cfg.speculation_max_batch, fallback=None,
            )  # fmt: skip
        else:
            client = self.client
            p = spec.params
            features = RequestFeatures(
                segment=segment,
                batch_size=batch_size,
                drafters=tuple(offered),
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                prompt_tokens=len(spec.prompt_ids),
                max_new_tokens=spec.max_new_tokens,
                self_repetition=repetition,
            )

            def call() -> Plan:
                return client.decide(features)

            # The client's span must be a child of the request span: run it inside that context.
            token = otel_context.attach(ctx)
            try:
                context = contextvars.copy_context()
            finally:
                otel_context.detach(token)
            plan = await asyncio.get_running_loop().run_in_executor(None, context.run, call)
        # The controller call as the client timed it (the deadline applies to it), and the whole wait,
        # which adds the hop to a thread and back (it grows when the CPU is saturated).
        self.metrics.decide_seconds.observe(plan.origin.latency_s)
        self.metrics.decision_wait_seconds.observe(time.perf_counter() - started)
        return plan

    def _observe_decision(self, segment: str, plan: Plan) -> None:
        self.metrics.decisions.labels(segment, plan.drafter, plan.reason, plan.origin.source).inc()
        if plan.origin.fallback is not None:
            self.metrics.fallbacks.labels(plan.origin.fallback).inc()

    def _finish(self, request: InFlight, outcome: JobOutcome) -> dict[str, Any]:
        """Step 3: metrics, the report to the controller, the spans; returns the response's ``specd`` block."""
        result: GenerationResult | None = outcome.result
        stats = result.stats if result is not None else None
        self.metrics.observe_request(request.segment, outcome.status, stats, time.perf_counter() - request.started)
        batch = outcome.steps_in_batch
        batch_size = max(1, round(sum(batch) / len(batch))) if batch else 1
        shares = outcome.status == "finished" and result is not None and self._shares(request)
        generated = result.token_ids if result is not None else []
        ks = self._counterfactual_ks(request, stats) if stats is not None and self._reports(request) else None
        if (ks is not None or shares) and not self._later(request, stats, generated, ks, shares):
            if ks is not None:  # MAX_PENDING_SCORES wait already: reported now, without suffix decoding's score
                ks.pop("suffix", None)
                self._report(request, stats, generated, ks)  # type: ignore[arg-type]
            if shares:
                self._share(request.segment, generated)
        info = response_info(request.segment, request.plan, batch_size, stats)
        if request.first_token:
            info["ttft_seconds"] = round(request.first_token - request.received, 6)
        attributes = span_attributes(request.segment, request.plan, info, outcome.status)
        for d in request.decode_span:
            d.set_attributes(attributes)
            d.end()
        request.span.set_attributes(attributes)
        if outcome.status != "finished":
            request.span.set_status(Status(StatusCode.ERROR, outcome.error or outcome.status))
        request.span.end()
        return info

    def _shares(self, request: InFlight) -> bool:
        """May other requests' suffix decoding propose from this request's output? Not when the request or the
        worker's ``suffix.private_segments`` says no."""
        return request.spec.share_outputs and not self.cfg.suffix.is_private(request.segment)

    def _share(self, segment: str, token_ids: list[int]) -> None:
        """Add a served output to the suffix cache (milliseconds for hundreds of tokens, in chunks the decode
        thread's reads can pass between)."""
        assert self.engine is not None
        cache = self.engine.suffix_cache
        cache.add(segment, token_ids)
        self.metrics.observe_suffix_cache(cache.stats())

    def _reports(self, request: InFlight) -> bool:
        chosen = request.spec.speculation
        return self.client is not None and (chosen is None or chosen.report)

    def _counterfactual_ks(self, request: InFlight, stats: RequestStats) -> dict[str, int]:
        """The drafters scored over this request (the plan's, but the one that ran), each at its ceiling; suffix
        decoding on ``suffix.counterfactual_share`` of the requests asked for it (its replay costs ~2% of a decode)."""
        assert self.engine is not None
        ks = self.engine.counterfactual_ks(request.plan, stats.rounds[0].drafter if stats.rounds else "none")
        if "suffix" in ks:
            share = self.cfg.suffix.counterfactual_share
            with self._scoring_lock:
                due = share > 0 and self._suffix_due >= 1.0  # the first request asked, then one in 1 / share
                self._suffix_due += share - (1.0 if due else 0.0)
            if not due:
                del ks["suffix"]
        return ks

    def _later(
        self, request: InFlight, stats: RequestStats | None, generated: list[int], ks: dict[str, int] | None,
        shares: bool,
    ) -> bool:  # fmt: skip
        """After the answer, on the scoring thread once the decode loop is idle (at most BACKGROUND_DEFER_SECONDS
        later): score the drafters of ``ks`` and report ``request`` (None: it is not reported), then share its output
        if ``shares`` (suffix decoding is replayed over the cache without it). False: MAX_PENDING_SCORES already
        wait, or the worker is stopping; the caller does what it must at once."""
        with self._scoring_lock:
            if self._scores_pending >= MAX_PENDING_SCORES:
                return False
            self._scores_pending += 1
        try:
            self._scoring.submit(self._score_and_share, request, stats, generated, ks, shares)
        except RuntimeError:  # shut down
            with self._scoring_lock:
                self._scores_pending -= 1
            return False
        return True

    def _score_and_share(
        self, request: InFlight, stats: RequestStats | None, generated: list[int], ks: dict[str, int] | None,
        shares: bool,
    ) -> None:  # fmt: skip
        try:
            if self.scheduler is not None:
                self.scheduler.wait_idle(BACKGROUND_DEFER_SECONDS)
            if ks is not None and stats is not None:
                self._report(request, stats, generated, ks)
            if shares:
                self._share(request.segment, generated)
        except Exception:  # (nothing waits for this thread's futures: say it here)
            log.exception("reporting or sharing a request of segment %r failed", request.segment)
        finally:
            with self._scoring_lock:
                self._scores_pending -= 1

    def _report(self, request: InFlight, stats: RequestStats, generated: list[int], ks: dict[str, int]) -> None:
        """Report the request's rounds, with the drafters of ``ks`` scored over them (before its output joins the
        suffix cache)."""
        assert self.client is not None and self.engine is not None
        spec, engine = request.spec, self.engine
        rules = StopConditions(spec.max_new_tokens, engine.target.eos_token_ids)
        try:
            scored = engine.score(ks, spec.prompt_ids, generated, rules, request.segment) if ks else []
        except Exception:  # a scoring bug must not cost the request's served rounds, nor the request
            log.exception("counterfactual scoring of %s failed; the rounds are reported without it", sorted(ks))
            scored = []
        self.client.report(
            segment=request.segment,
            rounds=stats.rounds,
            temperature=spec.params.temperature,
            prompt_tokens=len(spec.prompt_ids),
            self_repetition=request.repetition,
            scored=scored,
            expected_speedup=request.plan.model_speedup if request.plan is not None else 0.0,
            drafter_prefill_seconds=stats.draft_prefill_seconds,
        )

    def client_segment(self, name: str, host: str) -> str | None:
        """The segment a request naming ``name`` from client address ``host`` is served under: the name, or None
        (infer one: no place left for it, counted and logged at most once a minute). Raises SegmentRefused for a
        name this worker does not take (``client_segments``)."""
        admitted = self.segment_admission.admit(name, host)
        if admitted is None:
            self.metrics.client_segments_ignored.inc()
            bounds = self.cfg.client_segments
            self._ignored.note(
                "a request from %s named segment %r, and this worker holds client_segments.max_names (%d) or that "
                "address max_names_per_host (%d): served under the segment inferred from its prompt (logged at most "
                "once a minute; specd_worker_client_segments_ignored_total counts them)",
                host, name[:128], bounds.max_names, bounds.max_names_per_host,
            )  # fmt: skip
        return admitted

    def _segment_of(self, spec: RequestSpec) -> tuple[float, str]:
        """The prompt's self-repetition, and its segment: the caller's, else inferred."""
        repetition = self_repetition(spec.prompt_ids)
        return repetition, spec.segment or spec.inferred_prefix + self._infer_segment(spec, repetition)

    def _infer_segment(self, spec: RequestSpec, repetition: float) -> str:
        if self.cfg.segment_classifier == "none":
            return self.cfg.default_segment
        text, ids, n = spec.prompt_text, spec.prompt_ids, WINDOW_CHARS
        if text is None:  # token ids: decode no more than the classifier reads (n tokens from each end)
            text = self._decode(ids) if len(ids) <= 2 * n else f"{self._decode(ids[:n])}\n{self._decode(ids[-n:])}"
        return classify_prompt(text, repetition)

    def _decode(self, token_ids: Any) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def _only_the_finish(put: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """For a request that is not streamed: no event per step (detokenizing every step on the event loop would take
    the GIL from the decode thread, and cost the rounds it times), just the finish."""

    def put_finish(kind: str, value: Any) -> None:
        if kind != "tokens":
            put(kind, value)

    return put_finish


def response_info(segment: str, plan: Plan, batch_size: int, stats: RequestStats | None) -> dict[str, Any]:
    """The response's ``specd`` block: the plan, and what the rounds did."""
    info: dict[str, Any] = {
        "segment": segment,
        "drafter": plan.drafter,
        "k": plan.k,
        "decision_reason": plan.reason,
        "decision_source": plan.origin.source,
        "fallback": plan.origin.fallback,
        "decide_ms": round(plan.origin.latency_s * 1000, 3),
        "exploration": plan.exploration,
        "expected_speedup": round(plan.expected_speedup, 4),
        "batch_size": batch_size,
    }
    if stats is not None:
        drafting = [r for r in stats.rounds if r.k > 0]
        info.update(
            num_rounds=stats.num_rounds,
            num_drafted=stats.num_drafted,
            num_accepted=stats.num_accepted,
            alpha=stats.alpha,
            mean_accepted_length=stats.mean_accepted_length,
            mean_k=round(sum(r.k for r in drafting) / len(drafting), 3) if drafting else 0.0,
            tokens_per_second=round(stats.tokens_per_second, 2),
            prefill_seconds=round(stats.prefill_seconds, 6),
            draft_prefill_seconds=round(stats.draft_prefill_seconds, 6),
            decode_seconds=round(stats.decode_seconds, 6),
        )
    return info


def span_attributes(segment: str, plan: Plan, info: dict[str, Any], status: str) -> dict[str, Any]:
    """The request's and decode span's attributes: the plan's (specd_api.spans, their one builder) and the rounds'."""
    alpha = info.get("alpha")
    return {
        **plan_attributes(plan, segment),
        "specd.rounds": info.get("num_rounds", 0),
        "specd.num_drafted": info.get("num_drafted", 0),
        "specd.num_accepted": info.get("num_accepted", 0),
        "specd.alpha": alpha if alpha is not None else -1.0,
        "specd.tokens_per_second": info.get("tokens_per_second", 0.0),
        "specd.batch_size": info["batch_size"],
        "specd.fallback_used": plan.origin.fallback is not None,
        "specd.status": status,
    }
