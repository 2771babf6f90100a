"""What a worker reports, as pure functions: rounds -> RoundsAggregate messages, and the prompt feature
``self_repetition`` that Decide takes.

Any engine's round records work: they only need the attributes of ``RoundLike`` (decoder.telemetry.RoundRecord
has exactly these).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specd_api.v1 import controller_pb2 as pb

SELF_REPETITION_N = 3  # the n of PromptFeatures.self_repetition (controller.proto)


class RoundLike(Protocol):
    """One draft + verify round, as any engine records it."""

    @property
    def drafter(self) -> str: ...  # "draft" | "prompt_lookup" | "none"
    @property
    def max_draft_tokens(self) -> int: ...  # K asked for; 0 means no speculation this round
    @property
    def num_draft_tokens(self) -> int: ...  # tokens proposed, <= K
    @property
    def num_accepted(self) -> int: ...  # leading draft tokens kept, <= proposed
    @property
    def num_emitted(self) -> int: ...  # tokens the round added: accepted + bonus (fewer when cut at a stop)
    @property
    def draft_seconds(self) -> float: ...
    @property
    def verify_seconds(self) -> float: ...


@dataclass
class _Group:
    """Running totals of the rounds of one (drafter, K)."""

    k: int
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposed_at: list[int] = field(default_factory=list)  # [k]
    verified_at: list[int] = field(default_factory=list)  # [k]
    accepted_at: list[int] = field(default_factory=list)  # [k]

    def __post_init__(self) -> None:
        self.proposed_at, self.verified_at, self.accepted_at = [0] * self.k, [0] * self.k, [0] * self.k

    def add(self, r: RoundLike) -> None:
        self.rounds += 1
        self.proposed += r.num_draft_tokens
        self.accepted += r.num_accepted
        self.emitted += r.num_emitted
        self.draft_seconds += r.draft_seconds
        self.verify_seconds += r.verify_seconds
        # acceptance is a prefix: position i is verified when every position before it was accepted
        for i in range(r.num_draft_tokens):
            self.proposed_at[i] += 1
            self.verified_at[i] += i <= r.num_accepted
            self.accepted_at[i] += i < r.num_accepted


def round_key(r: RoundLike) -> tuple[str, int]:
    """(drafter, K) a round is counted under: a round that asked for no draft tokens is a "none" round."""
    if r.max_draft_tokens == 0 or r.drafter == "none":
        return "none", 0
    return r.drafter, r.max_draft_tokens


def check_round(r: RoundLike) -> None:
    """Raise ValueError when ``r`` is not a possible round (the controller would refuse its aggregate)."""
    if not 0 <= r.num_accepted <= r.num_draft_tokens <= r.max_draft_tokens:
        raise ValueError(
            "need 0 <= num_accepted <= num_draft_tokens <= max_draft_tokens, got "
            f"{r.num_accepted}, {r.num_draft_tokens}, {r.max_draft_tokens}"
        )
    if r.drafter == "none" and r.num_draft_tokens:
        raise ValueError(f"drafter 'none' proposed {r.num_draft_tokens} tokens")
    if not 0 <= r.num_emitted <= r.num_accepted + 1:
        raise ValueError(f"num_emitted must be in [0, num_accepted + 1 = {r.num_accepted + 1}], got {r.num_emitted}")
    for name in ("draft_seconds", "verify_seconds"):
        seconds = getattr(r, name)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {seconds}")


def rounds_to_aggregates(
    segment: str,
    rounds: Sequence[RoundLike],
    batch_size: int,
    temperature: float,
    prompt_tokens: int,
    self_repetition: float,
) -> list[pb.RoundsAggregate]:
    """One RoundsAggregate per (drafter, K) among ``rounds``, in order of first appearance.

    Raises ValueError naming the first impossible round.
    """
    groups: dict[tuple[str, int], _Group] = {}
    for index, r in enumerate(rounds):
        try:
            check_round(r)
        except ValueError as e:
            raise ValueError(f"rounds[{index}]: {e}") from None
        key = round_key(r)
        if key not in groups:
            groups[key] = _Group(k=key[1])
        groups[key].add(r)
    return [
        pb.RoundsAggregate(
            segment=segment,
            drafter=drafter,
            num_draft_tokens=g.k,
            rounds=g.rounds,
            num_draft_tokens_proposed=g.proposed,
            num_accepted=g.accepted,
            proposed_per_position=g.proposed_at,
            verified_per_position=g.verified_at,
            accepted_per_position=g.accepted_at,
            tokens_emitted=g.emitted,
            draft_seconds=g.draft_seconds,
            verify_seconds=g.verify_seconds,
            batch_size=batch_size,
            temperature=temperature,
            prompt_tokens=prompt_tokens,
            self_repetition=self_repetition,
        )
        for (drafter, _), g in groups.items()
    ]


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
