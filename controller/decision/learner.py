"""The controller's memory: what it knows per segment, kept fresh from Redis, and still there when Redis
is not.

Reports go to Redis (one atomic script each) or, while Redis is unreachable, to the local journal; both
count as stored, so a report is acknowledged only after one of them succeeded (contract 3). Decisions read
a snapshot refreshed in the background, never Redis itself. While Redis is down the snapshot is kept,
journaled reports are added on top, and answers are marked stale; once Redis answers again the journal is
replayed (deduplicated by report id) and the snapshot catches up.

All journal work happens in ``refresh`` (the daemon's background loop, after it listens), a bounded slice of replay
per call. A report this run journaled is taken off the journaled view when the snapshot that includes it is
installed, so it is never shown twice or missed. What a previous run left in the journal is not read up front (at
16 MiB that is seconds of CPU): it shows up through the snapshot as it is replayed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from controller.decision.cost_model import BucketCosts, CostModel, build_cost_model, costs_moved
from controller.decision.counts import Aggregate, CostCounts, SegmentCounts
from controller.decision.decide import component_histogram
from controller.decision.drift_watch import DriftAlarm, DriftWatch
from controller.decision.prior import PriorModel, train_prior
from controller.decision.realised import plain_reference
from controller.decision.timing_histogram import add_into, median, total
from controller.pacing import Pacer
from controller.storage.journal import Journal, JournalFull, entry
from controller.storage.journaled_view import JournaledView, report_counts
from controller.storage.store import IngestResult, Snapshot, TelemetryStore
from specd_api.modes import GREEDY, MODES, Mode, mode_of
from specd_api.plan import DRAFTERS, batch_bucket
from specd_api.segments import OVERFLOW_SEGMENT

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
        self._journaled = JournaledView()  # journaled reports, shown on top of the snapshot until it holds them
        self._stale = True  # until the first successful refresh
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()  # one refresh at a time (the loop, and shutdown's last one)
        self._appending = 0  # reports shown in the journaled view and being written to the journal (under _lock)
        self._last_prior_fit = 0.0
        self.last_refit: object | None = None  # where the last refit ran: another process's answer, or this one
        self.cost_model = CostModel()
        self._versioned_costs = self.cost_model  # the model when ``costs_version`` last moved
        # Versions move only when what decisions read moved (a refresh that read the same data leaves them): the
        # learner's as a whole, each segment's counts, and the cost model. Caches and decision tables key on them.
        self.version = 0
        self.costs_version = 0
        self._segment_versions: dict[str, int] = {}
        # Each segment's counts by what they are made of, not by when they are decayed to: moves with a report (or a
        # bucket leaving the window, a new drift regime), not at a decay step. Decision tables follow a decay-only
        # move a few steps late (table_publisher.TABLE_DECAY_STEPS), and never all at once.
        self._data_versions: dict[str, int] = {}
        self.decay_steps = 0  # decay steps this learner's snapshots have crossed
        self._prior_document: dict[str, Any] | None = None
        self.registry = CollectorRegistry()
        self.drift_watch = DriftWatch(self.registry, store.config.bucket_seconds, store.config.window_buckets)
        # (figure, drafter, version) -> the figure over every segment (acceptance, calibration), of this version and
        # the one before
        self._fleet: dict[tuple[str, str, Mode, int], tuple[float, float]] = {}  # (figure, drafter, mode, version)
        self._version_lock = threading.Lock()  # one move of the version at a time (the refresh's, a journaled report's)

    # --- telemetry in -------------------------------------------------------------------------------

    def report(self, report_id: str, aggregates: Sequence[Aggregate]) -> ReportOutcome:
        """Store a report in Redis, or in the journal when Redis fails. Raises JournalFull when neither can."""
        if not len(self.journal):  # with a backlog, new reports queue behind it to keep the order
            try:
                result: IngestResult = self.store.ingest(report_id, aggregates, self.step_seconds)
                return ReportOutcome(result.rounds, result.duplicate, journaled=False)
            except redis.RedisError as e:
                log.warning("Redis rejected a report (%s); journaling it", e)
                self._stale = True
        # Every Decide reads the counts under the lock, so nothing slow happens under it (a report's encoding,
        # counting and fsync take up to 214 ms at the bounds, which every Decide would wait for). The entry and
        # the counts are made before it; the report is shown, then written and synced with the lock free. Meanwhile
        # ``_appending`` keeps a refresh from taking it off the view, and a replay can only find it in the file once
        # it is shown: never missed, never shown twice (controller/storage/journaled_view.py).
        data, counts = entry(report_id, aggregates), report_counts(aggregates)
        with self._lock:
            moved = self._journaled.journaled(report_id, counts)
            self._moved(moved)
            self._appending += 1
        try:
            self.journal.append_entry(data)
        except JournalFull:
            with self._lock:  # not stored: off the view again
                self._journaled.withdrawn(report_id, counts)
                self._moved(moved)
            self._install_cost_model()  # what a move meanwhile computed with it is computed again
            self._next_version()
            raise
        finally:
            with self._lock:
                self._appending -= 1
        self._install_cost_model()
        self._next_version()
        return ReportOutcome(sum(a.rounds for a in aggregates), duplicate=False, journaled=True)

    # --- background work ----------------------------------------------------------------------------

    def refresh(self, replay_seconds: float | None = None) -> bool:
        """Replay the journal for up to ``replay_seconds`` (None: all of it), then re-read the snapshot. Returns
        False (and marks stale) on Redis errors."""
        with self._refresh_lock:
            if len(self.journal):
                until = None if replay_seconds is None else time.monotonic() + replay_seconds
                try:
                    sent = self.journal.replay(self._send_journaled, until)
                except redis.RedisError as e:
                    return self._unreachable(e)
                if sent:
                    log.info("replayed %d journaled reports into Redis (%d left)", sent, len(self.journal))
            return self._refresh_snapshot()

    def refresh_snapshot(self) -> bool:
        """Re-read the snapshot only, no replay (the daemon's start-up, before it listens)."""
        with self._refresh_lock:
            return self._refresh_snapshot()

    def refit_prior(self, elsewhere: Callable[[int], object | None] | None = None) -> None:
        """Retrain the prior from the stored samples when it is due, and store it (the next refresh loads it). The
        daemon calls this once before it listens, then in a loop of its own: training (and importing scikit-learn)
        takes seconds, which must not hold up the refresh (replay, Redis health). ``elsewhere`` does the work in
        another process (the daemon's niced report process: ``ReportProcess.refit_prior``, given the samples to
        read; its answer is kept in ``last_refit``), so that it never competes with a decode at normal priority;
        when it cannot (None), this process does. A Redis error waits for the next due time; the refresh reports
        the outage."""
        if self.clock() - self._last_prior_fit < self.prior_retrain_seconds:
            return
        if elsewhere is not None:
            done = elsewhere(self.store.config.samples_max)
            if done is not None:
                self._last_prior_fit, self.last_refit = self.clock(), done
                return
        try:
            self._refit_prior()
            self.last_refit = "in the daemon"
        except redis.RedisError as e:
            log.debug("prior not refitted, Redis did not answer: %s", e)

    def costs_at(self, batch_size: int, segment: str) -> BucketCosts:
        """The fleet's costs at ``batch_size`` for the sampling mode of the learning segment ``segment``."""
        return self.cost_model.at(batch_size, mode_of(segment))

    def step_seconds(self, segment: str, batch_size: int) -> float:
        """A plain step's seconds at ``batch_size`` in the learning segment ``segment`` (0: not measured), what its
        requests' realised speedups are read at: the one reference decisions read them at too
        (``realised.plain_reference``: the segment's own plain rounds, shrunk towards the fleet's of its mode; a plain
        step grows with the context, and segments differ in theirs)."""
        own = self.segment_counts(segment).plain_step.get(batch_bucket(batch_size), {})
        return plain_reference(own, self.costs_at(batch_size, segment).step_seconds)

    def _send_journaled(self, report_id: str, aggregates: list[Aggregate]) -> None:
        self.store.ingest(report_id, aggregates, self.step_seconds)
        with self._lock:
            shown = self._journaled.shows(report_id)  # only replay (this thread) takes a report off the view
        if shown:  # its counts made outside the lock, as report() made them
            counts = report_counts(aggregates)
            with self._lock:
                self._journaled.replayed(report_id, counts)

    def _unreachable(self, error: redis.RedisError) -> bool:
        if not self._stale:
            log.warning("Redis unreachable (%s); answering from memory, marked stale", error)
        self._stale = True
        return False

    def _refresh_snapshot(self) -> bool:
        try:
            segments = self.store.active_segments()
            snapshot = self.store.read_snapshot(segments, self.drift_watch.regime, self._snapshot)
            if self.drift_watch.watch(snapshot):  # a new regime began: count only its traffic from now on
                snapshot = self.store.read_snapshot(segments, self.drift_watch.regime, self._snapshot)
            stored_prior = self.store.read_prior()
        except redis.RedisError as e:
            return self._unreachable(e)
        moved = _changed_segments(self._snapshot, snapshot)  # outside the lock: only a refresh replaces the snapshot
        decayed = {s for s in moved if _decayed_only(self._snapshot, snapshot, s)}
        stepped = _steps_between(self._snapshot.decay_at, snapshot.decay_at, self.store.config.decay_step_seconds)
        replayed = self._journaled.replayed_counts()  # added up before the lock (this thread alone replays)
        with self._lock:  # report() journals under this lock too: the journal and the view change together
            self._snapshot = snapshot
            self.decay_steps += stepped
            # The replayed reports are in this snapshot now: they leave the journaled view; what is still journaled
            # (reports that arrived during the replay) stays on top.
            journaled = self._journaled.snapshot_installed(
                journal_empty=not len(self.journal) and not self._appending, replayed=replayed
            )
            self._stale = False
            self._moved(moved | journaled, decayed - journaled)
        changed = bool(moved) | self._install_cost_model()
        if stored_prior is not None and stored_prior != self._prior_document:
            try:
                self.prior = PriorModel.from_json(stored_prior)
                changed = True
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring an unreadable prior model in Redis: %s", e)
            self._prior_document = stored_prior
        if changed:
            self._next_version()
        return True

    def _moved(self, segments: AbstractSet[str], decayed: AbstractSet[str] = frozenset()) -> None:
        """Count a change of these segments' counts (under ``_lock``); of ``decayed``, only their decay moved."""
        for segment in segments:
            self._segment_versions[segment] = self._segment_versions.get(segment, 0) + 1
            if segment not in decayed:
                self._data_versions[segment] = self._data_versions.get(segment, 0) + 1

    def _install_cost_model(self) -> bool:
        """Rebuild the cost model from the counts; True (and a new ``costs_version``) if a cost that decisions read
        moved past ``COSTS_TOLERANCE`` since the version last moved (``costs_moved``): the tables are rebuilt then,
        and ``Decide`` reads the model rebuilt every time. The timings behind each median (what a Thompson draw reads
        its spread from) count as moved when the median does."""
        model = build_cost_model(self.costs())
        self.cost_model = model
        moved = costs_moved(self._versioned_costs, model)
        if moved:
            self.costs_version += 1
            self._versioned_costs = model
        return moved

    def drift(self, segment: str) -> list[DriftAlarm]:
        """The segment's active drift alarms."""
        return self.drift_watch.alarms(segment)

    def _refit_prior(self) -> None:
        self._last_prior_fit = self.clock()
        model = train_prior(self.store.read_samples(self.store.config.samples_max))
        if model is not None:
            self.store.save_prior(model.to_json())

    # --- reads for decisions ------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        return self._stale

    @property
    def decay_position(self) -> float:
        """The decay steps crossed (``decay_steps``) plus the share of the current step's period that had passed at
        the last refresh's read, in [0, 1): it moves at every refresh, so that work keyed on it (a table's decay
        epoch) can turn at any refresh, spread over a step's period, rather than all of it at the step."""
        snapshot, step = self._snapshot, self.store.config.decay_step_seconds
        if snapshot.decay_at is None or not step > 0:
            return float(self.decay_steps)
        return self.decay_steps + min(max((snapshot.taken_at - snapshot.decay_at) / step, 0.0), 0.999999)

    def tracked_segment(self, segment: str) -> str:
        """The segment whose counts describe ``segment``: itself, or the overflow segment once the cap on
        distinct segments is reached and ``segment`` is not among those tracked (the store counts it there)."""
        with self._lock:
            if self._counted(segment):
                return segment
            return OVERFLOW_SEGMENT if len(self._snapshot.segments) >= self.store.config.max_segments else segment

    def counted(self, segment: str) -> bool:
        """Has any report named ``segment`` (stored, or journaled while Redis is away)?"""
        with self._lock:
            return self._counted(segment)

    def _counted(self, segment: str) -> bool:  # under _lock
        return segment in self._snapshot.segments or self._journaled.segment(segment) is not None

    def fleet_acceptance(self, drafter: str, mode: Mode = GREEDY) -> tuple[float, float]:
        """(accepted, verified) of ``drafter`` over every learning segment of sampling ``mode``, every position,
        served and scored: the fleet's evidence (computed once per version, ``_next_version``). Each mode's is its
        own: a sampled draft token is accepted with min(1, p/q), a greedy one only when it is the argmax."""
        return self._over_the_fleet(("acceptance", drafter, mode))

    def fleet_calibration(self, drafter: str, mode: Mode = GREEDY) -> tuple[float, float]:
        """(median realised / expected speedup, requests) of ``drafter`` over the requests of every learning segment
        of sampling ``mode``: where a segment's own calibration starts (computed once per version)."""
        return self._over_the_fleet(("calibration", drafter, mode))

    def _over_the_fleet(self, key: tuple[str, str, Mode]) -> tuple[float, float]:
        """A fleet figure (``FLEET_FIGURES``) over one mode's segments' counts, as of this version of the learner."""
        version = self.version
        cached = self._fleet.get((*key, version))
        if cached is not None:
            return cached
        result = FLEET_FIGURES[key[0]](self._fleet_tables(key[2]), key[1])  # a drafter no version computed ahead
        self._fleet[(*key, version)] = result
        return result

    def _fleet_tables(self, mode: Mode) -> list[SegmentCounts]:
        """Every learning segment's counts of sampling ``mode``: the snapshot's (replaced, never changed) and copies
        of the journaled view's (a report journaled meanwhile changes those in place)."""
        with self._lock:
            kept = [c for name, c in self._snapshot.segments.items() if mode_of(name) == mode]
            journaled = [c for name, c in self._journaled.counts.segments.items() if mode_of(name) == mode]
        return [*kept, *map(_copy, journaled)]

    def _next_version(self) -> None:
        """Move the version, with the fleet's figures for every drafter computed first: at 1,000 segments they take
        7 ms, which the first Decide after each move would pay, on the event loop. A Decide never computes them
        (only for a drafter name no plan has)."""
        with self._version_lock:
            version = self.version + 1
            pace = Pacer()
            for mode in MODES:
                tables = self._fleet_tables(mode)
                for drafter in DRAFTERS:
                    for figure, compute in FLEET_FIGURES.items():
                        pace()
                        self._fleet[(figure, drafter, mode, version)] = compute(tables, drafter)
            self.version = version
            # the version before stays: a Decide that read it just before the move still finds its figures
            for key in list(self._fleet):
                if key[3] < version - 1:
                    self._fleet.pop(key, None)

    def segment_version(self, segment: str) -> int:
        """Moves whenever the segment's counts (``segment_counts``) change, and only then."""
        with self._lock:
            return self._segment_versions.get(segment, 0)

    def data_version(self, segment: str) -> int:
        """Moves whenever the segment's counts change for another reason than a decay step (a report, a bucket
        leaving the window, a new drift regime)."""
        with self._lock:
            return self._data_versions.get(segment, 0)

    def segments(self) -> list[str]:
        with self._lock:
            return sorted(set(self._snapshot.segments) | self._journaled.segments())

    def segment_counts(self, segment: str) -> SegmentCounts:
        """The segment's counts (read-only: shared with other readers when nothing is pending)."""
        return self.versioned_counts(segment)[1]

    def versioned_counts(self, segment: str) -> tuple[int, SegmentCounts]:
        """The segment's version and counts, read together (a cache keyed by the version holds these counts)."""
        with self._lock:
            version = self._segment_versions.get(segment, 0)
            base, pending = self._snapshot.segments.get(segment), self._journaled.segment(segment)
            if pending is None:
                return version, base or SegmentCounts()
            merged = _copy(pending)  # under the lock: a report journaled meanwhile changes it in place
        if base is not None:
            merged.add(base)
        return version, merged

    def costs(self) -> CostCounts:
        merged = CostCounts()
        with self._lock:
            merged.add(self._snapshot.costs)
            merged.add(self._journaled.costs())
        return merged


def _steps_between(before: float | None, after: float | None, step_seconds: float) -> int:
    """The decay steps from one snapshot's decay time to the next's (several when refreshes failed meanwhile)."""
    if before is None or after is None or after <= before:
        return 0
    return max(round((after - before) / step_seconds), 1) if step_seconds > 0 else 1


def _decayed_only(old: Snapshot, new: Snapshot, segment: str) -> bool:
    """Did only the segment's age move from ``old`` to ``new``: its counts decayed to another step, made of the same
    buckets' fields less those that left the window at its old end? A bucket leaves at a decay step, as the
    oldest and least weighted in the window (2^-(window / half-life) of a current one: 1/64 at the defaults), and
    with every bucket of the window filled, every segment loses one at every step. One that loses its last bucket
    has changed (it has no counts left)."""
    before, after = old.sources.get(segment), new.sources.get(segment)
    if before is None or after is None or before[0] == after[0] or before[1] != after[1]:
        return False
    kept, earlier = after[2], before[2]
    return bool(kept) and earlier.ends_with(kept)


def _changed_segments(old: Snapshot, new: Snapshot) -> set[str]:
    """The segments whose counts are not those of the previous snapshot (the store keeps a segment's counts object
    while its fields and the decay step stay the same: the decay is read once a bucket)."""
    return {s for s in old.segments.keys() | new.segments.keys() if old.segments.get(s) is not new.segments.get(s)}


def fleet_acceptance(tables: list[SegmentCounts], drafter: str) -> tuple[float, float]:
    """(accepted, verified) of ``drafter`` over ``tables``, every position, served and scored."""
    accepted = verified = 0.0
    for counts in tables:
        for table in (counts.positions, counts.counterfactual):
            for (d, _), p in table.items():
                if d == drafter:
                    accepted, verified = accepted + p.accepted, verified + p.verified
    return accepted, verified


def fleet_calibration(tables: list[SegmentCounts], drafter: str) -> tuple[float, float]:
    """(median realised / model speedup, requests) of ``drafter``'s cost component (a chain's is the draft model's:
    the draft's and the chain's requests together) over ``tables``."""
    merged: dict[int, float] = {}
    for counts in tables:
        add_into(merged, component_histogram(counts.calibration, drafter))
    return median(merged), total(merged)


FLEET_FIGURES: dict[str, Callable[[list[SegmentCounts], str], tuple[float, float]]] = {
    "acceptance": fleet_acceptance,
    "calibration": fleet_calibration,
}


def _copy(counts: SegmentCounts) -> SegmentCounts:
    copy = SegmentCounts()
    copy.add(counts)
    return copy
