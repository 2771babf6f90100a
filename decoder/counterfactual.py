"""Scoring a drafter that did not run (a counterfactual), from the tokens the request emitted. Pure.

Prompt lookup is replayed over the emitted tokens as if it had been served at ceiling K: a round proposes what the
n-gram index finds in the prompt and the tokens emitted so far, the proposal is accepted as far as it equals the
emitted tokens, and the next round starts after the accepted tokens plus one (the bonus token). For a one-hot
drafter that is exactly what serving it would have done when greedy (the emitted tokens are the target's own
choices, whoever drafted), and the same in distribution when sampling: the emitted token at a position is a draw
from the target given the prefix, so it equals the proposal with the probability rejection sampling would accept
it with, and after a mismatch it is distributed as the residual. The rounds also start where a served prompt
lookup's rounds would (long matches skip ahead), so per-round acceptance is not biased by where another drafter's
rounds happened to start.

Rounds are grouped by their ceiling, as served rounds are: the budget cuts the last rounds' K (a round cut to
K = 0 proposes nothing and is not counted, as a served one counts as plain decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoder.drafters.prompt_lookup import NgramIndex, PromptLookupConfig
from decoder.engine import clamp_k
from decoder.stopping import StopRules


@dataclass
class PositionTally:
    """Per draft position over scored rounds of one ceiling K (the fields of a RoundsAggregate with
    ``counterfactual`` set)."""

    drafter: str
    k: int  # the rounds' ceiling: positions 0..k-1 were offered
    rounds: int = 0
    proposed: list[int] = field(default_factory=list)  # [k] rounds whose proposal reached position i
    verified: list[int] = field(default_factory=list)  # [k] ... with every earlier position accepted
    accepted: list[int] = field(default_factory=list)  # [k] ... and position i accepted too

    def __post_init__(self) -> None:
        self.proposed, self.verified, self.accepted = [0] * self.k, [0] * self.k, [0] * self.k

    @property
    def num_drafted(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)


def replay_lookup(
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    config: PromptLookupConfig,
    k: int,
    rules: StopRules,
    max_context: int | None,
) -> list[PositionTally]:
    """Prompt lookup at ceiling ``k``, replayed over ``generated``: one tally per ceiling the rounds had."""
    tallies: dict[int, PositionTally] = {}
    index = NgramIndex(config)
    tokens = [*prompt_ids]
    index.extend(tokens)
    done = 0  # tokens of ``generated`` the replay has emitted
    while done < len(generated) and k > 0:
        ceiling = clamp_k(k, len(tokens), done, rules, max_context)
        proposal = index.propose(ceiling) if ceiling else []
        accepted = 0
        if ceiling:
            tally = tallies.setdefault(ceiling, PositionTally("prompt_lookup", ceiling))
            tally.rounds += 1
            for i in range(len(proposal)):
                tally.proposed[i] += 1
            for i, token in enumerate(proposal):
                if done + i >= len(generated):
                    break  # the request ended here: later positions are proposed but never verified
                tally.verified[i] += 1
                if token != generated[done + i]:
                    break
                tally.accepted[i] += 1
                accepted += 1
        step = min(accepted + 1, len(generated) - done)
        tokens.extend(generated[done : done + step])
        index.extend(tokens)
        done += step
    return [tallies[c] for c in sorted(tallies)]
