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
from dataclasses import dataclass

from decoder.drafters.prompt_lookup import NgramIndex, PromptLookupConfig
from decoder.stopping import StopRules, draft_budget
from specd_api.position_tally import PositionTally


@dataclass
class Scored:
    """A drafter that did not run, scored over rounds of one ceiling K (a RoundsAggregate with ``counterfactual``
    set)."""

    drafter: str
    k: int  # the rounds' ceiling: positions 0..k-1 were offered
    tally: PositionTally  # [k] per position


def replay_lookup(
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    config: PromptLookupConfig,
    k: int,
    rules: StopRules,
    max_context: int | None,
) -> list[Scored]:
    """Prompt lookup at ceiling ``k``, replayed over ``generated``: one score per ceiling the rounds had."""
    scored: dict[int, Scored] = {}
    index = NgramIndex(config)
    tokens = [*prompt_ids]
    index.extend(tokens)
    done = 0  # tokens of ``generated`` the replay has emitted
    while done < len(generated) and k > 0:
        ceiling = min(k, draft_budget(len(tokens), done, rules, max_context))
        proposal = index.propose(ceiling) if ceiling else []
        accepted = 0
        for i, token in enumerate(proposal):
            if done + i >= len(generated):
                break  # the request ended here: later positions are proposed but never verified
            if token != generated[done + i]:
                break
            accepted += 1
        if ceiling:
            tally = scored.setdefault(ceiling, Scored("prompt_lookup", ceiling, PositionTally.of_width(ceiling))).tally
            tally.add(len(proposal), accepted, verifiable=len(generated) - done)
        step = min(accepted + 1, len(generated) - done)
        tokens.extend(generated[done : done + step])
        index.extend(tokens)
        done += step
    return [scored[c] for c in sorted(scored)]
