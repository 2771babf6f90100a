"""Per draft position over rounds: how often a position was proposed, verified and accepted. The one place the
prefix rule is written.

Acceptance is a prefix: a round that proposed ``drafted`` tokens and kept the first ``accepted`` proposed positions
0..drafted-1, verified positions 0..min(drafted, accepted + 1)-1 (each one after an accepted one, and the first
rejected one), and accepted positions 0..accepted-1. Everything that counts rounds per position counts with this
type: the round policy's view of the request so far, the worker's metrics and its per-request statistics, the
client's RoundsAggregate messages (its three ``*_per_position`` lists are a tally's), and counterfactual scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PositionTally:
    """Rounds, and per draft position i: rounds that proposed a token there, that verified it, that accepted it.
    The lists are as long as the longest round proposed (or the width the tally was made with)."""

    rounds: int = 0
    proposed: list[int] = field(default_factory=list)  # [positions] rounds whose proposal reached position i
    verified: list[int] = field(default_factory=list)  # [positions] ... with every earlier position accepted
    accepted: list[int] = field(default_factory=list)  # [positions] ... and position i accepted too

    @classmethod
    def of_width(cls, k: int) -> PositionTally:
        """A tally of positions 0..k-1 from the start (a RoundsAggregate's lists are k long, whatever was drafted)."""
        tally = cls()
        tally.widen(k)
        return tally

    def add(self, drafted: int, accepted: int, verifiable: int | None = None) -> None:
        """One round that proposed ``drafted`` tokens and kept the first ``accepted``. ``verifiable``: how many
        leading positions the target could check, when fewer than were proposed (a counterfactual replayed over a
        request's text reaches its end); None: every one."""
        verified = min(drafted, accepted + 1)  # the prefix rule: up to and including the first rejected position
        if verifiable is not None:
            verified = min(verified, verifiable)
        self.rounds += 1
        self.widen(drafted)
        for i in range(drafted):
            self.proposed[i] += 1
        for i in range(verified):
            self.verified[i] += 1
        for i in range(min(accepted, verified)):
            self.accepted[i] += 1

    def merge(self, other: PositionTally) -> None:
        """Add ``other``'s rounds to this tally."""
        self.rounds += other.rounds
        self.widen(len(other.proposed))
        pairs = ((self.proposed, other.proposed), (self.verified, other.verified), (self.accepted, other.accepted))
        for mine, theirs in pairs:
            for i, count in enumerate(theirs):
                mine[i] += count

    def widen(self, positions: int) -> None:
        """Count positions 0..positions-1 at least (new positions start at zero)."""
        for values in (self.proposed, self.verified, self.accepted):
            values.extend([0] * (positions - len(values)))

    @property
    def num_drafted(self) -> int:
        """Tokens proposed, over every round."""
        return sum(self.proposed)

    @property
    def num_accepted(self) -> int:
        """Tokens accepted, over every round."""
        return sum(self.accepted)

    def proposed_and_accepted(self) -> list[tuple[int, int]]:
        """(rounds that proposed a token there, rounds that accepted it) per position."""
        return list(zip(self.proposed, self.accepted, strict=True))
