"""Decisions the worker can always have: the controller's answer, or, when it cannot answer in time, the last
decision it gave for the segment, or a local default (contract 2: the worker never fails because of the controller).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import grpc

from specd_api.v1 import controller_pb2 as pb

Fallback = Literal["timeout", "unavailable", "error"]
Source = Literal["controller", "last_decision", "local_default"]
BATCH_RULE_REASON = "batch_size_above_threshold"  # the controller's reason for its batch rule (contract 6)
LOCAL_DEFAULT_REASON = "local_default"


@dataclass(frozen=True)
class DecisionOutcome:
    """What the worker runs with, and where it came from."""

    drafter: str
    num_draft_tokens: int
    reason: str
    policy_version: str
    exploration: bool
    expected_speedup: float
    stale: bool  # the controller's statistics were stale, or this is not the controller's answer to this request
    fallback: Fallback | None  # None when the controller answered
    source: Source
    latency_s: float


@dataclass(frozen=True)
class LocalDefault:
    """The decision used when the controller never answered for a segment."""

    drafter: str = "none"
    num_draft_tokens: int = 0
    max_batch_size: int = 8  # above it a fallback never speculates, like the controller's batch rule


def fallback_cause(code: grpc.StatusCode | None) -> Fallback:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return "error"


def from_decision(decision: pb.Decision, latency_s: float) -> DecisionOutcome:
    return DecisionOutcome(
        drafter=decision.drafter,
        num_draft_tokens=decision.num_draft_tokens,
        reason=decision.reason,
        policy_version=decision.policy_version,
        exploration=decision.exploration,
        expected_speedup=decision.expected_speedup,
        stale=decision.stale,
        fallback=None,
        source="controller",
        latency_s=latency_s,
    )


def worth_remembering(outcome: DecisionOutcome) -> bool:
    """A decision about the segment, not about this one request: not a probe, not the batch rule."""
    return outcome.source == "controller" and not outcome.exploration and outcome.reason != BATCH_RULE_REASON


def fallback_decision(
    last: DecisionOutcome | None,
    default: LocalDefault,
    drafters: Sequence[str],
    batch_size: int,
    cause: Fallback,
    latency_s: float,
) -> DecisionOutcome:
    """The decision to use when the controller did not answer: the batch rule first, then the segment's last
    decision if the worker can still run its drafter, then the local default (or "none" if that drafter is not
    offered)."""
    offered = set(drafters) | {"none"}
    if batch_size > default.max_batch_size:
        return _local("none", 0, BATCH_RULE_REASON, cause, latency_s)
    if last is not None and last.drafter in offered:
        return replace(last, stale=True, fallback=cause, source="last_decision", latency_s=latency_s)
    if default.drafter in offered:
        return _local(default.drafter, default.num_draft_tokens, LOCAL_DEFAULT_REASON, cause, latency_s)
    return _local("none", 0, LOCAL_DEFAULT_REASON, cause, latency_s)


def _local(drafter: str, k: int, reason: str, cause: Fallback, latency_s: float) -> DecisionOutcome:
    return DecisionOutcome(
        drafter=drafter,
        num_draft_tokens=k,
        reason=reason,
        policy_version="",
        exploration=False,
        expected_speedup=1.0,  # unknown: no prediction was made
        stale=True,
        fallback=cause,
        source="local_default",
        latency_s=latency_s,
    )


class DecisionMemory:
    """The last decision worth remembering per segment, least recently used evicted first. Thread-safe."""

    def __init__(self, max_segments: int) -> None:
        self.max_segments = max_segments
        self._lock = threading.Lock()
        self._last: OrderedDict[str, DecisionOutcome] = OrderedDict()

    def remember(self, segment: str, outcome: DecisionOutcome) -> None:
        with self._lock:
            self._last[segment] = outcome
            self._last.move_to_end(segment)
            while len(self._last) > self.max_segments:
                self._last.popitem(last=False)

    def recall(self, segment: str) -> DecisionOutcome | None:
        with self._lock:
            outcome = self._last.get(segment)
            if outcome is not None:
                self._last.move_to_end(segment)
            return outcome

    def __len__(self) -> int:
        with self._lock:
            return len(self._last)
