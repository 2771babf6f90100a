"""The journaled reports as decisions see them: counts on top of the snapshot until the snapshot holds them.

While Redis is down, a report goes to the local journal (controller/journal.py), and its counts are added here so
that decisions learn from it at once. When the journal is replayed into Redis, a report stays here until the
snapshot that includes it is installed, then it is taken off: never shown twice, never missed. A previous run's
journal is not read up front: its reports show up through the snapshot as they are replayed, never here.

Not thread-safe on its own: the learner calls it under the lock that also guards its snapshot, so that the
journal, the snapshot and this view change together (controller/learner.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from controller.counts import Aggregate, CostCounts, SegmentCounts
from controller.report_increments import cost_increments, segment_increments
from controller.store import Snapshot


class JournaledView:
    """Counts of the reports this run journaled and the snapshot does not hold yet."""

    def __init__(self) -> None:
        self.counts = Snapshot()  # the journaled reports' counts: segments and costs
        self._shown: dict[str, int] = {}  # report id -> times journaled (a worker's retry may journal it twice)
        self._replayed: list[ReportCounts] = []  # sent to Redis, not yet in an installed snapshot
        self._naming: Counter[str] = Counter()  # segment -> the reports shown here that name it

    def journaled(self, report_id: str, counts: ReportCounts) -> set[str]:
        """A report went to the journal: show its counts. Returns the segments whose counts moved."""
        counts.add_to(self.counts)
        self._shown[report_id] = self._shown.get(report_id, 0) + 1
        self._naming.update(counts.segments.keys())
        return set(counts.segments)

    def withdrawn(self, report_id: str, counts: ReportCounts) -> None:
        """A report shown by ``journaled`` could not be written to the journal after all: take it off (the worker
        keeps it and retries)."""
        shown = self._shown.pop(report_id, 0)
        if shown > 1:
            self._shown[report_id] = shown - 1
        ReportCounts(self._unnamed(counts), counts.costs).add_to(self.counts, weight=-1.0)
        clamp(self.counts)

    def _unnamed(self, counts: ReportCounts) -> dict[str, dict[str, float]]:
        """A report leaves the view: its segments that another shown report names (their increments, to take off);
        a segment no other names leaves the view whole (no zeros left: it was never counted)."""
        kept = {}
        self._naming.subtract(counts.segments.keys())
        for segment, increments in counts.segments.items():
            if self._naming[segment] > 0:
                kept[segment] = increments
            else:
                del self._naming[segment]
                self.counts.segments.pop(segment, None)
        return kept

    def shows(self, report_id: str) -> bool:
        """Is the report shown here (journaled by this run, not yet replayed as many times)?"""
        return report_id in self._shown

    def replayed(self, report_id: str, counts: ReportCounts) -> None:
        """A journaled report is in Redis now: its counts leave this view with the next installed snapshot (a
        previous run's report was never shown, and is ignored)."""
        shown = self._shown.pop(report_id, 0)
        if not shown:
            return
        if shown > 1:  # journaled twice, stored once: shown twice until both copies are replayed
            self._shown[report_id] = shown - 1
        self._replayed.append(counts)

    def snapshot_installed(self, journal_empty: bool) -> set[str]:
        """A snapshot that holds every replayed report is in place: take those reports off. With the journal empty,
        nothing is left to show (and no rounding left by subtractions). Returns the segments whose counts moved."""
        if journal_empty:
            moved = set(self.counts.segments)
            self.counts = Snapshot()
            self._shown.clear()
            self._replayed = []
            self._naming.clear()
            return moved
        moved = set()
        for counts in self._replayed:
            ReportCounts(self._unnamed(counts), counts.costs).add_to(self.counts, weight=-1.0)
            moved |= set(counts.segments)
        if self._replayed:
            clamp(self.counts)
        self._replayed = []
        return moved

    def segment(self, segment: str) -> SegmentCounts | None:
        return self.counts.segments.get(segment)

    def segments(self) -> set[str]:
        return set(self.counts.segments)

    def costs(self) -> CostCounts:
        return self.counts.costs


@dataclass(frozen=True)
class ReportCounts:
    """What a report adds to the counts: the increments the store would write to Redis (report_increments.py), per
    segment and to the costs. Made from the aggregates alone (``report_counts``): tens of milliseconds for a report at
    the bounds, which the learner spends before it takes its lock (every Decide reads under it); adding them is
    a few dictionary updates."""

    segments: dict[str, dict[str, float]]
    costs: dict[str, float]

    def add_to(self, snapshot: Snapshot, weight: float = 1.0) -> None:
        for segment, increments in self.segments.items():
            snapshot.segments.setdefault(segment, SegmentCounts()).add_fields(increments, weight)
        snapshot.costs.add_fields(self.costs, weight)


def report_counts(aggregates: Sequence[Aggregate]) -> ReportCounts:
    served = [a for a in aggregates if not a.calibration]  # the worker's start-up timings: costs only, in no segment
    return ReportCounts(segment_increments(served), cost_increments(aggregates))


def clamp(snapshot: Snapshot) -> None:
    """Counts left by subtractions can be off by a rounding error; one below zero is zero (never a negative count)."""
    for counts in snapshot.segments.values():
        for table in (counts.by_k, counts.positions, counts.counterfactual):
            for item in table.values():
                for f in fields(item):
                    if getattr(item, f.name) < 0:
                        setattr(item, f.name, 0.0)
        for hist in (*counts.calibration.values(), *counts.plain_step.values()):
            _clamp_values(hist)
    costs = snapshot.costs
    for values in (costs.draft_s, costs.drafted, costs.verify_s, costs.verify_rounds):
        _clamp_values(values)
    for histograms in (costs.draft_hist, costs.verify_hist):
        for hist in histograms.values():
            _clamp_values(hist)


def _clamp_values(values: MutableMapping[Any, float]) -> None:
    for key, value in values.items():
        if value < 0:
            values[key] = 0.0
