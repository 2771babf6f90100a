"""A small causal LM as the drafter, with its own KV cache rolled back to what survived verification."""

from __future__ import annotations

import torch

from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.kv_cache import open_sequence
from decoder.models import LoadedModel
from decoder.sampling import SamplingParams, logits_to_probs, sample


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, lm: LoadedModel, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.seq = open_sequence(lm)
        self.params = params
        self.generator = generator
        self.cached_ids = EMPTY_TOKENS  # [self.seq.length] the tokens the cache holds, on CPU

    def prefill(self, context: torch.Tensor) -> None:
        # All but the last token: `propose` always needs at least one unseen token to get logits from.
        # A prompt beyond the draft's own context is not fed at all: `propose` then drafts nothing.
        max_context = self.seq.lm.max_context
        if context.shape[0] > 1 and (max_context is None or context.shape[0] - 1 <= max_context):
            self.seq.forward(context[:-1], logits_to_keep=1)
            self.cached_ids = context[:-1].clone()

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int) -> Draft:
        max_context = self.seq.lm.max_context
        if max_context is not None:
            k = min(k, max_context - context.shape[0] + 1)  # it feeds positions up to L + K - 2
        if k <= 0:
            return Draft(EMPTY_TOKENS)
        # Feed what the cache has not seen (the last round's bonus token, and any accepted draft token
        # that was never fed), then draft one token per step; the last drafted token is not fed.
        feed = context[self.seq.length :]  # [>= 1]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            logits = self.seq.forward(feed, logits_to_keep=1)  # [1, vocab]
            if self.params.is_greedy:
                token = logits.argmax(dim=-1)  # [1]
            else:
                q = logits_to_probs(logits, self.params)  # [1, vocab]
                token = sample(q, self.generator)
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                feed = token
        drafted = torch.cat(tokens).cpu()  # [k]
        self.cached_ids = torch.cat([context, drafted[:-1]])
        return Draft(drafted, torch.cat(probs) if probs else None)

    def rollback(self, context: torch.Tensor) -> None:
        # Keep the longest prefix the cache shares with the verified context, and always leave the last
        # context token unseen so the next round has something to feed.
        keep = min(_common_prefix_length(self.cached_ids, context), context.shape[0] - 1)
        self.seq.truncate(keep)
        self.cached_ids = self.cached_ids[:keep]


def _common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    mismatch = (a[:n] != b[:n]).nonzero()
    return int(mismatch[0, 0]) if mismatch.numel() else n
