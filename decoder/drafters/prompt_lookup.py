"""Prompt lookup decoding: propose what followed the last time the current n-gram appeared.

``find_continuation`` is the rule, a pure function on an array (as in vLLM's n-gram proposer). ``NgramIndex``
computes the same answer incrementally: it keeps the most recent earlier occurrences of every n-gram of a growing
sequence in a hash map, updated once per new token, so a proposal costs a few dictionary lookups instead of a
scan of the whole context per n-gram size. A deterministic proposal is a one-hot q for rejection sampling, so
the draft carries no probabilities.

With ``branches`` above 1, and a target pass that verifies trees, a round proposes the continuations of up to that
many matches (the longest n-grams first, the most recent first among equals) as one tree, their shared prefixes
merged (``DraftTree.of_branches``): the target verifies them all in one pass, and the round keeps the longest path
the target agrees with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decoder.choices import MAX_BRANCHES
from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.tree import DraftTree


@dataclass(frozen=True, slots=True)
class PromptLookupConfig:
    min_ngram: int = 1
    max_ngram: int = 3
    branches: int = 1  # matches proposed together as a tree (1: a chain, the latest match's)

    def __post_init__(self) -> None:
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(
                f"prompt lookup n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}"
            )
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise ValueError(f"prompt lookup branches must be in 1..{MAX_BRANCHES}, got {self.branches}")


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
        # n -> n-gram -> its latest starts, the most recent first, at most ``config.branches``
        self._latest: dict[int, dict[tuple[int, ...], list[int]]] = {
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
                    starts = latest.setdefault(tuple(self.tokens[end - n : end]), [])
                    starts.insert(0, end - n)
                    del starts[self.config.branches :]

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the trailing n-gram (longest first)."""
        found = self.propose_many(k, 1)
        return found[0] if found else []

    def propose_many(self, k: int, branches: int) -> list[list[int]]:
        """What followed up to ``branches`` earlier occurrences of the trailing n-grams, up to ``k`` tokens each,
        every one different: the longest n-gram's first, the most recent first among one n-gram's."""
        t = len(self.tokens)
        found: list[list[int]] = []
        if k <= 0:
            return found
        for n in range(min(self.config.max_ngram, t - 1), self.config.min_ngram - 1, -1):
            for start in self._latest[n].get(tuple(self.tokens[t - n :]), ()):
                continuation = self.tokens[start + n : start + n + k]
                if continuation not in found:
                    found.append(continuation)
                if len(found) == branches:
                    return found
        return found


class PromptLookupDrafter(Drafter):
    """Prompt lookup for one sequence; ``trees``: its target's pass verifies trees (else every round is a chain,
    whatever ``config.branches`` says)."""

    name = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None, trees: bool = False) -> None:
        self.config = config or PromptLookupConfig()
        self.branches = self.config.branches if trees else 1
        self.index = NgramIndex(self.config)

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        self.index.extend(context)
        found = self.index.propose_many(k, self.branches)
        if not found:
            return Draft(EMPTY_TOKENS)
        if len(found) == 1:
            return Draft(torch.tensor(found[0], dtype=torch.long))
        tree = DraftTree.of_branches(found)
        return Draft(torch.tensor(tree.tokens, dtype=torch.long), tree=tree)
