"""Suffix decoding: propose what most often followed the longest match of the text so far, in the request's own
text and in the outputs its segment was served before (ArcticInference's suffix decoding, in spirit).

Two tries answer each round (decoder/drafters/suffix_trie.py): the request's own (its prompt's last ``own_window``
tokens, then everything it emitted, extended as rounds go) and its segment's in the worker's cache of recent outputs
(decoder/drafters/suffix_cache.py). Each proposes the most frequent continuation of its longest match, token by
token while the path's observed frequency stays at least ``min_probability``, at most ``max_tokens_per_match_token``
tokens per matched token and at most the round's K (the plan's rule, as for every drafter). The proposal with the
higher score (the sum of its path frequencies: the tokens it expects to have accepted) is the round's; the
request's own wins ties.

A proposal is a function of the text so far and the cache, never of the target's output for this round, so it is a
one-hot q: acceptance is the deterministic-draft rule (decoder/acceptance.py) and exactness holds as for prompt
lookup.
"""

from __future__ import annotations

from array import array

import torch

from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.drafters.suffix_cache import SuffixCache, SuffixConfig
from decoder.drafters.suffix_trie import Continuation, TextSuffixTrie


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, config: SuffixConfig, cache: SuffixCache | None = None, segment: str = "") -> None:
        self.config = config
        self.cache = cache  # None: the request's own text only
        self.segment = segment
        self.own = TextSuffixTrie(config.depth)
        self.start: int | None = None  # where the indexed text starts in the context (set by the first catch-up)
        self.indexed = 0  # tokens of the context from ``start`` that ``own`` holds
        self.tail: list[int] = []  # the context's last depth - 1 tokens: the longest suffix a trie can match

    def prefill(self, context: torch.Tensor) -> None:
        self._catch_up(context)

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        if k <= 0:
            return Draft(EMPTY_TOKENS)
        self._catch_up(context)
        c = self.config
        best = self.own.continuation(None, k, c.min_probability, c.max_tokens_per_match_token)
        if self.cache is not None and best.score < k:  # (k certain tokens: nothing can score higher)
            shared = self.cache.continuation(self.segment, self.tail, k)
            best = shared if shared.score > best.score else best
        return _draft(best)

    def _catch_up(self, context: torch.Tensor) -> None:
        """Extend the request's trie with what the context gained since the last round."""
        if self.start is None:
            self.start = max(0, context.shape[0] - self.config.own_window)
            self.tail = context[max(0, self.start - self.config.depth + 1) : self.start].tolist()
        end = self.start + self.indexed
        assert context.shape[0] >= end, f"the context shrank from {end} to {context.shape[0]} tokens"
        if context.shape[0] == end:
            return
        new = context[end:].tolist()
        self.own.extend(new)
        self.indexed += len(new)
        self.tail = (self.tail + new)[-(self.config.depth - 1) :]


def _draft(found: Continuation) -> Draft:
    if not found.tokens:
        return Draft(EMPTY_TOKENS)
    return Draft(torch.frombuffer(array("q", found.tokens), dtype=torch.long))  # [k] (a third of torch.tensor's time)
