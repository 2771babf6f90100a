"""What a worker reports, as pure functions: rounds -> RoundsAggregate messages, and the prompt feature
``self_repetition`` that Decide takes.

Any engine reports its rounds as ``specd_api.rounds.RoundRecord`` and its counterfactual scores as ``Scored``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specd_api.checks import MAX_EXPECTED_SPEEDUP
from specd_api.plan import batch_bucket
from specd_api.position_tally import PositionTally
from specd_api.rounds import RoundRecord, Scored
from specd_api.v1 import controller_pb2 as pb

SELF_REPETITION_N = 3  # the n of PromptFeatures.self_repetition (controller.proto)


@dataclass
class _Group:
    """Running totals of the rounds of one (drafter, K, batch bucket)."""

    k: int
    batch_size: int  # the largest batch among the group's rounds (they share a bucket)
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    tally: PositionTally = field(init=False)  # [k]
    rounds_by_drafted: list[int] = field(init=False)  # [k + 1]
    seconds_by_drafted: list[float] = field(init=False)  # [k + 1]

    def __post_init__(self) -> None:
        self.tally = PositionTally.of_width(self.k)
        self.rounds_by_drafted, self.seconds_by_drafted = [0] * (self.k + 1), [0.0] * (self.k + 1)

    def add(self, r: RoundRecord) -> None:
        self.tally.add(r.num_drafted, r.num_accepted)
        self.emitted += r.num_emitted
        self.draft_seconds += r.draft_seconds
        self.verify_seconds += r.verify_seconds
        self.batch_size = max(self.batch_size, r.batch_size)
        self.rounds_by_drafted[r.num_drafted] += 1
        self.seconds_by_drafted[r.num_drafted] += r.verify_seconds


def round_key(r: RoundRecord) -> tuple[str, int, int]:
    """(drafter, K, batch bucket) a round is counted under: a round that drafted with K 0 is a "none" round."""
    bucket = batch_bucket(max(r.batch_size, 1))
    if r.k == 0 or r.drafter == "none":
        return "none", 0, bucket
    return r.drafter, r.k, bucket


def check_round(r: RoundRecord) -> None:
    """Raise ValueError when ``r`` is not a possible round (the controller would refuse its aggregate)."""
    if not 0 <= r.num_accepted <= r.num_drafted <= r.k:
        raise ValueError(f"need 0 <= num_accepted <= num_drafted <= k, got {r.num_accepted}, {r.num_drafted}, {r.k}")
    if r.drafter == "none" and r.num_drafted:
        raise ValueError(f"drafter 'none' proposed {r.num_drafted} tokens")
    if not 0 <= r.num_emitted <= r.num_accepted + 1:
        raise ValueError(f"num_emitted must be in [0, num_accepted + 1 = {r.num_accepted + 1}], got {r.num_emitted}")
    for name in ("draft_seconds", "verify_seconds"):
        seconds = getattr(r, name)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {seconds}")


def rounds_to_aggregates(
    segment: str,
    rounds: Sequence[RoundRecord],
    temperature: float,
    prompt_tokens: int,
    self_repetition: float,
    scored: Sequence[Scored] = (),
    expected_speedup: float = 0.0,
    start_up_timings: bool = False,
    drafter_prefill_seconds: float = 0.0,
) -> list[pb.RoundsAggregate]:
    """One RoundsAggregate per (drafter, K, batch bucket) among ``rounds`` (one request's), in order of first
    appearance, then one counterfactual aggregate per drafter in ``scored``. The served aggregate that speculated in
    the most rounds carries the plan's ``expected_speedup`` and the request's totals (tokens and seconds of every
    round, and ``drafter_prefill_seconds``: the drafter's prefill, which the request waited for between its first
    token and its second): the controller checks the request's realised speedup against it, one observation per
    request however many K its round policy ran (a one-round tail at K 1 is no request's speedup). ``start_up_timings``:
    the rounds are the worker's start-up timings (decoder.calibration), counted in the costs only.

    Raises ValueError naming the first impossible round.
    """
    groups: dict[tuple[str, int, int], _Group] = {}
    for index, r in enumerate(rounds):
        try:
            check_round(r)
        except ValueError as e:
            raise ValueError(f"rounds[{index}]: {e}") from None
        key = round_key(r)
        if key not in groups:
            groups[key] = _Group(k=key[1], batch_size=max(r.batch_size, 1))
        groups[key].add(r)
    carrier = _calibration_carrier(groups) if _usable_speedup(expected_speedup) else None
    served = [
        pb.RoundsAggregate(
            segment=segment,
            drafter=key[0],
            k=g.k,
            **_tally_fields(g.tally),
            tokens_emitted=g.emitted,
            draft_seconds=g.draft_seconds,
            verify_seconds=g.verify_seconds,
            batch_size=g.batch_size,
            rounds_by_drafted=_trimmed(g.rounds_by_drafted),
            verify_seconds_by_drafted=g.seconds_by_drafted[: len(_trimmed(g.rounds_by_drafted))],
            temperature=temperature,
            prompt_tokens=prompt_tokens,
            self_repetition=self_repetition,
            start_up_timings=start_up_timings,
            **(_request_totals(groups.values(), expected_speedup, drafter_prefill_seconds) if key == carrier else {}),
        )
        for key, g in groups.items()
    ]
    return served + counterfactual_aggregates(segment, scored, temperature, prompt_tokens, self_repetition)


def counterfactual_aggregates(
    segment: str, scored: Sequence[Scored], temperature: float, prompt_tokens: int, self_repetition: float
) -> list[pb.RoundsAggregate]:
    """One counterfactual RoundsAggregate per score with rounds: its per-position counts, no timings."""
    return [
        pb.RoundsAggregate(
            segment=segment,
            drafter=t.drafter,
            k=t.k,
            **_tally_fields(t.tally),
            batch_size=1,
            counterfactual=True,
            temperature=temperature,
            prompt_tokens=prompt_tokens,
            self_repetition=self_repetition,
        )
        for t in scored
        if t.tally.rounds
    ]


def _calibration_carrier(groups: dict[tuple[str, int, int], _Group]) -> tuple[str, int, int] | None:
    """The key of the aggregate that carries the request's calibration observation: the speculating one with the
    most rounds (the first on a tie); None when the request never speculated."""
    speculating = [key for key in groups if key[0] != "none"]
    return max(speculating, key=lambda key: groups[key].tally.rounds, default=None)


def _request_totals(groups: Iterable[_Group], expected_speedup: float, extra_seconds: float) -> dict[str, Any]:
    """The carrier's extra fields: the plan's expectation and what the whole request emitted, in how long (its
    rounds, and ``extra_seconds`` spent between them: the drafter's prefill)."""
    emitted, seconds = 0, extra_seconds if math.isfinite(extra_seconds) and extra_seconds > 0 else 0.0
    for g in groups:
        emitted, seconds = emitted + g.emitted, seconds + g.draft_seconds + g.verify_seconds
    return {"expected_speedup": expected_speedup, "request_tokens_emitted": emitted, "request_seconds": seconds}


def _tally_fields(tally: PositionTally) -> dict[str, Any]:
    """An aggregate's counts, as RoundsAggregate names them."""
    return {
        "rounds": tally.rounds,
        "num_drafted": tally.num_drafted,
        "num_accepted": tally.num_accepted,
        "proposed_per_position": tally.proposed,
        "verified_per_position": tally.verified,
        "accepted_per_position": tally.accepted,
    }


def _usable_speedup(value: float) -> bool:
    return math.isfinite(value) and 0 < value <= MAX_EXPECTED_SPEEDUP


def _trimmed(values: list[int]) -> list[int]:
    """Without trailing zeros (the table's length says the longest round drafted)."""
    end = len(values)
    while end > 0 and values[end - 1] == 0:
        end -= 1
    return values[:end]


def self_repetition(prompt_ids: Sequence[int], n: int = SELF_REPETITION_N) -> float:
    """Fraction of the prompt's trailing n-grams (the n-gram ending at each token) that occur earlier in the
    prompt: how often prompt lookup would find a match. 0.0 for a prompt shorter than n + 1 tokens."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    total = len(prompt_ids) - n + 1
    for start in range(max(total, 0)):
        gram = tuple(prompt_ids[start : start + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total > 0 else 0.0


@dataclass(frozen=True)
class RequestTotals:
    """One request as an engine that counts only totals reports it (llama.cpp's server: ``timings.predicted_n``,
    ``predicted_ms``, ``draft_n``, ``draft_n_accepted``): ``tokens`` generated, the first (from the prompt's pass)
    included; ``seconds`` of decoding after that first token; ``drafted`` and ``accepted`` over the request, at
    ceiling ``k``; ``expected_speedup`` what the plan promised."""

    segment: str
    drafter: str
    k: int
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    batch_size: int = 1
    temperature: float = 0.0
    prompt_tokens: int = 0
    self_repetition: float = 0.0
    expected_speedup: float = 0.0

    def to_proto(self) -> pb.RoundsAggregate | None:
        """The aggregate the controller learns from (``totals_only`` for a speculating request; a plain one is
        reported whole, every step a round that drafted 0); None when no decode step ran or took no time.

        The steps after the first token emitted ``tokens - 1``: each emitted its accepted drafts and one token of
        the target's, so they were ``tokens - 1 - accepted``, and at least as many as it takes to draft ``drafted``
        at ``k`` a step (an engine that counts drafts the request's end cut off)."""
        emitted = self.tokens - 1
        if emitted <= 0 or not (math.isfinite(self.seconds) and self.seconds > 0):
            return None
        common: dict[str, Any] = {"segment": self.segment, "batch_size": self.batch_size,
                                  "temperature": self.temperature, "prompt_tokens": self.prompt_tokens,
                                  "self_repetition": self.self_repetition}  # fmt: skip
        if self.drafter == "none" or self.k < 1:
            return pb.RoundsAggregate(
                drafter="none", k=0, rounds=emitted, tokens_emitted=emitted, verify_seconds=self.seconds,
                rounds_by_drafted=[emitted], verify_seconds_by_drafted=[self.seconds], **common,
            )  # fmt: skip
        drafted = max(self.drafted, 0)
        accepted = min(max(self.accepted, 0), drafted)
        steps = max(emitted - accepted, -(-drafted // self.k), 1)
        tokens = min(max(emitted, steps), steps * (self.k + 1))
        return pb.RoundsAggregate(
            drafter=self.drafter, k=self.k, rounds=steps, num_drafted=drafted, num_accepted=accepted,
            tokens_emitted=tokens, expected_speedup=self.expected_speedup, request_tokens_emitted=tokens,
            request_seconds=self.seconds, totals_only=True, **common,
        )  # fmt: skip
