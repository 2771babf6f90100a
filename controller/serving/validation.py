"""Turning protobuf requests into validated domain objects; every problem is a ValueError with a reason.

The rules on what a message may hold are the wire contract's (``specd_api.checks``, shared with the client
library); this module applies them and builds the controller's own types. The service answers a ValueError with
INVALID_ARGUMENT, so no input can crash the daemon or poison the counts.
"""

from __future__ import annotations

import re
from dataclasses import fields

from controller.decision.counts import Aggregate
from controller.decision.decide import Request
from controller.decision.policy import drafter_set
from controller.decision.totals import positions_from_totals
from controller.pacing import Pacer
from specd_api.checks import (
    MAX_AGGREGATES,
    MAX_BATCH_SIZE,
    MAX_REPORT_POSITIONS,
    check_aggregate,
    count,
    drafter_names,
    finite,
)
from specd_api.modes import learning_segment
from specd_api.segments import validate_segment as validate_segment
from specd_api.v1 import controller_pb2 as pb

UNKNOWN_MAX_NEW_TOKENS = 256  # what to assume when a worker does not say (proto3 cannot tell 0 from unset)
_REPORT_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def request_from_proto(msg: pb.DecideRequest) -> Request:
    segment = validate_segment(msg.segment)
    count("batch_size", msg.batch_size, MAX_BATCH_SIZE, low=1)
    drafter_names(msg.drafters)
    temperature = finite("sampling.temperature", msg.sampling.temperature, high=100.0)
    finite("sampling.top_p", msg.sampling.top_p, high=1.0)
    count("sampling.top_k", msg.sampling.top_k)
    count("prompt_tokens", msg.prompt_tokens)
    count("max_new_tokens", msg.max_new_tokens)
    repetition = finite("prompt_features.self_repetition", msg.prompt_features.self_repetition, high=1.0)
    return Request(
        segment=learning_segment(segment, temperature),  # greedy and sampled requests are learned apart
        batch_size=msg.batch_size,
        drafters=tuple(dict.fromkeys(d for d in msg.drafters if d != "none")),
        max_new_tokens=msg.max_new_tokens or UNKNOWN_MAX_NEW_TOKENS,
        prompt_tokens=msg.prompt_tokens,
        temperature=temperature,
        self_repetition=repetition,
    )


def watched_drafters(msg: pb.WatchDecisionsRequest) -> tuple[str, ...]:
    """The drafters a WatchDecisions stream's tables are made for (sorted, without "none"); the worker id is only
    logged, so it is checked like a report id."""
    if msg.worker_id and not _REPORT_ID_RE.fullmatch(msg.worker_id):
        raise ValueError("worker_id must be 1..128 characters of [A-Za-z0-9_.:-]")
    drafter_names(msg.drafters)
    return drafter_set(msg.drafters)


def report(msg: pb.ReportRoundsRequest) -> tuple[str, list[Aggregate]]:
    if not _REPORT_ID_RE.fullmatch(msg.report_id):
        raise ValueError("report_id must be 1..128 characters of [A-Za-z0-9_.:-]")
    if len(msg.aggregates) > MAX_AGGREGATES:
        raise ValueError(f"a report holds at most {MAX_AGGREGATES} aggregates, got {len(msg.aggregates)}")
    positions = sum(max(a.k, 0) for a in msg.aggregates)
    if positions > MAX_REPORT_POSITIONS:
        raise ValueError(
            f"a report's aggregates hold at most {MAX_REPORT_POSITIONS} draft positions (the sum of their k), got "
            f"{positions}: send it in smaller reports"
        )
    aggregates = []
    valid_segments: set[str] = set()  # a report repeats a few segments: each name is checked once
    pace = Pacer()  # up to MAX_AGGREGATES: the other requests' threads get the interpreter between chunks
    for i, a in enumerate(msg.aggregates):
        pace()
        try:
            aggregates.append(aggregate(a, valid_segments))
        except ValueError as e:
            raise ValueError(f"aggregates[{i}]: {e}") from None
    return msg.report_id, aggregates


# The Aggregate's fields read here rather than copied: the segment (learned per sampling mode), the checked lists.
READ_HERE = frozenset(
    ("segment", "proposed_per_position", "verified_per_position", "accepted_per_position", "by_drafted")
)
# Every other field is the message's field of the same name, as sent (checked by ``check_aggregate``).
AS_SENT = tuple(f.name for f in fields(Aggregate) if f.name not in READ_HERE)


def aggregate(a: pb.RoundsAggregate, valid_segments: set[str] | None = None) -> Aggregate:
    lists = check_aggregate(a, valid_segments)
    if a.totals_only:
        proposed, verified, accepted = positions_from_totals(a.rounds, a.k, a.num_drafted, a.num_accepted)
        lists = lists._replace(proposed_per_position=proposed, verified_per_position=verified,
                               accepted_per_position=accepted)  # fmt: skip
    return Aggregate(
        segment=a.segment if a.start_up_timings else learning_segment(a.segment, a.temperature),
        proposed_per_position=tuple(lists.proposed_per_position),
        verified_per_position=tuple(lists.verified_per_position),
        accepted_per_position=tuple(lists.accepted_per_position),
        by_drafted=tuple(zip(lists.rounds_by_drafted, lists.verify_seconds_by_drafted, strict=True)),
        **{name: getattr(a, name) for name in AS_SENT},
    )
