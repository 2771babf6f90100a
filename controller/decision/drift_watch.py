"""The controller's drift state: each segment's active α drift alarms and the bucket its current regime began in,
kept across refreshes, with their Prometheus series. The test itself is controller.decision.drift (pure)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from controller.decision.drift import page_hinkley
from controller.storage.store import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriftAlarm:
    """An active α drift alarm of one segment and drafter (controller.decision.drift)."""

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


class DriftWatch:
    """Runs the drift test over each refresh's snapshot. ``regime`` maps a segment to the first time bucket of its
    current regime (after a drift): the store then counts only that traffic for it."""

    def __init__(self, registry: CollectorRegistry, bucket_seconds: float, window_buckets: int) -> None:
        self.metrics = DriftMetrics(registry)
        self.bucket_seconds = bucket_seconds
        self.window_buckets = window_buckets
        self.regime: dict[str, int] = {}
        self._alarms: dict[str, dict[str, DriftAlarm]] = {}  # segment -> drafter -> its active alarm
        # (segment, drafter) -> the series object and regime start the test last found no drift in: a segment no
        # report touched keeps its series object (the store's snapshot), and the test is pure, so it is not run again
        self._quiet: dict[tuple[str, str], tuple[list[tuple[int, float, float]], int]] = {}

    def alarms(self, segment: str) -> list[DriftAlarm]:
        """The segment's active alarms, by drafter. Every Decide asks: it reads the segment's own and never sorts
        every segment's (that costs 176 us a Decide at 2,000 alarms, 5x the decision's own work). The refresh's
        thread changes them: the items are copied in one step, under the interpreter's lock."""
        own = self._alarms.get(segment)
        return [a for _, a in sorted(own.items())] if own else []

    def watch(self, snapshot: Snapshot) -> bool:
        """Run the drift test on each segment's current regime; True when an alarm moved a regime's start. A series
        the test found no drift in, the same object from the same regime start, is not tested again: at 1,000
        segments x 60 buckets the tests took about half of an idle controller's CPU."""
        first_bucket = int(snapshot.taken_at // self.bucket_seconds) - self.window_buckets + 1
        moved = False
        for segment, own in list(self._alarms.items()):  # a regime older than the window: all new
            for drafter, alarm in list(own.items()):
                if int(alarm.since_unix // self.bucket_seconds) < first_bucket or segment not in snapshot.series:
                    del own[drafter]
                    self.metrics.active.labels(segment, drafter).set(0)
            if not own:
                del self._alarms[segment]
        for segment in list(self.regime):
            if self.regime[segment] < first_bucket or segment not in snapshot.series:
                del self.regime[segment]
        self._quiet = {key: quiet for key, quiet in self._quiet.items() if key[0] in snapshot.series}
        for segment, by_drafter in snapshot.series.items():
            start = self.regime.get(segment, first_bucket)
            for drafter, series in by_drafter.items():
                quiet = self._quiet.get((segment, drafter))
                if quiet is not None and quiet[0] is series and quiet[1] == start:
                    continue
                drift = page_hinkley([point for point in series if point[0] >= start])
                if drift is None:
                    self._quiet[(segment, drafter)] = (series, start)
                    continue
                self._quiet.pop((segment, drafter), None)
                alarm = DriftAlarm(
                    segment, drafter, drift.direction, drift.since_bucket * self.bucket_seconds,
                    snapshot.taken_at, drift.alpha_before, drift.alpha_since,
                )  # fmt: skip
                log.warning(
                    "α drift in segment %s, drafter %s: %s from %.2f to %.2f since %s (the controller now learns "
                    "from this traffic only)", segment, drafter, alarm.direction, alarm.alpha_before,
                    alarm.alpha_since, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(alarm.since_unix)),
                )  # fmt: skip
                self._alarms.setdefault(segment, {})[drafter] = alarm
                self.metrics.raised.labels(segment, drafter, alarm.direction).inc()
                self.metrics.active.labels(segment, drafter).set(1)
                self.regime[segment] = max(self.regime.get(segment, first_bucket), drift.since_bucket)
                moved = True
        return moved
