"""llama.cpp's ``ngram-simple`` drafter as a rule, so the adapter scores prompt lookup as llama-server would have
served it (``scored``: the rule replayed over a request's output by ``decoder.counterfactual.replay``). Pure.

**The rule** (llama.cpp ``common_ngram_simple_draft``, ``--spec-ngram-simple-size-n N --spec-ngram-simple-size-m M``).
The history is the tokens before the last sampled one; the pattern is the history's last N - 1 tokens and the
sampled token. The latest earlier start of the pattern is searched from history position ``len - N - 1`` down to 1
(position 0 never matches; the start one before the pattern's own is skipped). The draft is what followed that match
in the history, at most M tokens; there is no draft when the history holds N + M + 1 tokens or fewer, when nothing
matches, or when fewer than N tokens follow the match. The server then cuts the draft to its round's budget.

Unlike the project's own prompt lookup (``decoder/drafters/prompt_lookup.py``: the longest of the 3-, 2- and 1-gram
that matches), it matches one n-gram size only, so it proposes less often, and what it proposes is accepted more
often.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from decoder.counterfactual import replay
from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.request_stop import StopConditions
from specd_api.rounds import Scored

NGRAM_SIZE = 3  # the n-gram size every prompt lookup endpoint is started with (--spec-ngram-simple-size-n)


def ngram_simple_draft(history: Sequence[int], sampled: int, n: int, m: int) -> list[int]:
    """llama.cpp's ngram-simple draft after ``history`` and the ``sampled`` token: n-gram size ``n``, at most
    ``m`` drafted tokens (empty: no draft)."""
    length = len(history)
    if length <= n + m + 1:
        return []
    pattern = [*history[length - n + 1 :], sampled]
    for j in range(length - n - 1, 0, -1):
        if history[j] == pattern[0] and list(history[j : j + n]) == pattern:
            copy = min(m, length - (j + n))
            return [] if copy < n else list(history[j + n : j + n + copy])
    return []


class NgramSimpleDrafter(Drafter):
    """llama-server's ``ngram-simple`` started with n-gram size ``n`` and m-gram size ``m``: a round of ceiling K
    drafts what the server drafts, cut to K (the round's budget)."""

    name: ClassVar[str] = "prompt_lookup"

    def __init__(self, n: int, m: int) -> None:
        if n < 1 or m < 1:
            raise ValueError(f"ngram-simple needs n-gram and m-gram sizes of at least 1, got {n} and {m}")
        self.n, self.m = n, m

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        """``context``: [t] int64, the tokens so far, the last one the round's sampled token."""
        tokens: list[int] = context.tolist()
        if k <= 0 or not tokens:
            return Draft(EMPTY_TOKENS)
        found = ngram_simple_draft(tokens[:-1], tokens[-1], self.n, self.m)[:k]
        return Draft(torch.tensor(found, dtype=torch.long)) if found else Draft(EMPTY_TOKENS)


def scored(prompt_ids: Sequence[int], generated: Sequence[int], k: int, budget: int) -> list[Scored]:
    """Prompt lookup at K ``k`` replayed over ``generated`` (the request's output after ``prompt_ids``, of at most
    ``budget`` tokens) as an endpoint started with ``NGRAM_SIZE`` and m-gram size ``k`` drafts: one score per ceiling
    its rounds had."""
    rules = StopConditions(max_new_tokens=max(budget, 1))
    return replay(NgramSimpleDrafter(NGRAM_SIZE, k), prompt_ids, generated, k, rules, None)
