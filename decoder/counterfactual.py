"""Scoring a drafter that did not run (a counterfactual), from the tokens the request emitted. Pure but for the
suffix cache it reads.

A one-hot drafter (prompt lookup, suffix decoding: a proposal is a function of the text so far, never of the
target's output for the round) is replayed over the emitted tokens as if it had been served at ceiling K: a round
proposes what the drafter proposes from the prompt and the tokens emitted so far, the proposal is accepted as far as
it equals the emitted tokens, and the next round starts after the accepted tokens plus one (the bonus token). That
is exactly what serving it would have done when greedy (the emitted tokens are the target's own choices, whoever
drafted), and the same in distribution when sampling: the emitted token at a position is a draw from the target
given the prefix, so it equals the proposal with the probability rejection sampling would accept it with, and after
a mismatch it is distributed as the residual. The rounds also start where the served drafter's rounds would (long
matches skip ahead), so per-round acceptance is not biased by where another drafter's rounds happened to start.

The replay runs the drafter itself (``decoder.drafters``: its ``prefill`` and ``propose``, the served code), so the
proposals are the served ones by construction (``decoder.engine.SpeculativeDecoder.score`` makes them as serving
does). Suffix decoding also reads its segment's cache of earlier outputs: the replay must read it before the
request's own output joins it (the worker scores first, then shares), or the drafter would propose the very tokens
it is scored against.

Rounds are grouped by their ceiling, as served rounds are: the budget cuts the last rounds' K (a round cut to
K = 0 proposes nothing and is not counted, as a served one counts as plain decoding). The first emitted token is the
prefill's (decoder/engine.py): no round drafted it, and the replay's first round starts after it, as a served one
does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from decoder.drafters.base import Drafter
from decoder.drafters.prompt_lookup import PromptLookupDrafter
from decoder.request_stop import StopConditions, draft_budget
from specd_api.position_tally import PositionTally
from specd_api.rounds import Scored

PREFILL_TOKENS = 1  # the first emitted token comes from the target's prefill, not a round


def replay(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    k: int,
    rules: StopConditions,
    max_context: int | None,
) -> list[Scored]:
    """A fresh one-hot ``drafter`` at ceiling ``k``, replayed over ``generated``: one score per ceiling the rounds
    had."""
    if k <= 0 or not generated:
        return []
    scored: dict[int, Scored] = {}
    prompt = len(prompt_ids)
    propose = _proposer(drafter, [*prompt_ids, *generated], prompt)
    done = PREFILL_TOKENS  # tokens of ``generated`` the replay has emitted: the prefill's first
    while done < len(generated):
        ceiling = min(k, draft_budget(prompt + done, done, rules, max_context))
        proposal = propose(prompt + done, ceiling) if ceiling else []
        accepted = 0
        for i, token in enumerate(proposal):
            if done + i >= len(generated):
                break  # the request ended here: later positions are proposed but never verified
            if token != generated[done + i]:
                break
            accepted += 1
        if ceiling:
            tally = scored.setdefault(ceiling, Scored(drafter.name, ceiling, PositionTally.of_width(ceiling))).tally
            tally.add(len(proposal), accepted, verifiable=len(generated) - done)
        done += min(accepted + 1, len(generated) - done)
    return [scored[c] for c in sorted(scored)]


def _proposer(drafter: Drafter, text: list[int], prompt: int) -> Callable[[int, int], list[int]]:
    """``drafter`` prefilled with the first ``prompt`` tokens of ``text``, as a function of (tokens of ``text`` so far,
    K) to its proposal. Prompt lookup's own index is asked over the list: the interface's tensors, made and read back
    every round, cost its replay 60% more (0.8 ms a request instead of 0.5 here), on the event loop."""
    if isinstance(drafter, PromptLookupDrafter):
        index = drafter.index
        index.extend(text[:prompt])

        def lookup(length: int, k: int) -> list[int]:
            index.extend(text[:length])
            return index.propose(k)

        return lookup
    tensor = torch.tensor(text, dtype=torch.long)  # [t] (prompt + generated): each round reads a view of it
    drafter.prefill(tensor[:prompt])

    def propose(length: int, k: int) -> list[int]:
        tokens: list[int] = drafter.propose(tensor[:length], k).tokens.tolist()
        return tokens

    return propose
