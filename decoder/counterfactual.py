"""Scoring drafters that did not run (counterfactuals), from the tokens the request emitted. Pure.

At the start of a round, prompt lookup's would-be proposal is recorded (decoder.telemetry.Counterfactual). Once
the tokens that followed are known, position i of that proposal counts as verified when every earlier proposed
token equals the emitted one and an emitted token exists at i, and as accepted when it equals it too. The
emitted tokens are the target's own choices, so for a one-hot drafter the indicator "proposed == emitted" is an
unbiased estimate of its acceptance probability at that position, at any temperature (exact when greedy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoder.telemetry import Counterfactual


@dataclass
class PositionTally:
    """Per draft position over scored rounds (the fields of a RoundsAggregate with ``counterfactual`` set)."""

    drafter: str
    k: int  # positions scored per round
    rounds: int = 0
    proposed: list[int] = field(default_factory=list)  # [k] rounds whose proposal reached position i
    verified: list[int] = field(default_factory=list)  # [k] ... with every earlier position matching
    accepted: list[int] = field(default_factory=list)  # [k] ... and position i matching too

    def __post_init__(self) -> None:
        self.proposed, self.verified, self.accepted = [0] * self.k, [0] * self.k, [0] * self.k

    @property
    def num_drafted(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)


def score(records: Sequence[Counterfactual], generated: Sequence[int], k: int) -> dict[str, PositionTally]:
    """Tally ``records`` (proposals of at most ``k`` tokens) against ``generated``, per drafter."""
    tallies: dict[str, PositionTally] = {}
    for record in records:
        if record.start >= len(generated):
            continue  # the request emitted nothing after this round started: nothing to score it against
        tally = tallies.setdefault(record.drafter, PositionTally(record.drafter, k))
        tally.rounds += 1
        proposal = record.tokens[:k]
        for i in range(len(proposal)):
            tally.proposed[i] += 1
        for i, token in enumerate(proposal):
            position = record.start + i
            if position >= len(generated):
                break  # the request ended here: later positions are proposed but never verified
            tally.verified[i] += 1
            if token != generated[position]:
                break
            tally.accepted[i] += 1
    return tallies
