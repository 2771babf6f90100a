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

from controller.cost_model import CostModel, build_cost_model
from controller.counts import Aggregate, CostCounts, SegmentCounts
from controller.journal import Journal
from controller.prior import PriorModel, train_prior
from controller.segments import OVERFLOW_SEGMENT
from controller.store import IngestResult, Snapshot, TelemetryStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportOutcome:
    rounds: int
    duplicate: bool
    journaled: bool


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
            snapshot = self.store.read_snapshot(self.store.active_segments())
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
