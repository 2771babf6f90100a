"""Prompt lookup decoding: propose what followed the last time the current n-gram appeared.

The search is a pure function on an array (as in vLLM's n-gram proposer); the drafter only holds config.
A deterministic proposal is a one-hot q for rejection sampling, so the draft carries no probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter


@dataclass(frozen=True, slots=True)
class PromptLookupConfig:
    min_ngram: int = 1
    max_ngram: int = 3

    def __post_init__(self) -> None:
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(
                f"prompt lookup n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}"
            )


def find_continuation(tokens: np.ndarray, k: int, min_ngram: int, max_ngram: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the trailing n-gram.

    Longer n-grams are tried first (they predict better); the most recent match wins (recent text is
    the likeliest to be repeated). Returns an empty array when nothing matches.
    # tokens: [t] int  ->  [<= k] int
    """
    t = tokens.shape[0]
    if k <= 0:
        return tokens[:0]
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        suffix = tokens[t - n :]
        # Windows starting at 0 .. t-n-1: every earlier n-gram that has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: t - 1], n)  # [t - n, n]
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + k]
    return tokens[:0]


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        found = find_continuation(context.numpy(), k, self.config.min_ngram, self.config.max_ngram)
        if found.size == 0:
            return Draft(EMPTY_TOKENS)
        return Draft(torch.from_numpy(found.copy()))
