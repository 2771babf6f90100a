"""The journaled reports as decisions see them: counts on top of the snapshot until the snapshot holds them.

While Redis is down, a report goes to the local journal (storage/journal.py), and its counts are added here so
that decisions learn from it at once. When the journal is replayed into Redis, a report stays here until the
snapshot that includes it is installed, then it is taken off: never shown twice, never missed. A previous run's
journal is not read up front: its reports show up through the snapshot as they are replayed, never here.

Not thread-safe on its own: the learner calls it under the lock that also guards its snapshot, so that the
journal, the snapshot and this view change together (controller/decision/learner.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from controller.decision.counts import Aggregate, CostCounts, SegmentCounts
from controller.storage.report_increments import cost_increments, segment_increments
from controller.storage.store import Snapshot


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
        keeps it and retries). One no longer shown (a replay of an earlier copy took it) is left alone."""
        shown = self._shown.pop(report_id, 0)
        if not shown:
            return
        if shown > 1:
            self._shown[report_id] = shown - 1
        self._take_off(counts, Counter(counts.segments.keys()))

    def _take_off(self, counts: ReportCounts, naming: Counter[str]) -> None:
        """Reports leave the view (``counts``, which name each segment ``naming`` times): a segment another shown
        report still names has their increments taken off; one no other names leaves the view whole (no zeros left:
        it was never counted)."""
        kept = {}
        self._naming.subtract(naming)
        for segment, increments in counts.segments.items():
            if self._naming[segment] > 0:
                kept[segment] = increments
            else:
                del self._naming[segment]
                self.counts.segments.pop(segment, None)
        ReportCounts(kept, counts.costs).add_to(self.counts, weight=-1.0)
        clamp(self.counts, kept)

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

    def replayed_counts(self) -> Replayed:
        """What the replayed reports add up to, made without the learner's lock: only the refresh's thread replays
        (``replayed``) and installs (``snapshot_installed``), so the list does not move meanwhile (after an outage,
        hundreds of reports taken off one by one under the lock every Decide reads under stalled the event loop)."""
        return Replayed.of(self._replayed)

    def snapshot_installed(self, journal_empty: bool, replayed: Replayed | None = None) -> set[str]:
        """A snapshot that holds every replayed report (``replayed``: ``replayed_counts``, made beforehand) is in
        place: take those reports off. With the journal empty, nothing is left to show (and no rounding left by
        subtractions). Returns the segments whose counts moved."""
        if replayed is None:
            replayed = self.replayed_counts()
        del self._replayed[: replayed.reports]
        if journal_empty:
            moved = set(self.counts.segments)
            self.counts = Snapshot()
            self._shown.clear()
            self._replayed = []
            self._naming.clear()
            return moved
        if replayed.reports:
            self._take_off(replayed.counts, replayed.naming)
        return set(replayed.counts.segments)

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


@dataclass(frozen=True)
class Replayed:
    """Replayed reports' counts added up: ``reports`` of them, naming each segment ``naming`` times."""

    counts: ReportCounts
    naming: Counter[str]
    reports: int

    @classmethod
    def of(cls, parts: Sequence[ReportCounts]) -> Replayed:
        segments: dict[str, dict[str, float]] = {}
        costs: dict[str, float] = {}
        naming: Counter[str] = Counter()
        for part in parts:
            for segment, increments in part.segments.items():
                _add_into(segments.setdefault(segment, {}), increments)
            _add_into(costs, part.costs)
            naming.update(part.segments.keys())
        return cls(ReportCounts(segments, costs), naming, len(parts))


def _add_into(total: dict[str, float], increments: Mapping[str, float]) -> None:
    for name, value in increments.items():
        total[name] = total.get(name, 0.0) + value


def report_counts(aggregates: Sequence[Aggregate]) -> ReportCounts:
    served = [a for a in aggregates if not a.start_up_timings]  # the worker's: costs only, in no segment
    return ReportCounts(segment_increments(served), cost_increments(aggregates))


def clamp(snapshot: Snapshot, segments: Iterable[str] | None = None) -> None:
    """Counts left by subtractions can be off by a rounding error; one below zero is zero (never a negative count).
    ``segments``: only these segments' (and the costs), else every one's."""
    chosen = snapshot.segments.values() if segments is None else (snapshot.segments[s] for s in segments)
    for counts in chosen:
        for table in (counts.by_k, counts.positions, counts.counterfactual):
            for item in table.values():
                for f in fields(item):
                    if getattr(item, f.name) < 0:
                        setattr(item, f.name, 0.0)
        for hist in (*counts.calibration.values(), *counts.plain_step.values(), *counts.realised.values()):
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
