"""Turning protobuf requests into validated domain objects; every problem is a ValueError with a reason.

The service answers those with INVALID_ARGUMENT, so no input can crash the daemon or poison the counts.
"""

from __future__ import annotations

import math
import re

from controller.counts import Aggregate
from controller.decide import Request
from controller.segments import validate_segment as validate_segment
from specd_api.v1 import controller_pb2 as pb

KNOWN_DRAFTERS = ("draft", "prompt_lookup", "none")
MAX_K = 64
MAX_AGGREGATES = 10_000
MAX_ROUNDS = 1_000_000_000  # per aggregate: far above any real request, far below float precision limits
MAX_DRAFT_SECONDS_PER_TOKEN = 10.0  # timings beyond these are clocks sent as durations, not measurements
MAX_VERIFY_SECONDS_PER_ROUND = 60.0
UNKNOWN_MAX_NEW_TOKENS = 256  # what to assume when a worker does not say (proto3 cannot tell 0 from unset)
_REPORT_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _finite(name: str, value: float, low: float = 0.0, high: float = math.inf) -> float:
    if not math.isfinite(value) or not (low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value}")
    return value


def _count(name: str, value: int, high: int | None = None) -> int:
    if value < 0 or (high is not None and value > high):
        raise ValueError(f"{name} must be in [0, {high if high is not None else 'inf'}], got {value}")
    return value


def decide_request(msg: pb.DecideRequest) -> Request:
    segment = validate_segment(msg.segment)
    if msg.batch_size < 0:
        raise ValueError(f"batch_size must be >= 1, got {msg.batch_size}")
    for d in msg.drafters:
        if d not in KNOWN_DRAFTERS:
            raise ValueError(f"unknown drafter {d!r}; known: {', '.join(KNOWN_DRAFTERS)}")
    temperature = _finite("sampling.temperature", msg.sampling.temperature, high=100.0)
    _finite("sampling.top_p", msg.sampling.top_p, high=1.0)
    _count("sampling.top_k", msg.sampling.top_k)
    _count("prompt_tokens", msg.prompt_tokens)
    _count("max_new_tokens", msg.max_new_tokens)
    repetition = _finite("prompt_features.self_repetition", msg.prompt_features.self_repetition, high=1.0)
    return Request(
        segment=segment,
        batch_size=max(msg.batch_size, 1),
        drafters=tuple(d for d in msg.drafters if d != "none"),
        max_new_tokens=msg.max_new_tokens or UNKNOWN_MAX_NEW_TOKENS,
        prompt_tokens=msg.prompt_tokens,
        temperature=temperature,
        self_repetition=repetition,
    )


def report(msg: pb.ReportRoundsRequest) -> tuple[str, list[Aggregate]]:
    if not _REPORT_ID_RE.fullmatch(msg.report_id):
        raise ValueError("report_id must be 1..128 characters of [A-Za-z0-9_.:-]")
    if len(msg.aggregates) > MAX_AGGREGATES:
        raise ValueError(f"a report holds at most {MAX_AGGREGATES} aggregates, got {len(msg.aggregates)}")
    aggregates = []
    for i, a in enumerate(msg.aggregates):
        try:
            aggregates.append(aggregate(a))
        except ValueError as e:
            raise ValueError(f"aggregates[{i}]: {e}") from None
    return msg.report_id, aggregates


def aggregate(a: pb.RoundsAggregate) -> Aggregate:
    segment = validate_segment(a.segment)
    if a.drafter not in KNOWN_DRAFTERS:
        raise ValueError(f"unknown drafter {a.drafter!r}; known: {', '.join(KNOWN_DRAFTERS)}")
    k = _count("num_draft_tokens", a.num_draft_tokens, MAX_K)
    if a.drafter == "none" and k:
        raise ValueError("drafter 'none' reports num_draft_tokens 0")
    rounds = _count("rounds", a.rounds, MAX_ROUNDS)
    proposed = _count("num_draft_tokens_proposed", a.num_draft_tokens_proposed, rounds * k)
    accepted = _count("num_accepted", a.num_accepted, proposed)
    per_position = {
        "proposed_per_position": tuple(a.proposed_per_position),
        "verified_per_position": tuple(a.verified_per_position),
        "accepted_per_position": tuple(a.accepted_per_position),
    }
    for name, values in per_position.items():
        if len(values) > k:
            raise ValueError(f"{name} has {len(values)} entries, more than num_draft_tokens ({k})")
    proposed_at, verified_at, accepted_at = (
        [values[i] if i < len(values) else 0 for i in range(k)] for values in per_position.values()
    )
    for i in range(k):
        p, v, acc = proposed_at[i], verified_at[i], accepted_at[i]
        if not (0 <= acc <= v <= p <= rounds):
            raise ValueError(f"position {i}: need 0 <= accepted ({acc}) <= verified ({v}) <= proposed ({p}) <= rounds")
        # acceptance is a prefix: position i is verified exactly when every earlier one was accepted
        if i == 0 and v != p:
            raise ValueError(f"position 0: verified ({v}) must equal proposed ({p}); nothing precedes it")
        if i > 0 and v > accepted_at[i - 1]:
            raise ValueError(
                f"position {i}: verified ({v}) exceeds accepted at position {i - 1} ({accepted_at[i - 1]})"
            )
    if sum(accepted_at) != accepted:
        raise ValueError("accepted_per_position does not add up to num_accepted")
    if k and sum(proposed_at) != proposed:
        raise ValueError("proposed_per_position does not add up to num_draft_tokens_proposed")
    draft_seconds = _finite("draft_seconds", a.draft_seconds, high=MAX_DRAFT_SECONDS_PER_TOKEN * max(proposed, 1))
    verify_seconds = _finite("verify_seconds", a.verify_seconds, high=MAX_VERIFY_SECONDS_PER_ROUND * max(rounds, 1))
    return Aggregate(
        segment=segment,
        drafter=a.drafter,
        num_draft_tokens=k,
        rounds=rounds,
        proposed=proposed,
        accepted=accepted,
        tokens_emitted=_count("tokens_emitted", a.tokens_emitted, rounds * (k + 1)),
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        batch_size=max(_count("batch_size", a.batch_size), 1),
        temperature=_finite("temperature", a.temperature, high=100.0),
        prompt_tokens=_count("prompt_tokens", a.prompt_tokens),
        self_repetition=_finite("self_repetition", a.self_repetition, high=1.0),
        **per_position,
    )
