"""Typed per-round and per-request statistics: what the controller learns from.

Records are plain frozen dataclasses built once per round; aggregates are derived, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd_api.position_tally import PositionTally
from specd_api.rounds import RoundRecord


@dataclass(slots=True)
class RequestStats:
    """Everything measured while decoding one request."""

    prompt_tokens: int
    prefill_seconds: float = 0.0  # the target's prefill, which emits the first token
    prefill_tokens: int = 0  # tokens the prefill emitted: the first (0 when a stop string cut it)
    draft_prefill_seconds: float = 0.0  # the drafter's prefill, before its first round that drafts
    rounds: list[RoundRecord] = field(default_factory=list)

    def observe(self, record: RoundRecord) -> None:
        self.rounds.append(record)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def num_drafted(self) -> int:
        return sum(r.num_drafted for r in self.rounds)

    @property
    def num_accepted(self) -> int:
        return sum(r.num_accepted for r in self.rounds)

    @property
    def num_new_tokens(self) -> int:
        return self.prefill_tokens + sum(r.num_emitted for r in self.rounds)

    @property
    def alpha(self) -> float | None:
        """Acceptance rate α = accepted / proposed; None when nothing was proposed."""
        proposed = self.num_drafted
        return self.num_accepted / proposed if proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """τ: tokens per round, accepted + the bonus token."""
        return (self.num_accepted + self.num_rounds) / self.num_rounds if self.rounds else None

    @property
    def target_forward_passes(self) -> int:
        """One per round, plus the prefill pass when the prompt had more than one token."""
        return self.num_rounds + (1 if self.prompt_tokens > 1 else 0)

    @property
    def draft_seconds(self) -> float:
        return sum(r.draft_seconds for r in self.rounds)

    @property
    def verify_seconds(self) -> float:
        return sum(r.verify_seconds for r in self.rounds)

    @property
    def decode_seconds(self) -> float:
        """Every second after the first token: the rounds', and the drafter's prefill (which the request waits for
        between its first token and its second)."""
        return self.draft_prefill_seconds + self.draft_seconds + self.verify_seconds

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole request time (prefill included), as a user sees it."""
        total = self.total_seconds
        return self.num_new_tokens / total if total > 0 else 0.0

    def position_tally(self) -> PositionTally:
        """The rounds per draft position (as long as the longest round proposed)."""
        tally = PositionTally()
        for r in self.rounds:
            tally.add(r.num_drafted, r.num_accepted)
        return tally
