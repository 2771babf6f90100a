"""The controller's memory: what it knows per segment, kept fresh from Redis, and still there when Redis
is not.

Reports go to Redis (one atomic script each) or, while Redis is unreachable, to the local journal; both
count as stored, so a report is acknowledged only after one of them succeeded (contract 3). Decisions read
a snapshot refreshed in the background, never Redis itself. While Redis is down the snapshot is kept,
journaled reports are added on top, and answers are marked stale; once Redis answers again the journal is
replayed (deduplicated by report id) and the snapshot catches up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge

from controller.cost_model import CostModel, build_cost_model
from controller.counts import Aggregate, CostCounts, SegmentCounts
from controller.drift import page_hinkley
from controller.journal import Journal
from controller.prior import PriorModel, train_prior
from controller.store import IngestResult, Snapshot, TelemetryStore
from specd_api.segments import OVERFLOW_SEGMENT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportOutcome:
    rounds: int
    duplicate: bool
    journaled: bool


@dataclass(frozen=True)
class DriftAlarm:
    """An active α drift alarm of one segment and drafter (controller.drift)."""

    segment: str
    drafter: str
    direction: str  # "down" | "up"
    since_unix: float  # start of the bucket the new regime began in
    raised_unix: float
    alpha_before: float
    alpha_since: float


class DriftMetrics:
    """Prometheus series of the drift alarms (segments are capped by the store, so the label set is bounded)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.raised = Counter(
            "specd_controller_alpha_drift_alarms", "α drift alarms raised", ["segment", "drafter", "direction"],
            registry=registry,
        )  # fmt: skip
        self.active = Gauge(
            "specd_controller_alpha_drift_active", "1 while a segment's α drift alarm is active",
            ["segment", "drafter"], registry=registry,
        )  # fmt: skip


class Learner:
    def __init__(
        self,
        store: TelemetryStore,
        journal: Journal,
        clock: Callable[[], float] = time.time,
        prior_retrain_seconds: float = 60.0,
    ) -> None:
        self.store = store
        self.journal = journal
        self.clock = clock
        self.prior_retrain_seconds = prior_retrain_seconds
        self.prior: PriorModel | None = None
        self._snapshot = Snapshot()
        self._pending = Snapshot()  # journaled reports, shown on top of the snapshot until replayed
        self._stale = True  # until the first successful refresh
        self._lock = threading.Lock()
        self._last_prior_fit = 0.0
        self.cost_model = CostModel()
        self.version = 0  # changes whenever what decisions read changes (snapshot, journal, prior)
        self.registry = CollectorRegistry()
        self.drift_metrics = DriftMetrics(self.registry)
        self._alarms: dict[tuple[str, str], DriftAlarm] = {}
        self._regime: dict[str, int] = {}  # segment -> first time bucket of its current regime (after a drift)

    # --- telemetry in -------------------------------------------------------------------------------

    def report(self, report_id: str, aggregates: Sequence[Aggregate]) -> ReportOutcome:
        """Store a report in Redis, or in the journal when Redis fails. Raises JournalFull when neither can."""
        if not len(self.journal):  # with a backlog, new reports queue behind it to keep the order
            try:
                result: IngestResult = self.store.ingest(report_id, aggregates)
                return ReportOutcome(result.rounds, result.duplicate, journaled=False)
            except redis.RedisError as e:
                log.warning("Redis rejected a report (%s); journaling it", e)
                self._stale = True
        with self._lock:  # the journal and its in-memory view change together
            self.journal.append(report_id, aggregates)
            _add_to(self._pending, aggregates)
        self.cost_model = build_cost_model(self.costs())
        self.version += 1
        return ReportOutcome(sum(a.rounds for a in aggregates), duplicate=False, journaled=True)

    # --- background work ----------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Replay the journal, then re-read the snapshot. Returns False (and marks stale) on Redis errors."""
        try:
            if len(self.journal):
                sent = self.journal.replay(self.store.ingest)
                log.info("replayed %d journaled reports into Redis", sent)
            segments = self.store.active_segments()
            snapshot = self.store.read_snapshot(segments, self._regime)
            if self._watch_drift(snapshot):  # a new regime began: count only its traffic from now on
                snapshot = self.store.read_snapshot(segments, self._regime)
            if self.clock() - self._last_prior_fit >= self.prior_retrain_seconds:
                self._refit_prior()
            stored_prior = self.store.read_prior()
        except redis.RedisError as e:
            if not self._stale:
                log.warning("Redis unreachable (%s); answering from memory, marked stale", e)
            self._stale = True
            return False
        with self._lock:
            self._snapshot = snapshot
            # What is still journaled (reports that arrived during the replay) stays on top; the rest is
            # now in the snapshot.
            self._pending = Snapshot()
            for _, aggregates in self.journal.entries():
                _add_to(self._pending, aggregates)
            self._stale = False
        self.cost_model = build_cost_model(self.costs())
        if stored_prior is not None:
            try:
                self.prior = PriorModel.from_json(stored_prior)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring an unreadable prior model in Redis: %s", e)
        self.version += 1
        return True

    def _watch_drift(self, snapshot: Snapshot) -> bool:
        """Run the drift test on each segment's current regime; True when an alarm moved a regime's start."""
        first_bucket = self.store.bucket(snapshot.taken_at) - self.store.config.window_buckets + 1
        moved = False
        for (segment, drafter), alarm in list(self._alarms.items()):  # a regime older than the window: all new
            if self.store.bucket(alarm.since_unix) < first_bucket or segment not in snapshot.series:
                del self._alarms[(segment, drafter)]
                self.drift_metrics.active.labels(segment, drafter).set(0)
        for segment in list(self._regime):
            if self._regime[segment] < first_bucket or segment not in snapshot.series:
                del self._regime[segment]
        for segment, by_drafter in snapshot.series.items():
            start = self._regime.get(segment, first_bucket)
            for drafter, series in by_drafter.items():
                drift = page_hinkley([point for point in series if point[0] >= start])
                if drift is None:
                    continue
                alarm = DriftAlarm(
                    segment, drafter, drift.direction, drift.since_bucket * self.store.config.bucket_seconds,
                    snapshot.taken_at, drift.alpha_before, drift.alpha_since,
                )  # fmt: skip
                log.warning(
                    "α drift in segment %s, drafter %s: %s from %.2f to %.2f since %s (the controller now learns "
                    "from this traffic only)", segment, drafter, alarm.direction, alarm.alpha_before,
                    alarm.alpha_since, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(alarm.since_unix)),
                )  # fmt: skip
                self._alarms[(segment, drafter)] = alarm
                self.drift_metrics.raised.labels(segment, drafter, alarm.direction).inc()
                self.drift_metrics.active.labels(segment, drafter).set(1)
                self._regime[segment] = max(self._regime.get(segment, first_bucket), drift.since_bucket)
                moved = True
        return moved

    def drift(self, segment: str) -> list[DriftAlarm]:
        """The segment's active drift alarms."""
        return [a for (s, _), a in sorted(self._alarms.items()) if s == segment]

    def _refit_prior(self) -> None:
        self._last_prior_fit = self.clock()
        model = train_prior(self.store.read_samples(self.store.config.samples_max))
        if model is not None:
            self.store.save_prior(model.to_json())

    # --- reads for decisions ------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        return self._stale

    def tracked_segment(self, segment: str) -> str:
        """The segment whose counts describe ``segment``: itself, or the overflow segment once the cap on
        distinct segments is reached and ``segment`` is not among those tracked (the store counts it there)."""
        with self._lock:
            known = self._snapshot.segments
            if segment in known or segment in self._pending.segments:
                return segment
            return OVERFLOW_SEGMENT if len(known) >= self.store.config.max_segments else segment

    def segments(self) -> list[str]:
        with self._lock:
            return sorted(set(self._snapshot.segments) | set(self._pending.segments))

    def segment_counts(self, segment: str) -> SegmentCounts:
        """The segment's counts (read-only: shared with other readers when nothing is pending)."""
        with self._lock:
            base, pending = self._snapshot.segments.get(segment), self._pending.segments.get(segment)
        if pending is None:
            return base or SegmentCounts()
        merged = SegmentCounts()
        for part in (base, pending):
            if part is not None:
                merged.add(part)
        return merged

    def costs(self) -> CostCounts:
        merged = CostCounts()
        with self._lock:
            merged.add(self._snapshot.costs)
            merged.add(self._pending.costs)
        return merged


def _add_to(snapshot: Snapshot, aggregates: Sequence[Aggregate]) -> None:
    for agg in aggregates:
        snapshot.segments.setdefault(agg.segment, SegmentCounts()).add_fields(agg.segment_fields())
        snapshot.costs.add_fields(agg.cost_fields())
