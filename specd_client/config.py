"""The client's configuration (validated once, when it is made) and its counters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from specd_api.checks import MAX_AGGREGATES, MAX_K
from specd_api.plan import DRAFTER_NAMES
from specd_api.security import ControllerCredentials
from specd_api.targets import check_address


@dataclass(frozen=True)
class ClientConfig:
    address: str  # "127.0.0.1:50061"; replicas: "10.0.0.1:50061,10.0.0.2:50061" (round_robin, specd_api/targets.py)
    worker_id: str
    decide_deadline_ms: float = 5.0  # the gRPC deadline of Decide
    default_drafter: str = "none"  # local default plan when no plan was ever seen for a segment
    default_k: int = 0
    fallback_max_batch_size: int = 8  # above it a fallback decision never speculates (the default policy's rule)
    max_remembered_segments: int = 10_000  # last decisions kept for fallbacks, least recently used evicted
    report_interval_s: float = 0.5  # background flush period
    max_buffered_aggregates: int = 10_000  # bounded buffer; beyond it the oldest are dropped and counted
    max_aggregates_per_report: int = 500
    report_timeout_s: float = 2.0
    retry_backoff_s: tuple[float, float] = (0.1, 5.0)  # exponential backoff min/max between failed sends
    reconnect_backoff_s: tuple[float, float] = (0.1, 1.0)  # gRPC reconnect backoff: how soon a restart is seen
    credentials: ControllerCredentials | None = None  # TLS and a token (files checked when made); None: plaintext
    # The drafters this worker runs: watch the controller's decision tables for them (WatchDecisions) and decide
    # locally where a table holds (specd_client/table_watcher.py). Empty: every decision is a Decide call.
    watch_decisions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        tls = self.credentials.tls if self.credentials is not None else None
        check_address(self.address, "address", tls.server_name if tls is not None else None, tls is not None)
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        _positive("decide_deadline_ms", self.decide_deadline_ms)
        _positive("report_interval_s", self.report_interval_s)
        _positive("report_timeout_s", self.report_timeout_s)
        if self.default_drafter not in DRAFTER_NAMES:
            known = ", ".join(DRAFTER_NAMES)
            raise ValueError(f"default_drafter must be one of {known}, got {self.default_drafter[:40]!r}")
        low_k = 0 if self.default_drafter == "none" else 1
        high_k = 0 if self.default_drafter == "none" else MAX_K
        if not low_k <= self.default_k <= high_k:
            raise ValueError(
                f"default_k must be in [{low_k}, {high_k}] for drafter {self.default_drafter!r}, got {self.default_k}"
            )
        _at_least("fallback_max_batch_size", self.fallback_max_batch_size, 1)
        _at_least("max_remembered_segments", self.max_remembered_segments, 1)
        _at_least("max_buffered_aggregates", self.max_buffered_aggregates, 1)
        _at_least("max_aggregates_per_report", self.max_aggregates_per_report, 1)
        if self.max_aggregates_per_report > MAX_AGGREGATES:
            raise ValueError(
                f"max_aggregates_per_report must be <= {MAX_AGGREGATES} (the controller's limit), "
                f"got {self.max_aggregates_per_report}"
            )
        for i, drafter in enumerate(self.watch_decisions):
            if drafter not in DRAFTER_NAMES:
                known = ", ".join(DRAFTER_NAMES)
                raise ValueError(f"watch_decisions[{i}] must be one of {known}, got {drafter[:40]!r}")
        _backoff("retry_backoff_s", self.retry_backoff_s)
        _backoff("reconnect_backoff_s", self.reconnect_backoff_s)

    @property
    def decide_deadline_s(self) -> float:
        return self.decide_deadline_ms / 1000.0


@dataclass(frozen=True)
class ClientStats:
    decisions: int  # decide() calls
    local_decisions: int  # the part of them answered from the pushed decision tables
    fallbacks: Mapping[str, int]  # decide() calls the controller did not answer, by cause
    reports_sent: int  # ReportRounds calls acknowledged
    aggregates_sent: int
    rounds_acknowledged: int  # served rounds the controller acknowledged (stored in Redis or its journal)
    aggregates_dropped: int  # lost: buffer overflow, refused by the controller, or unsent at close
    aggregates_rejected: int  # the part of aggregates_dropped the controller refused (INVALID_ARGUMENT)
    reports_invalid: int  # report() calls whose rounds were impossible (nothing enqueued)
    send_failures: int  # ReportRounds attempts that failed (each is retried with the same report_id)
    reports_held: int  # ReportRounds attempts a busy controller held for their retry: not failures, not counted above
    buffered: int  # aggregates waiting to be sent


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _backoff(name: str, value: tuple[float, float]) -> None:
    low, high = value
    _positive(f"{name}[0]", low)
    if not (math.isfinite(high) and high >= low):
        raise ValueError(f"{name} must be (min, max) with max >= min, got {value}")
