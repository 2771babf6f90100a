"""What a message may hold: the wire contract's rules, checked by the controller at the door (INVALID_ARGUMENT) and by
the client library before it sends (one bad entry would sink a whole report). Every problem is a ValueError whose
message names the field; values quoted in messages are truncated.

Stored data can never break a decision (contract 7), so implausible telemetry is refused here: timings must be
finite, a round takes time (a report of zero seconds would make every cost ratio a division by zero), and the
per-n timing tables must add up to the totals.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

from specd_api.plan import DRAFTER_NAMES
from specd_api.segments import validate_segment
from specd_api.v1 import controller_pb2 as pb

MAX_K = 64
# A request's list of drafters names each one once (DRAFTER_NAMES has 6): a list bounded only by the message size
# (120,000 names in 840 KB) takes 27 ms of the interpreter to check, at once, in a Decide handler
MAX_DRAFTERS_LISTED = 16
MAX_AGGREGATES = 1_000  # per report: twice the client's default batch (500)
# Per report, the sum of the aggregates' K: what its Lua scripts and JSON work grow with (a 0.9 MB report of 10,000
# aggregates stalls Decide for 2.4 s under the GIL). 1,000 aggregates at K 32 fit.
MAX_REPORT_POSITIONS = 32_768
MAX_REPORT_BYTES = 2**20  # the controller's gRPC receive limit
# The trailing metadata key of an UNAVAILABLE answer to a report the controller holds, busy, for its retry (the same
# report id waits on the same work): a busy controller, told apart from one that is down or unreachable.
REPORT_HELD = "specd-report-held"
MAX_ROUNDS = 1_000_000_000  # per aggregate: far above any real request, far below float precision limits
MAX_BATCH_SIZE = 1_000_000
MAX_INT32 = 2**31 - 1  # what an int32 field of the wire carries: every integer a policy holds stays within it
MAX_DRAFT_SECONDS_PER_TOKEN = 10.0  # timings beyond these are clocks sent as durations, not measurements
MAX_VERIFY_SECONDS_PER_ROUND = 60.0
MAX_EXPECTED_SPEEDUP = 1000.0  # a plan's expected speedup: a round emits at most MAX_K + 1 tokens
MAX_REQUEST_SECONDS = 7 * 86_400.0  # one request's decode time: a week is a clock, not a request
MIN_VERIFY_SECONDS_PER_ROUND = 1e-7  # no target pass is faster: below it a worker sent no timing at all
SUM_TOLERANCE = 1e-6  # relative: a per-n table must add up to its total up to float rounding


def quoted(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters: errors never echo hostile input whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def drafter_name(name: str, field: str = "drafter") -> str:
    if name not in DRAFTER_NAMES:
        raise ValueError(f"{field}: unknown drafter {quoted(name)}; known: {', '.join(DRAFTER_NAMES)}")
    return name


def drafter_names(names: Sequence[str], field: str = "drafters") -> list[str]:
    """Each of ``names`` a known drafter, and at most MAX_DRAFTERS_LISTED of them (counted before any is read)."""
    if len(names) > MAX_DRAFTERS_LISTED:
        raise ValueError(f"{field}: at most {MAX_DRAFTERS_LISTED} entries (each drafter once), got {len(names)}")
    return [drafter_name(d, f"{field}[{i}]") for i, d in enumerate(names)]


def finite(name: str, value: float, low: float = 0.0, high: float = math.inf) -> float:
    if not math.isfinite(value) or not (low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value}")
    return value


def count(name: str, value: int, high: int | None = None, low: int = 0) -> int:
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


class Repeated(NamedTuple):
    """An aggregate's repeated fields as lists, read once: reading one from the message costs more than checking it
    (a slice of the field is the fastest read: 0.6 us for 32 entries, ``list()`` 2.8 us)."""

    proposed_per_position: list[int]
    verified_per_position: list[int]
    accepted_per_position: list[int]
    rounds_by_drafted: list[int]
    verify_seconds_by_drafted: list[float]


def repeated(a: pb.RoundsAggregate) -> Repeated:
    return Repeated(
        a.proposed_per_position[:],
        a.verified_per_position[:],
        a.accepted_per_position[:],
        a.rounds_by_drafted[:],
        a.verify_seconds_by_drafted[:],
    )


def check_aggregate(a: pb.RoundsAggregate, valid_segments: set[str] | None = None) -> Repeated:
    """Raise ValueError (naming the field) unless ``a`` describes rounds that could have happened; return its
    repeated fields as read. ``valid_segments``: names already found valid (a report repeats a few names over up to
    MAX_AGGREGATES aggregates); a name found valid here is added to it.

    Each field is read once, and the per-position and per-n rules are checked first in bulk: only a message that
    breaks one goes through the loop that finds and names it."""
    segment = a.segment
    if valid_segments is None or segment not in valid_segments:
        validate_segment(segment)
        if valid_segments is not None:
            valid_segments.add(segment)
    drafter = drafter_name(a.drafter)
    k = count("k", a.k, MAX_K)
    if drafter == "none" and k:
        raise ValueError("k: drafter 'none' reports k 0")
    rounds = count("rounds", a.rounds, MAX_ROUNDS)
    drafted = count("num_drafted", a.num_drafted, rounds * k)
    accepted = count("num_accepted", a.num_accepted, drafted)
    count("batch_size", a.batch_size, MAX_BATCH_SIZE, low=1)
    finite("temperature", a.temperature, high=100.0)
    count("prompt_tokens", a.prompt_tokens)
    finite("self_repetition", a.self_repetition, high=1.0)
    finite("expected_speedup", a.expected_speedup, high=MAX_EXPECTED_SPEEDUP)
    lists = repeated(a)
    if a.totals_only:
        _check_totals_only(a, lists, k, rounds)
        return lists
    _check_positions(lists, k, rounds, drafted, accepted)
    counterfactual = a.counterfactual
    if counterfactual and a.start_up_timings:
        raise ValueError("start_up_timings: a worker's start-up timings are served rounds, never counterfactual")
    if counterfactual:
        _check_counterfactual(a)
    else:
        _check_timings(a, lists, k, rounds, drafted)
    _check_request_totals(a)
    return lists


def _check_positions(lists: Repeated, k: int, rounds: int, drafted: int, accepted: int) -> None:
    per_position = {
        "proposed_per_position": lists.proposed_per_position,
        "verified_per_position": lists.verified_per_position,
        "accepted_per_position": lists.accepted_per_position,
    }
    for name, values in per_position.items():
        if len(values) > k:
            raise ValueError(f"{name} has {len(values)} entries, more than k ({k})")
    proposed_at, verified_at, accepted_at = (_padded(values, k) for values in per_position.values())
    if not _positions_hold(proposed_at, verified_at, accepted_at, rounds):
        _name_broken_position(proposed_at, verified_at, accepted_at, rounds)
    if sum(accepted_at) != accepted:
        raise ValueError("accepted_per_position does not add up to num_accepted")
    if k and sum(proposed_at) != drafted:
        raise ValueError("proposed_per_position does not add up to num_drafted")


def _positions_hold(proposed_at: list[int], verified_at: list[int], accepted_at: list[int], rounds: int) -> bool:
    """Every rule of ``_name_broken_position`` at once, compared in C: accepted <= verified <= proposed at each
    position, none negative; position 0 verified as often as proposed, within the rounds; each later position verified
    at most as often as the one before it was accepted, and proposed at most as often as it (so proposed[0], the
    largest, bounds them all by the rounds)."""
    if not proposed_at:
        return True
    return (
        verified_at[0] == proposed_at[0] <= rounds
        and min(accepted_at) >= 0
        and all(map(operator.le, accepted_at, verified_at))
        and all(map(operator.le, verified_at, proposed_at))
        and all(map(operator.le, verified_at[1:], accepted_at))
        and all(map(operator.le, proposed_at[1:], proposed_at))
    )


def _name_broken_position(proposed_at: list[int], verified_at: list[int], accepted_at: list[int], rounds: int) -> None:
    """Raise ValueError naming the first position that breaks a rule (none raised: every rule holds)."""
    for i, (p, v, acc) in enumerate(zip(proposed_at, verified_at, accepted_at, strict=True)):
        if not (0 <= acc <= v <= p <= rounds):
            raise ValueError(f"position {i}: need 0 <= accepted ({acc}) <= verified ({v}) <= proposed ({p}) <= rounds")
        # acceptance is a prefix: position i is verified exactly when every earlier one was accepted
        if i == 0 and v != p:
            raise ValueError(f"position 0: verified ({v}) must equal proposed ({p}); nothing precedes it")
        if i > 0 and v > accepted_at[i - 1]:
            raise ValueError(
                f"position {i}: verified ({v}) exceeds accepted at position {i - 1} ({accepted_at[i - 1]})"
            )
        if i > 0 and p > proposed_at[i - 1]:
            raise ValueError(
                f"position {i}: proposed ({p}) exceeds proposed at position {i - 1} ({proposed_at[i - 1]})"
            )


def _check_counterfactual(a: pb.RoundsAggregate) -> None:
    if a.drafter == "none":
        raise ValueError("counterfactual: drafter 'none' proposes nothing to score")
    if a.draft_seconds or a.verify_seconds or a.tokens_emitted or a.rounds_by_drafted or a.verify_seconds_by_drafted:
        raise ValueError("counterfactual: scored rounds carry no timings and no emitted tokens")


def _check_timings(a: pb.RoundsAggregate, lists: Repeated, k: int, rounds: int, drafted: int) -> None:
    count("tokens_emitted", a.tokens_emitted, rounds * (k + 1))
    finite("draft_seconds", a.draft_seconds, high=MAX_DRAFT_SECONDS_PER_TOKEN * max(drafted, rounds, 1))
    verify_seconds = a.verify_seconds
    low = MIN_VERIFY_SECONDS_PER_ROUND * rounds
    finite("verify_seconds", verify_seconds, low=low, high=MAX_VERIFY_SECONDS_PER_ROUND * max(rounds, 1))
    by_rounds, by_seconds = lists.rounds_by_drafted, lists.verify_seconds_by_drafted
    if len(by_rounds) != len(by_seconds):
        raise ValueError(
            f"rounds_by_drafted ({len(by_rounds)} entries) and verify_seconds_by_drafted ({len(by_seconds)}) "
            "must have the same length"
        )
    if not by_rounds:
        if rounds:
            raise ValueError("rounds_by_drafted: served rounds are reported per number drafted (n = 0..k)")
        return
    if len(by_rounds) > k + 1:
        raise ValueError(f"rounds_by_drafted has {len(by_rounds)} entries, more than k + 1 ({k + 1})")
    if not _timings_hold(by_rounds, by_seconds, rounds):
        _name_broken_timing(by_rounds, by_seconds, rounds)
    if sum(by_rounds) != rounds:
        raise ValueError(f"rounds_by_drafted adds up to {sum(by_rounds)}, not rounds ({rounds})")
    if sum(map(operator.mul, range(len(by_rounds)), by_rounds)) != drafted:
        raise ValueError("rounds_by_drafted does not add up to num_drafted (sum of n x rounds)")
    total = sum(by_seconds)
    if abs(total - verify_seconds) > SUM_TOLERANCE * max(verify_seconds, 1e-9):
        raise ValueError(f"verify_seconds_by_drafted adds up to {total:g}, not verify_seconds ({verify_seconds:g})")


def _timings_hold(by_rounds: list[int], by_seconds: list[float], rounds: int) -> bool:
    """Every rule of ``_name_broken_timing`` at once, compared in C: rounds in [0, rounds] and seconds in
    [MIN_VERIFY_SECONDS_PER_ROUND, MAX_VERIFY_SECONDS_PER_ROUND] per round for each n (so no seconds without rounds:
    0 rounds bound them to 0; NaN and infinities fail the comparisons)."""
    return (
        min(by_rounds) >= 0
        and max(by_rounds) <= rounds
        and all(map(operator.le, map(operator.mul, repeat(MIN_VERIFY_SECONDS_PER_ROUND), by_rounds), by_seconds))
        and all(map(operator.le, by_seconds, map(operator.mul, repeat(MAX_VERIFY_SECONDS_PER_ROUND), by_rounds)))
    )


def _name_broken_timing(by_rounds: list[int], by_seconds: list[float], rounds: int) -> None:
    """Raise ValueError naming the first n whose rounds or seconds break a rule (none raised: every rule holds)."""
    for n, (r, s) in enumerate(zip(by_rounds, by_seconds, strict=True)):
        count(f"rounds_by_drafted[{n}]", r, rounds)
        finite(f"verify_seconds_by_drafted[{n}]", s, low=MIN_VERIFY_SECONDS_PER_ROUND * r,
               high=MAX_VERIFY_SECONDS_PER_ROUND * max(r, 1))  # fmt: skip
        if s and not r:
            raise ValueError(f"verify_seconds_by_drafted[{n}]: seconds without rounds")


def _check_totals_only(a: pb.RoundsAggregate, lists: Repeated, k: int, rounds: int) -> None:
    """An engine's request totals: served speculative rounds, no detail, the request's tokens and seconds."""
    if a.drafter == "none":
        raise ValueError("totals_only: a plain request reports the full form (every round drafted 0)")
    if a.counterfactual or a.start_up_timings:
        raise ValueError("totals_only: request totals are served traffic, neither counterfactual nor start-up timings")
    if any(lists):
        raise ValueError("totals_only: no per-position or per-n lists (the totals are all an engine reports)")
    if a.draft_seconds or a.verify_seconds:
        raise ValueError("totals_only: no split timings; the request's seconds go in request_seconds")
    count("tokens_emitted", a.tokens_emitted, rounds * (k + 1), low=rounds)
    # the request's tokens and seconds are required; its expected_speedup may be 0 (a caller's own plan: not known)
    count("request_tokens_emitted", a.request_tokens_emitted, MAX_ROUNDS * (MAX_K + 1), low=max(a.tokens_emitted, 1))
    finite("request_seconds", a.request_seconds, high=MAX_REQUEST_SECONDS)
    if not a.request_seconds > 0:
        raise ValueError("request_seconds: a request that emitted tokens took time")


def _check_request_totals(a: pb.RoundsAggregate) -> None:
    """The request's totals (on the one aggregate per request that carries its calibration observation): both or
    neither, with an expected speedup, on served rounds, and at least the aggregate's own tokens and seconds."""
    tokens, seconds = a.request_tokens_emitted, a.request_seconds
    if not (tokens or seconds):
        return
    if a.counterfactual or not a.expected_speedup:
        raise ValueError("request_tokens_emitted: a request's totals go with its expected_speedup, on served rounds")
    count("request_tokens_emitted", tokens, MAX_ROUNDS * (MAX_K + 1), low=a.tokens_emitted)
    own = a.draft_seconds + a.verify_seconds
    finite("request_seconds", seconds, low=own * (1 - SUM_TOLERANCE), high=MAX_REQUEST_SECONDS)
    if tokens and not seconds > 0:
        raise ValueError("request_seconds: a request that emitted tokens took time")


def _padded(values: list[int], k: int) -> list[int]:
    return values + [0] * (k - len(values))
