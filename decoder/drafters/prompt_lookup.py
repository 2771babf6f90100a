"""Prompt lookup decoding: propose what followed the last time the current n-gram appeared.

``find_continuation`` is the rule, a pure function on an array (as in vLLM's n-gram proposer). ``NgramIndex``
computes the same answer incrementally: it keeps the most recent earlier occurrence of every n-gram of a growing
sequence in a hash map, updated once per new token, so a proposal costs a few dictionary lookups instead of a
scan of the whole context per n-gram size. A deterministic proposal is a one-hot q for rejection sampling, so
the draft carries no probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: t - 1], n)  # [t - n, n], n the n-gram size here
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + k]
    return tokens[:0]


class NgramIndex:
    """``find_continuation`` over a sequence that only grows, answered from an index updated per token.

    For each n in min_ngram..max_ngram it maps every n-gram that has a token after it to its latest start.
    """

    def __init__(self, config: PromptLookupConfig) -> None:
        self.config = config
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)
        }

    def extend(self, context: torch.Tensor | Sequence[int]) -> None:
        """Catch up with ``context``, which must start with every token seen so far.  # context: [t] int64"""
        known = len(self.tokens)
        assert len(context) >= known, f"the context shrank from {known} to {len(context)} tokens"
        new = context[known:]
        for token in new.tolist() if isinstance(new, torch.Tensor) else new:
            end = len(self.tokens)  # the n-grams ending just before the new token now have a follower
            self.tokens.append(int(token))
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(self.tokens[end - n : end])] = end - n

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the trailing n-gram (longest first)."""
        t = len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.config.max_ngram, t - 1), self.config.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(self.tokens[t - n :]))
            if start is not None:
                return self.tokens[start + n : start + n + k]
        return []


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()
        self.index = NgramIndex(self.config)

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        self.index.extend(context)
        found = self.index.propose(k)
        if not found:
            return Draft(EMPTY_TOKENS)
        return Draft(torch.tensor(found, dtype=torch.long))
