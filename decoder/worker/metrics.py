"""Prometheus metrics of the worker (served at /metrics), one registry per worker.

Names follow the glossary: drafted = proposed draft tokens, accepted = num_accepted, per draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from decoder.telemetry import RequestStats
from decoder.worker.scheduler import StepObservation


@dataclass
class SegmentCounters:
    """The same counts as the Prometheus series, kept as numbers so tests and the demo can read them."""

    requests: int = 0
    rounds: dict[str, int] = field(default_factory=dict)  # by drafter
    proposed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    decode_seconds: float = 0.0


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specd_requests", "Requests finished", ["segment", "status"], registry=r)
        self.rounds = Counter("specd_rounds", "Draft + verify rounds", ["segment", "drafter"], registry=r)
        self.drafted = Counter("specd_draft_tokens", "Draft tokens proposed", ["segment", "drafter"], registry=r)
        self.accepted = Counter("specd_accepted_tokens", "Draft tokens accepted", ["segment", "drafter"], registry=r)
        self.position_proposed = Counter(
            "specd_position_proposed", "Rounds with a draft token at this position", ["segment", "drafter", "position"],
            registry=r,
        )  # fmt: skip
        self.position_accepted = Counter(
            "specd_position_accepted", "Rounds that accepted the draft token at this position",
            ["segment", "drafter", "position"], registry=r,
        )  # fmt: skip
        self.generated = Counter("specd_generated_tokens", "Tokens generated", ["segment"], registry=r)
        self.decisions = Counter(
            "specd_decisions", "Decisions used, by drafter and reason", ["segment", "drafter", "reason", "source"],
            registry=r,
        )  # fmt: skip
        self.fallbacks = Counter("specd_controller_fallbacks", "Decisions made without the controller", ["reason"],
                                 registry=r)  # fmt: skip
        self.rejected = Counter("specd_rejected_requests", "Requests refused before decoding", ["reason"], registry=r)
        self.queue_depth = Gauge("specd_queue_depth", "Requests waiting for a KV slot", registry=r)
        self.batch_size = Gauge("specd_batch_size", "Sequences being decoded", registry=r)
        self.step_batch = Histogram(
            "specd_step_batch_size", "Sequences per decode step", buckets=(1, 2, 4, 8, 12, 16, 32, 64), registry=r
        )
        self.step_seconds = Histogram("specd_step_seconds", "Seconds per decode step", registry=r)
        self.request_seconds = Histogram("specd_request_seconds", "Seconds per request, queue included", registry=r)
        self.decide_seconds = Histogram(
            "specd_decide_seconds", "Seconds of the controller call (Decide or its fallback), as the client timed it",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), registry=r,
        )  # fmt: skip
        self.decision_wait_seconds = Histogram(
            "specd_decision_wait_seconds", "Seconds a request waited for its decision (the call plus a thread hop)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), registry=r,
        )  # fmt: skip
        self.by_segment: dict[str, SegmentCounters] = {}

    def observe_step(self, step: StepObservation) -> None:
        self.batch_size.set(step.batch_size)
        self.step_batch.observe(step.batch_size)
        self.step_seconds.observe(step.seconds)

    def observe_request(self, segment: str, status: str, stats: RequestStats | None, seconds: float) -> None:
        self.requests.labels(segment, status).inc()
        self.request_seconds.observe(seconds)
        counters = self.by_segment.setdefault(segment, SegmentCounters())
        counters.requests += 1
        if stats is None:
            return
        for round_ in stats.rounds:
            drafter = round_.drafter if round_.max_draft_tokens > 0 else "none"
            self.rounds.labels(segment, drafter).inc()
            counters.rounds[drafter] = counters.rounds.get(drafter, 0) + 1
            if round_.num_draft_tokens:
                self.drafted.labels(segment, drafter).inc(round_.num_draft_tokens)
                self.accepted.labels(segment, drafter).inc(round_.num_accepted)
                counters.proposed[drafter] = counters.proposed.get(drafter, 0) + round_.num_draft_tokens
                counters.accepted[drafter] = counters.accepted.get(drafter, 0) + round_.num_accepted
            for i in range(round_.num_draft_tokens):
                self.position_proposed.labels(segment, drafter, str(i)).inc()
                if i < round_.num_accepted:
                    self.position_accepted.labels(segment, drafter, str(i)).inc()
        self.generated.labels(segment).inc(stats.num_new_tokens)
        counters.tokens += stats.num_new_tokens
        counters.decode_seconds += stats.total_seconds

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
