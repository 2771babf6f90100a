"""ControllerClient: what a decode worker calls to ask the specd controller for decisions and to report rounds.

decide() answers within about its deadline whatever the controller does, and never raises (contract 2).
report() only converts and enqueues; a background thread sends, retrying a failed report with the same
report_id (the controller deduplicates), and the buffer is bounded (what it drops is counted).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specd_api.checks import REPORT_HELD, check_aggregate
from specd_api.plan import Fallback, Origin, Plan, fallback_plan, worth_remembering
from specd_api.request_features import RequestFeatures
from specd_api.rounds import RoundRecord, Scored
from specd_api.security import controller_channel
from specd_api.spans import plan_attributes
from specd_api.table_rule import as_local
from specd_api.tracing import metadata_with_context
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_client.buffer import PendingReport, ReportBuffer
from specd_client.config import ClientConfig, ClientStats
from specd_client.fallback import DecisionMemory, fallback_cause
from specd_client.reports import RequestTotals, counterfactual_aggregates, rounds_to_aggregates
from specd_client.table_watcher import QUIET_WAIT_SECONDS, TableWatcher

log = logging.getLogger("specd.controller.client")
DECIDE_SPAN = "specd.controller.decide"
# A report the controller refused as invalid is refused again on every retry: give it up (and count it).
NOT_RETRIED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
# The controller refused this client's credentials: a setting to fix on one side or the other, after which the same
# report is accepted. Decisions fall back, reports stay buffered (bounded) and are retried; logged once, not per call.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
NOT_CONNECTED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
MAX_GRPC_MS = 2**31 - 1


def _held(error: grpc.RpcError) -> bool:
    """Did a busy controller hold the report for its retry (``REPORT_HELD`` in the answer's trailing metadata)?"""
    trailing = error.trailing_metadata() if isinstance(error, grpc.Call) else None
    return any(key == REPORT_HELD for key, _ in trailing or ())


def channel_options(config: ClientConfig) -> list[tuple[str, int]]:
    """Reconnect soon after the controller comes back, and keep an idle connection open (a reconnect inside a
    few-millisecond deadline would turn the first decision after a quiet spell into a fallback)."""
    low, high = config.reconnect_backoff_s
    return [
        ("grpc.initial_reconnect_backoff_ms", round(low * 1000)),
        ("grpc.min_reconnect_backoff_ms", round(low * 1000)),
        ("grpc.max_reconnect_backoff_ms", round(high * 1000)),
        ("grpc.client_idle_timeout_ms", MAX_GRPC_MS),
    ]


class Backoff:
    """Exponential delays between failed sends, with jitter so that many workers do not retry in step."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        self._next = low

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.high)
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._next = self.low


class ControllerClient:
    """One per worker process; thread-safe. ``start()`` before use, ``close()`` when done (or use ``with``)."""

    def __init__(
        self, config: ClientConfig, tracer: trace.Tracer | None = None, quiet: Callable[[float], object] | None = None
    ) -> None:
        """``quiet(seconds)``: waits at most ``seconds`` for the worker to be quiet (no sequence decoding:
        ``Scheduler.wait_idle``); reports are sent, and pushed tables read, after it, so that neither runs beside a
        decode while it can wait. None: never wait."""
        self.config = config
        self._tracer = tracer
        self._quiet = quiet
        self._memory = DecisionMemory(config.max_remembered_segments)
        self._default = Plan(config.default_drafter, config.default_k, origin=Origin("local_default"))
        self._buffer = ReportBuffer(config.max_buffered_aggregates, config.max_aggregates_per_report)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ControllerStub | None = None
        self._thread: threading.Thread | None = None
        self._tables: TableWatcher | None = None  # the pushed decision tables (config.watch_decisions)
        self._wake = threading.Event()  # the reporter should send now
        self._closing = threading.Event()
        self._flush_deadline = 0.0
        self._lock = threading.Lock()  # the counters below
        self._decisions = 0
        self._local_decisions = 0
        self._fallbacks: Counter[str] = Counter()
        self._reports_invalid = 0
        self._decide_state = "answered"  # "answered" | "refused" | "fallback": logged when it changes, not per call
        self._reports_refused = False  # likewise

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the channel and start connecting (without waiting), and start the background reporter."""
        if self._channel is not None:
            raise RuntimeError("ControllerClient.start() was called twice")
        self._channel = controller_channel(self.config.address, self.config.credentials, channel_options(self.config))
        self._stub = pb_grpc.ControllerStub(self._channel)
        # Any call makes an idle channel connect; this one's answer is not needed. (Not channel.subscribe: its
        # polling thread raises when the channel is closed soon after.)
        self._stub.GetPolicy.future(pb.GetPolicyRequest(), timeout=self.config.report_timeout_s)
        self._thread = threading.Thread(target=self._report_loop, name="specd-client-reporter", daemon=True)
        self._thread.start()
        if self.config.watch_decisions:
            backoff = Backoff(*self.config.reconnect_backoff_s)
            self._tables = TableWatcher(
                self._stub, self.config.worker_id, self.config.watch_decisions, backoff.next, backoff.reset,
                quiet=self._quiet,
            )  # fmt: skip
            self._tables.start()

    @property
    def table_segments(self) -> int:
        """Segments in the pushed decision tables this client holds now (0 when it does not watch them)."""
        tables = self._tables
        return tables.segments if tables is not None and tables.fresh else 0

    def wait_until_ready(self, timeout_s: float) -> bool:
        """Wait until the controller answers (GetPolicy); False after ``timeout_s``. Optional: decide() never
        needs it, but the first decision then does not pay for connecting."""
        if self._stub is None:
            return False
        try:
            self._stub.GetPolicy(pb.GetPolicyRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:  # any answer, even a refusal, means the connection is up
            return isinstance(e, grpc.Call) and e.code() not in NOT_CONNECTED
        return True

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Send what can be sent within ``flush_timeout_s``, stop the reporter, close the channel. Whatever is
        still unsent is counted as dropped."""
        if self._tables is not None:
            self._tables.close()
            self._tables = None
        if self._thread is not None:
            self._flush_deadline = time.monotonic() + flush_timeout_s
            self._closing.set()
            self._wake.set()
            self._thread.join(timeout=flush_timeout_s + 1.0)
            if self._thread.is_alive():
                log.warning("the report sender did not stop within %.1fs", flush_timeout_s + 1.0)
            self._thread = None
        dropped = self._buffer.drop_all()
        if dropped:
            log.warning("closing with %d aggregates unsent: dropped", dropped)
        if self._channel is not None:
            self._channel.close()
            self._channel, self._stub = None, None

    def __enter__(self) -> ControllerClient:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- decisions ----------------------------------------------------------------------------------

    def decide(self, request: RequestFeatures) -> Plan:
        """How to speculate for ``request``: the controller's plan within the deadline, else a fallback.
        Never raises."""
        learned = request.learning_segment  # the tables and the memory are per learning segment

        def answer() -> Plan:
            local = self._local(learned, request)
            return local if local is not None else self._decide(learned, request)

        if self._tracer is None:
            return answer()
        with self._tracer.start_as_current_span(DECIDE_SPAN, kind=SpanKind.CLIENT) as span:
            outcome = answer()
            span.set_attributes(plan_attributes(outcome, request.segment))
            return outcome

    def _local(self, segment: str, request: RequestFeatures) -> Plan | None:
        """The plan from the pushed decision tables of the learning segment ``segment``, or None (ask Decide)."""
        tables = self._tables
        if tables is None:
            return None
        start = time.perf_counter()
        try:
            found = tables.lookup(segment, request)
        except Exception:  # a bad argument, or a bug: Decide (and its fallbacks) still answer
            log.exception("decision table lookup failed for segment %r", segment[:128])
            return None
        if found is None:
            return None
        plan = as_local(found[0], found[1], time.perf_counter() - start)
        if worth_remembering(plan):
            self._memory.remember(segment, plan)
        with self._lock:
            self._decisions += 1
            self._local_decisions += 1
        return plan

    def _decide(self, segment: str, request: RequestFeatures) -> Plan:
        """The call, or the fallback (the last plan remembered for the learning segment ``segment``). The message is
        built inside the guard: a bad value (e.g. an int out of int32 range) is a fallback too, not an exception."""
        start = time.perf_counter()
        stub = self._stub
        code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE
        detail = "the client is not started (or closed)"
        if stub is not None:
            try:
                decision = stub.Decide(
                    request.to_proto(),
                    timeout=self.config.decide_deadline_s,
                    metadata=metadata_with_context(),
                    wait_for_ready=False,
                )
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                detail = e.details() if isinstance(e, grpc.Call) else str(e)
            except Exception as e:  # a bad argument (e.g. an int out of int32 range) must not fail the request
                code, detail = None, f"{type(e).__name__}: {e}"
            else:
                plan = Plan.from_proto(decision, time.perf_counter() - start)
                if worth_remembering(plan):
                    self._memory.remember(segment, plan)
                self._count_decision(None, "")
                return plan
        cause = fallback_cause(code)
        self._count_decision(cause, detail, code)
        return fallback_plan(
            self._memory.recall(segment), self._default, request.drafters, request.batch_size,
            self.config.fallback_max_batch_size,
            cause, time.perf_counter() - start,
        )  # fmt: skip

    def _count_decision(self, cause: Fallback | None, detail: str, code: grpc.StatusCode | None = None) -> None:
        with self._lock:
            self._decisions += 1
            if cause is not None:
                self._fallbacks[cause] += 1
            state = "answered" if cause is None else "refused" if code in REFUSED else "fallback"
            changed, self._decide_state = self._decide_state != state, state
        if changed and state == "refused":
            assert code is not None
            log.error(
                "controller at %s refused this worker's credentials for Decide (%s: %s): deciding locally until it "
                "accepts them; check the token and TLS settings (%s)",
                self.config.address, code.name, detail, self._credentials(),
            )  # fmt: skip
        elif changed and cause is not None:
            log.warning("controller at %s did not answer (%s: %s): using fallbacks", self.config.address, cause, detail)
        elif changed:
            log.info("controller at %s answers again", self.config.address)

    # --- reports ------------------------------------------------------------------------------------

    def report(
        self,
        *,
        segment: str,
        rounds: Sequence[RoundRecord],
        temperature: float,
        prompt_tokens: int,
        self_repetition: float,
        scored: Sequence[Scored] = (),
        expected_speedup: float = 0.0,
        start_up_timings: bool = False,
        drafter_prefill_seconds: float = 0.0,
    ) -> None:
        """Convert one request's rounds (and its counterfactually ``scored`` drafters) and enqueue them for the
        background sender. Never blocks on the network, never raises: rounds the controller would refuse are
        logged, counted and left out."""
        try:
            aggregates = rounds_to_aggregates(
                segment, rounds, temperature, prompt_tokens, self_repetition, scored, expected_speedup,
                start_up_timings, drafter_prefill_seconds,
            )  # fmt: skip
            for aggregate in aggregates:
                check_aggregate(aggregate)  # the controller's own rules: one bad entry would sink a whole report
        except Exception as e:
            with self._lock:
                self._reports_invalid += 1
            log.warning("report for segment %r left out: %s", segment, e)
            return
        self._enqueue(aggregates)

    def report_totals(self, totals: RequestTotals, scored: Sequence[Scored] = ()) -> None:
        """Enqueue one request's totals, from an engine that counts no more (``RequestTotals``), and the one-hot
        drafters ``scored`` over its output. Never blocks on the network, never raises: what the controller would
        refuse is logged, counted and left out."""
        try:
            aggregate = totals.to_proto()
            aggregates = [aggregate] if aggregate is not None else []
            aggregates += counterfactual_aggregates(totals.segment, scored, totals.temperature, totals.prompt_tokens,
                                                    totals.self_repetition)  # fmt: skip
            for a in aggregates:
                check_aggregate(a)
        except Exception as e:
            with self._lock:
                self._reports_invalid += 1
            log.warning("totals for segment %r left out: %s", totals.segment[:128], e)
            return
        self._enqueue(aggregates)

    def _enqueue(self, aggregates: list[pb.RoundsAggregate]) -> None:
        if not aggregates:
            return
        full, dropped = self._buffer.add(aggregates)
        if dropped:
            log.warning("report buffer full (%d aggregates): dropped the %d oldest", self._buffer.capacity, dropped)
        if full:
            self._wake.set()

    def _report_loop(self) -> None:
        backoff = Backoff(*self.config.retry_backoff_s)
        while not self._closing.is_set():
            self._wake.wait(self.config.report_interval_s)
            self._wake.clear()
            if self._quiet is not None and not self._closing.is_set():
                self._quiet(QUIET_WAIT_SECONDS)
            self._send_all(backoff, until=None)
        self._send_all(backoff, until=self._flush_deadline)

    def _send_all(self, backoff: Backoff, until: float | None) -> None:
        """Send until the buffer is empty; after a failure wait (backoff) and retry the same report. Returns
        early when closing starts (``until`` None) or at ``until`` (the flush at close)."""
        while (pending := self._buffer.take()) is not None:
            timeout = self.config.report_timeout_s
            if until is not None:
                timeout = min(timeout, until - time.monotonic())
                if timeout <= 0:
                    return
            try:
                sent = self._send(pending, timeout)
            except Exception:  # the sender must outlive any bug: log it in full, treat it as a failed send
                log.exception("sending report %s failed", pending.report_id)
                sent = False
            if sent:
                backoff.reset()
                continue
            delay = backoff.next()
            if until is None:
                if self._closing.wait(delay):
                    return
            else:
                time.sleep(max(min(delay, until - time.monotonic()), 0.0))

    def _send(self, pending: PendingReport, timeout: float) -> bool:
        """One ReportRounds attempt; True when the report is settled (stored, or refused for good)."""
        stub = self._stub
        if stub is None:
            return False
        request = pb.ReportRoundsRequest(
            report_id=pending.report_id, worker_id=self.config.worker_id, aggregates=pending.aggregates
        )
        try:
            stub.ReportRounds(request, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            if code in NOT_RETRIED:
                log.error("controller refused report %s (%s): dropped", pending.report_id, e)
                self._buffer.rejected(pending)
                return True
            if code in REFUSED:
                self._note_reports_refused(code, e.details() if isinstance(e, grpc.Call) else str(e))
            if code == grpc.StatusCode.UNAVAILABLE and _held(e):
                self._buffer.held()
                log.debug("report %s held by a busy controller: will retry", pending.report_id)
                return False
            self._buffer.failed()
            log.debug("report %s not delivered (%s): will retry", pending.report_id, code)
            return False
        self._buffer.acknowledged(pending)
        self._note_reports_refused(None, "")
        return True

    def _note_reports_refused(self, code: grpc.StatusCode | None, detail: str) -> None:
        """Log when the controller starts or stops refusing this client's reports for its credentials."""
        with self._lock:
            changed = self._reports_refused != (code is not None)
            self._reports_refused = code is not None
        if changed and code is not None:
            log.error(
                "controller at %s refused this worker's credentials for ReportRounds (%s: %s): reports stay buffered "
                "(up to %d aggregates) and are retried; check the token and TLS settings (%s)",
                self.config.address, code.name, detail, self._buffer.capacity, self._credentials(),
            )  # fmt: skip
        elif changed:
            log.info("controller at %s accepts this worker's reports again", self.config.address)

    def _credentials(self) -> str:
        credentials = self.config.credentials
        return credentials.describe() if credentials is not None else "plaintext, no token"

    # --- counters -----------------------------------------------------------------------------------

    def stats(self) -> ClientStats:
        counts = self._buffer.counts()
        with self._lock:
            return ClientStats(
                decisions=self._decisions,
                local_decisions=self._local_decisions,
                fallbacks=dict(self._fallbacks),
                reports_sent=counts.reports_sent,
                aggregates_sent=counts.aggregates_sent,
                rounds_acknowledged=counts.rounds_acknowledged,
                aggregates_dropped=counts.aggregates_dropped,
                aggregates_rejected=counts.aggregates_rejected,
                reports_invalid=self._reports_invalid,
                send_failures=counts.send_failures,
                reports_held=counts.reports_held,
                buffered=counts.buffered,
            )
