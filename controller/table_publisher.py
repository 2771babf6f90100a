"""Decision tables pushed to workers (WatchDecisions): what each segment's requests get, per batch bucket, so that
a worker decides locally (``specd_api.table_rule``) and the controller leaves the hot path.

The tables are built once per refresh for each set of drafters that open streams watch, whatever the number of
streams; each stream then sends its worker only the segments whose table changed since its last message. A segment
enters the tables once its own rounds weigh at least as much as the prior (``prior_strength``): before that, the
request's features, which a table cannot see, still steer its decision, and the worker asks Decide.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
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


def segment_table(
    controller: Controller, segment: str, drafters: Drafters, draws: int = PROBE_DRAWS
) -> pb.SegmentTable | None:
    """The segment's table for workers that run ``drafters``, or None while its own data is thin."""
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
        plan, probes = controller.table_decisions(request, draws, remember=bucket == 1)
        entry = table.buckets.add(batch_bucket=bucket, plan=plan.to_proto())
        for probe, share in probes:
            entry.probes.add(plan=probe.to_proto(), probability=share)
        bucket *= 2
    above, _ = controller.table_decisions(Request(segment, settings.max_batch_size + 1, drafters, new_tokens), 0)
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
        self._generation = 0
        self._closed = False
        self._watchers: Counter[Drafters] = Counter()
        self._tables: dict[Drafters, dict[str, tuple[pb.SegmentTable, bytes]]] = {}
        self._built_unix = 0.0

    @property
    def watchers(self) -> int:
        with self._cond:
            return sum(self._watchers.values())

    def rebuild(self) -> None:
        """New tables for every drafter set that open streams watch; wakes the streams."""
        with self._cond:
            watched = [d for d, n in self._watchers.items() if n > 0]
        built = {drafters: self._build(drafters) for drafters in watched}
        with self._cond:
            self._tables = built | {d: t for d, t in self._tables.items() if d not in built and self._watchers[d] > 0}
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
            with self._cond:
                generation, tables = self._generation, self._tables.get(drafters)
            if tables is None:  # the first stream of these drafters does not wait for the next refresh
                tables = self._build(drafters)
                with self._cond:
                    tables = self._tables.setdefault(drafters, tables)
            yield self._message(True, (t for t, _ in tables.values()), ())
            sent = {segment: data for segment, (_, data) in tables.items()}
            while True:
                with self._cond:
                    self._cond.wait_for(self._changed_since(generation), self.refresh_seconds)
                    if self._closed:
                        return
                    generation, tables = self._generation, self._tables.get(drafters, {})
                if not is_active():
                    return
                changed = [t for segment, (t, data) in tables.items() if sent.get(segment) != data]
                removed = [segment for segment in sent if segment not in tables]
                sent = {segment: data for segment, (_, data) in tables.items()}
                yield self._message(False, changed, removed)
        finally:
            with self._cond:
                self._watchers[drafters] -= 1
                if self._watchers[drafters] <= 0:
                    del self._watchers[drafters]

    def _changed_since(self, generation: int) -> Callable[[], bool]:
        return lambda: self._generation != generation or self._closed

    def _build(self, drafters: Drafters) -> dict[str, tuple[pb.SegmentTable, bytes]]:
        tables = {}
        for segment in self.controller.learner.segments():
            table = segment_table(self.controller, segment, drafters)
            if table is not None:
                tables[segment] = (table, table.SerializeToString(deterministic=True))
        return tables

    def _message(self, full: bool, tables: Iterable[pb.SegmentTable], removed: Iterable[str]) -> pb.DecisionTables:
        return pb.DecisionTables(
            full=full, segments=tables, removed=removed, policy_version=self.controller.policies.current.version,
            stale=self.controller.learner.stale, refresh_seconds=self.refresh_seconds, built_unix=self._built_unix,
        )  # fmt: skip
