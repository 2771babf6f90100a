"""Prometheus metrics of the worker (served at /metrics), one registry per worker.

Names follow the glossary: drafted = proposed draft tokens, accepted = num_accepted, per draft position.

Segment names are the client's to choose, and every one would become a label value on every series labelled by
segment. So the label set is bounded as the controller bounds its segments: the first ``max_segments`` names
seen keep their own label, later ones are counted under ``_overflow`` (the default segment and the classifier's
labels always keep theirs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from decoder.drafters.suffix_cache import CacheStats
from decoder.runners.base import ForwardPass
from decoder.runners.graphed import GraphPass
from decoder.telemetry import RequestStats
from decoder.worker.scheduler import StepObservation
from decoder.worker.segments import CLASSIFIER_SEGMENTS
from specd_api.position_tally import PositionTally
from specd_api.segments import OVERFLOW_SEGMENT
from specd_client import ClientStats

DEFAULT_MAX_SEGMENTS = 100


class SegmentLabels:
    """The segment label values the metrics may carry: ``reserved`` ones, the first ``max_segments`` other names
    seen, and ``_overflow`` for the rest. A name keeps the label it got first."""

    def __init__(self, max_segments: int = DEFAULT_MAX_SEGMENTS, reserved: Iterable[str] = CLASSIFIER_SEGMENTS) -> None:
        self.max_segments = max_segments
        self.reserved = frozenset(reserved)
        self._admitted: set[str] = set()

    def label(self, segment: str) -> str:
        if segment in self.reserved or segment in self._admitted:
            return segment
        if len(self._admitted) < self.max_segments:
            self._admitted.add(segment)
            return segment
        return OVERFLOW_SEGMENT


class BySegment:
    """A labelled Prometheus metric whose first label is a segment, passed through ``SegmentLabels``."""

    def __init__(self, metric: Counter, segments: SegmentLabels) -> None:
        self.metric, self.segments = metric, segments

    def labels(self, segment: str, *rest: str) -> Counter:
        return self.metric.labels(self.segments.label(segment), *rest)

    def collect(self) -> Iterable[Metric]:
        return self.metric.collect()


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
    def __init__(self, max_segments: int = DEFAULT_MAX_SEGMENTS, reserved: Iterable[str] = CLASSIFIER_SEGMENTS) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.segments = segments = SegmentLabels(max_segments, reserved)

        def segment_counter(name: str, documentation: str, labels: list[str]) -> BySegment:
            return BySegment(Counter(name, documentation, ["segment", *labels], registry=r), segments)

        self.requests = segment_counter("specd_requests", "Requests finished", ["status"])
        self.rounds = segment_counter("specd_rounds", "Draft + verify rounds", ["drafter"])
        self.drafted = segment_counter("specd_draft_tokens", "Draft tokens proposed", ["drafter"])
        self.accepted = segment_counter("specd_accepted_tokens", "Draft tokens accepted", ["drafter"])
        self.position_proposed = segment_counter(
            "specd_position_proposed", "Rounds with a draft token at this position", ["drafter", "position"]
        )
        self.position_accepted = segment_counter(
            "specd_position_accepted", "Rounds that accepted the draft token at this position", ["drafter", "position"]
        )
        self.generated = segment_counter("specd_generated_tokens", "Tokens generated", [])
        self.decisions = segment_counter(
            "specd_decisions", "Decisions used, by drafter and reason", ["drafter", "reason", "source"]
        )
        self.fallbacks = Counter("specd_controller_fallbacks", "Decisions made without the controller", ["reason"],
                                 registry=r)  # fmt: skip
        self.rejected = Counter("specd_rejected_requests", "Requests refused before decoding", ["reason"], registry=r)
        self.client_segments_ignored = Counter(
            "specd_worker_client_segments_ignored", "Requests that named a segment this worker had no place for "
            "(client_segments.max_names, or the address's max_names_per_host), served under the segment the worker "
            "inferred", registry=r,
        )  # fmt: skip
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
        self.suffix_outputs = Gauge("specd_suffix_cache_outputs", "Outputs the suffix cache holds", registry=r)
        self.suffix_bytes = Gauge("specd_suffix_cache_bytes", "Bytes the suffix cache holds (as it counts them)",
                                  registry=r)  # fmt: skip
        self.suffix_segments = Gauge("specd_suffix_cache_segments", "Segments with outputs in the suffix cache",
                                     registry=r)  # fmt: skip
        self.forward_pass = Gauge(
            "specd_forward_pass_info", "The target's forward pass (1): runner, dtype, and what runs its products",
            ["runner", "dtype", "kernel"], registry=r,
        )  # fmt: skip
        self.by_segment: dict[str, SegmentCounters] = {}

    def observe_forward_pass(self, forward: ForwardPass) -> None:
        self.forward_pass.labels(forward.name, forward.dtype_name, forward.kernel).set(1)

    def watch_forward_passes(self, passes: Mapping[str, ForwardPass]) -> None:
        """Export, by model ("target", "draft"), the passes outside the graphs pass's buckets (read at each scrape;
        the other passes have no buckets and export nothing)."""
        self.registry.register(OutsideBucketsCollector(passes))

    def watch_client(self, stats: Callable[[], ClientStats]) -> None:
        """Export the controller client's telemetry counters (read at each scrape)."""
        self.registry.register(ClientCollector(stats))

    def observe_step(self, step: StepObservation) -> None:
        self.batch_size.set(step.batch_size)
        self.step_batch.observe(step.batch_size)
        self.step_seconds.observe(step.seconds)

    def observe_suffix_cache(self, stats: CacheStats) -> None:
        self.suffix_outputs.set(stats.outputs)
        self.suffix_bytes.set(stats.bytes)
        self.suffix_segments.set(stats.segments)

    def observe_request(self, segment: str, status: str, stats: RequestStats | None, seconds: float) -> None:
        self.requests.labels(segment, status).inc()
        self.request_seconds.observe(seconds)
        counters = self.by_segment.setdefault(self.segments.label(segment), SegmentCounters())
        counters.requests += 1
        if stats is None:
            return
        positions: dict[str, PositionTally] = {}  # by drafter
        for round_ in stats.rounds:
            drafter = round_.drafter if round_.k > 0 else "none"
            self.rounds.labels(segment, drafter).inc()
            counters.rounds[drafter] = counters.rounds.get(drafter, 0) + 1
            if round_.num_drafted:
                self.drafted.labels(segment, drafter).inc(round_.num_drafted)
                self.accepted.labels(segment, drafter).inc(round_.num_accepted)
                counters.proposed[drafter] = counters.proposed.get(drafter, 0) + round_.num_drafted
                counters.accepted[drafter] = counters.accepted.get(drafter, 0) + round_.num_accepted
            positions.setdefault(drafter, PositionTally()).add(round_.num_drafted, round_.num_accepted)
        for drafter, tally in positions.items():
            for i, (proposed, accepted) in enumerate(tally.proposed_and_accepted()):
                self.position_proposed.labels(segment, drafter, str(i)).inc(proposed)
                if accepted:
                    self.position_accepted.labels(segment, drafter, str(i)).inc(accepted)
        self.generated.labels(segment).inc(stats.num_new_tokens)
        counters.tokens += stats.num_new_tokens
        counters.decode_seconds += stats.total_seconds

    def bound_segments(self, max_segments: int, reserved: Iterable[str]) -> None:
        """Set the label cap from the config (before serving: names already seen keep their labels)."""
        self.segments.max_segments = max_segments
        self.segments.reserved = frozenset(reserved)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class OutsideBucketsCollector(Collector):
    """``specd_forward_pass_outside_buckets_total{model, reason}``: a graphs pass's passes that fit no captured bucket
    (a prefill longer than K_max+1 tokens, more rows than the largest batch bucket), run as several bucket-shaped
    steps (decoder/runners/buckets.py). Steady decoding counts none; a growing count at batch 1 is prefills."""

    def __init__(self, passes: Mapping[str, ForwardPass]) -> None:
        self.passes = {model: forward for model, forward in passes.items() if isinstance(forward, GraphPass)}

    def collect(self) -> Iterator[Metric]:
        if not self.passes:
            return
        family = CounterMetricFamily(
            "specd_forward_pass_outside_buckets",
            "Passes outside the graphs pass's buckets, run as several bucket-shaped steps",
            labels=["model", "reason"],
        )
        for model, forward in self.passes.items():
            for reason, count in forward.outside_buckets.items():
                family.add_metric([model, reason], count)
        yield family


class ClientCollector(Collector):
    """The controller client's counters at scrape time: what the controller acknowledged, what is waiting, what was
    lost. Rounds decoded (``specd_rounds_total``) minus rounds acknowledged minus those waiting is what a crash of
    this worker would lose."""

    def __init__(self, stats: Callable[[], ClientStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield CounterMetricFamily("specd_telemetry_reports", "Reports the controller acknowledged", s.reports_sent)
        yield CounterMetricFamily(
            "specd_telemetry_aggregates_acknowledged", "Aggregates the controller acknowledged", s.aggregates_sent
        )
        yield CounterMetricFamily(
            "specd_telemetry_rounds_acknowledged", "Served rounds the controller acknowledged (stored in Redis or its "
            "journal)", s.rounds_acknowledged,
        )  # fmt: skip
        yield CounterMetricFamily(
            "specd_telemetry_aggregates_dropped", "Aggregates lost: buffer overflow, refused, or unsent at close",
            s.aggregates_dropped,
        )  # fmt: skip
        yield CounterMetricFamily("specd_telemetry_send_failures", "ReportRounds attempts that failed (retried)",
                                  s.send_failures)  # fmt: skip
        yield CounterMetricFamily(
            "specd_telemetry_reports_held", "ReportRounds attempts a busy controller held for their retry (retried; "
            "not failures)", s.reports_held,
        )  # fmt: skip
        yield GaugeMetricFamily("specd_telemetry_buffered_aggregates", "Aggregates waiting to be sent", s.buffered)
        yield CounterMetricFamily(
            "specd_local_decisions", "Decisions answered from the pushed decision tables", s.local_decisions
        )
