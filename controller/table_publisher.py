"""Decision tables pushed to workers (WatchDecisions): what each segment's requests get, per batch bucket, so that
a worker decides locally (``specd_api.table_rule``) and the controller leaves the hot path.

The tables are built once per refresh for each set of drafters that open streams watch, whatever the number of
streams, one build at a time; each stream then sends its worker only the segments whose table changed since its last
message. A build recomputes only the tables whose inputs moved (``table_key``: the segment's counts, the costs, the
policy, the priors, its hysteresis memory); the others are kept as they are, and their probe shares, drawn from a
generator seeded per segment and bucket, come out the same when a table is recomputed from the same inputs. A
segment enters the tables once its own rounds weigh at least as much as the prior (``prior_strength``): before
that, the request's features, which a table cannot see, still steer its decision, and the worker asks Decide.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.decide import Request
from controller.policy import DRAFTERS, Settings
from specd_api.v1 import controller_pb2 as pb

if TYPE_CHECKING:
    from controller.service import Controller

PROBE_DRAWS = 64  # decisions drawn per bucket and refresh to estimate the probes' shares (±6 % at a share of 0.1)
Drafters = tuple[str, ...]


class TooManyWatchers(Exception):
    """The controller holds ``max_watchers`` streams already."""


def table_min_new_tokens(settings: Settings) -> int:
    """Requests with fewer new tokens may get another plan than the table's (a capped K, or too short)."""
    deepest = max(max(settings.drafter(d).k_max for d in DRAFTERS), settings.force_k or 0)
    return max(settings.min_new_tokens, deepest + 1)


@dataclass(frozen=True)
class BuiltTable:
    table: pb.SegmentTable
    data: bytes  # the table's wire form: what a stream compares with what it sent
    key: tuple[object, ...]  # table_key once it was built


@dataclass
class PublisherStats:
    """What the builds did (read by tests and benchmarks)."""

    builds: int = 0  # passes over the segments of one drafter set
    tables_built: int = 0  # segment tables computed
    tables_kept: int = 0  # segment tables kept from the previous build: their inputs had not moved


def table_key(controller: Controller, segment: str, drafters: Drafters) -> tuple[object, ...]:
    """Everything a segment's table is made from: the same key means the same table."""
    settings = controller.policies.current.for_segment(segment)
    inputs = controller.estimate_inputs(settings, Request(segment, 1, drafters, table_min_new_tokens(settings)))
    previous = controller.previous_plan(segment)  # hysteresis reads the remembered drafter and whether it was on
    memory = None if previous is None else (previous.drafter, previous.speculates)
    learner = controller.learner
    versions = (learner.segment_version(segment), learner.costs_version, controller.policies.current.version)
    return (segment, *versions, inputs, drafters, memory)


def segment_table(
    controller: Controller, segment: str, drafters: Drafters, draws: int = PROBE_DRAWS
) -> pb.SegmentTable | None:
    """The segment's table for workers that run ``drafters``, or None while its own data is thin. The probe
    shares are drawn from a generator seeded by the segment and bucket: the same inputs give the same bytes."""
    settings = controller.policies.current.for_segment(segment)
    if controller.learner.segment_counts(segment).rounds < settings.prior_strength:
        return None
    new_tokens = table_min_new_tokens(settings)
    table = pb.SegmentTable(
        segment=segment, max_batch_size=settings.max_batch_size, min_new_tokens=new_tokens,
        prefill_cost_per_token=settings.prefill_cost_per_token,
    )  # fmt: skip
    bucket = 1
    while bucket // 2 + 1 <= settings.max_batch_size:  # a bucket's smallest batch size is allowed to speculate
        request = Request(segment, bucket // 2 + 1, drafters, new_tokens)  # neutral features: prompt 0, greedy
        rng = random.Random(f"{segment}|{bucket}|{','.join(drafters)}")
        plan, probes = controller.table_decisions(request, draws, rng, remember=bucket == 1)
        entry = table.buckets.add(batch_bucket=bucket, plan=plan.to_proto())
        for probe, share in probes:
            entry.probes.add(plan=probe.to_proto(), probability=share)
        bucket *= 2
    above_request = Request(segment, settings.max_batch_size + 1, drafters, new_tokens)
    above, _ = controller.table_decisions(above_request, 0, random.Random(0))
    table.above_max_batch_size.CopyFrom(above.to_proto())
    return table


class DecisionPublisher:
    """Builds the tables (``rebuild``, from the daemon's loop every ``refresh_seconds``) and feeds the streams."""

    def __init__(
        self, controller: Controller, refresh_seconds: float, max_watchers: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.controller = controller
        self.refresh_seconds = refresh_seconds
        self.max_watchers = max_watchers
        self.clock = clock
        self._cond = threading.Condition()
        self._build_lock = threading.Lock()  # one build at a time: the refresh's, or the first stream's
        self.stats = PublisherStats()
        self._generation = 0
        self._closed = False
        self._watchers: Counter[Drafters] = Counter()
        self._tables: dict[Drafters, dict[str, BuiltTable]] = {}
        self._built_unix = 0.0

    @property
    def watchers(self) -> int:
        with self._cond:
            return sum(self._watchers.values())

    def rebuild(self) -> None:
        """New tables for every drafter set that open streams watch (recomputing only what moved); wakes the
        streams."""
        with self._build_lock:
            with self._cond:
                watched = [d for d, n in self._watchers.items() if n > 0]
                previous = dict(self._tables)
            built = {drafters: self._build(drafters, previous.get(drafters, {})) for drafters in watched}
            with self._cond:
                kept = {d: t for d, t in self._tables.items() if d not in built and self._watchers[d] > 0}
                self._tables = built | kept
                self._built_unix = self.clock()
                self._generation += 1
                self._cond.notify_all()

    def close(self) -> None:
        """End every stream (at shutdown: a stream must not hold the server's grace period)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def watch(self, drafters: Drafters, is_active: Callable[[], bool]) -> Iterator[pb.DecisionTables]:
        """The stream's messages: every table first, then each refresh's changes (or a heartbeat), until the caller
        goes away or the publisher closes. Raises TooManyWatchers before the first message."""
        with self._cond:
            if sum(self._watchers.values()) >= self.max_watchers:
                raise TooManyWatchers(f"this controller already serves {self.max_watchers} WatchDecisions streams "
                                      "(max_watchers); ask Decide, or open the stream on another replica")  # fmt: skip
            self._watchers[drafters] += 1
        try:
            generation, tables = self._first_tables(drafters)
            yield self._message(True, (t.table for t in tables.values()), ())
            sent = {segment: t.data for segment, t in tables.items()}
            while True:
                with self._cond:
                    self._cond.wait_for(self._changed_since(generation), self.refresh_seconds)
                    if self._closed:
                        return
                    generation, tables = self._generation, self._tables.get(drafters, {})
                if not is_active():
                    return
                changed = [t.table for segment, t in tables.items() if sent.get(segment) != t.data]
                removed = [segment for segment in sent if segment not in tables]
                sent = {segment: t.data for segment, t in tables.items()}
                yield self._message(False, changed, removed)
        finally:
            with self._cond:
                self._watchers[drafters] -= 1
                if self._watchers[drafters] <= 0:
                    del self._watchers[drafters]

    def _changed_since(self, generation: int) -> Callable[[], bool]:
        return lambda: self._generation != generation or self._closed

    def _first_tables(self, drafters: Drafters) -> tuple[int, dict[str, BuiltTable]]:
        """The tables a new stream starts from: those built, or else built now (the first stream of these drafters
        does not wait for the next refresh), once: streams that open together wait for the one build."""
        with self._cond:
            if drafters in self._tables:
                return self._generation, self._tables[drafters]
        with self._build_lock:
            with self._cond:
                if drafters in self._tables:  # built while this stream waited
                    return self._generation, self._tables[drafters]
            tables = self._build(drafters, {})
            with self._cond:
                self._tables[drafters] = tables
                return self._generation, tables

    def _build(self, drafters: Drafters, previous: dict[str, BuiltTable]) -> dict[str, BuiltTable]:
        """The tables of ``drafters`` (under ``_build_lock``): each segment's previous table where its key has not
        moved, else a new one."""
        tables = {}
        self.stats.builds += 1
        for segment in self.controller.learner.segments():
            old, key = previous.get(segment), table_key(self.controller, segment, drafters)
            if old is not None and old.key == key:
                tables[segment] = old
                self.stats.tables_kept += 1
                continue
            table = segment_table(self.controller, segment, drafters)
            if table is not None:
                self.stats.tables_built += 1
                data = table.SerializeToString(deterministic=True)
                # Kept under the key as of after the build (its batch-1 plan is what the hysteresis memory holds now),
                # unless data moved during the build: then under the key before, so that the next build redoes it.
                after = table_key(self.controller, segment, drafters)
                tables[segment] = BuiltTable(table, data, after if after[:-1] == key[:-1] else key)
        return tables

    def _message(self, full: bool, tables: Iterable[pb.SegmentTable], removed: Iterable[str]) -> pb.DecisionTables:
        return pb.DecisionTables(
            full=full, segments=tables, removed=removed, policy_version=self.controller.policies.current.version,
            stale=self.controller.learner.stale, refresh_seconds=self.refresh_seconds, built_unix=self._built_unix,
        )  # fmt: skip
