"""The bounded buffer between report() and the background sender, with its counters. No network here.

Aggregates wait in a deque; the sender takes up to ``max_per_report`` of them as one pending report with a fixed
report_id, and keeps that exact report until it is acknowledged (a retry must reuse the id *and* the contents, or
the controller's deduplication would drop what was added). The bound covers the waiting and the pending
aggregates together; on overflow the oldest waiting ones are dropped and counted.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from specd_api.v1 import controller_pb2 as pb


@dataclass(frozen=True)
class PendingReport:
    report_id: str
    aggregates: tuple[pb.RoundsAggregate, ...]


@dataclass(frozen=True)
class BufferCounts:
    reports_sent: int
    aggregates_sent: int
    rounds_acknowledged: int  # served rounds (not counterfactual ones) in the acknowledged reports
    aggregates_dropped: int  # lost: overflow, refused by the controller, or unsent at close
    aggregates_rejected: int  # the part of aggregates_dropped the controller refused (INVALID_ARGUMENT)
    send_failures: int
    reports_held: int  # attempts a busy controller held for their retry (not failures)
    buffered: int  # waiting + pending


class ReportBuffer:
    """Thread-safe: report() appends from worker threads, the sender takes and settles from its own."""

    def __init__(self, capacity: int, max_per_report: int) -> None:
        assert capacity >= 1 and max_per_report >= 1
        self.capacity = capacity
        self.max_per_report = max_per_report
        self._lock = threading.Lock()
        self._waiting: deque[pb.RoundsAggregate] = deque()
        self._pending: PendingReport | None = None
        self._sent_reports = self._sent = self._dropped = self._rejected = self._failures = self._rounds = 0
        self._held = 0

    def add(self, aggregates: Iterable[pb.RoundsAggregate]) -> tuple[bool, int]:
        """Append; return (a full report is waiting, how many were dropped to make room)."""
        with self._lock:
            self._waiting.extend(aggregates)
            room = self.capacity - (len(self._pending.aggregates) if self._pending else 0)
            dropped = max(len(self._waiting) - room, 0)
            for _ in range(dropped):
                self._waiting.popleft()
            self._dropped += dropped
            return len(self._waiting) >= self.max_per_report, dropped

    def take(self) -> PendingReport | None:
        """The report to send next: the pending one until it is settled, else a new one from the waiting."""
        with self._lock:
            if self._pending is None and self._waiting:
                count = min(len(self._waiting), self.max_per_report)
                batch = tuple(self._waiting.popleft() for _ in range(count))
                self._pending = PendingReport(report_id=uuid.uuid4().hex, aggregates=batch)
            return self._pending

    def acknowledged(self, report: PendingReport) -> None:
        with self._lock:
            if self._pending is not report:
                return  # given up at close while the call was in flight: already counted as dropped
            self._pending = None
            self._sent_reports += 1
            self._sent += len(report.aggregates)
            self._rounds += sum(a.rounds for a in report.aggregates if not a.counterfactual)

    def rejected(self, report: PendingReport) -> None:
        with self._lock:
            if self._pending is not report:
                return
            self._pending = None
            self._dropped += len(report.aggregates)
            self._rejected += len(report.aggregates)

    def failed(self) -> None:
        with self._lock:
            self._failures += 1

    def held(self) -> None:
        with self._lock:
            self._held += 1

    def drop_all(self) -> int:
        """Give up on everything left (at close); return how many aggregates that was."""
        with self._lock:
            count = len(self._waiting) + (len(self._pending.aggregates) if self._pending else 0)
            self._waiting.clear()
            self._pending = None
            self._dropped += count
            return count

    def counts(self) -> BufferCounts:
        with self._lock:
            return BufferCounts(
                reports_sent=self._sent_reports,
                aggregates_sent=self._sent,
                rounds_acknowledged=self._rounds,
                aggregates_dropped=self._dropped,
                aggregates_rejected=self._rejected,
                send_failures=self._failures,
                reports_held=self._held,
                buffered=len(self._waiting) + (len(self._pending.aggregates) if self._pending else 0),
            )
