"""A small causal LM as the drafter, with its own KV cache rolled back to what survived verification.

Its stop rule: a round ends before position i when the draft's own confidence there, the probability of its
most likely next token, is under ``stop_threshold``. The rule looks only at the draft's distribution, never at
the token it samples, so a shorter draft stays exact: sampled tokens are still drawn from q (stopping on the
sampled token's own probability would bias them towards likely tokens, and rejection sampling with q would then
no longer reproduce the target's distribution).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.kv_cache import ModelSequence, open_sequence
from decoder.models import LoadedModel
from decoder.sampling import SamplingParams, logits_to_probs, sample

# Runs one forward over several sequences at once: rows of (sequence, input_ids [n]) -> last logits [1, vocab].
ForwardMany = Callable[[list[tuple[ModelSequence, torch.Tensor]]], list[torch.Tensor]]


class RunsDraftModel(ABC):
    """A drafter that runs a draft model: an engine that pools KV slots gives the model's slot back when the sequence
    ends, and one that batches the draft model across sequences drafts its rounds itself."""

    @property
    @abstractmethod
    def draft_model(self) -> DraftModelDrafter: ...


def draft_model_of(drafter: Drafter) -> DraftModelDrafter | None:
    """The draft model ``drafter`` runs (a draft model drafter's own, a chain's), or None."""
    return drafter.draft_model if isinstance(drafter, RunsDraftModel) else None


class DraftModelDrafter(Drafter, RunsDraftModel):
    name = "draft"

    def __init__(
        self,
        lm: LoadedModel,
        params: SamplingParams,
        generator: torch.Generator | None,
        sequence: ModelSequence | None = None,
        stop_threshold: float = 0.0,
    ) -> None:
        self.seq = sequence if sequence is not None else open_sequence(lm)
        self.params = params
        self.generator = generator
        self.stop_threshold = stop_threshold  # 0: never stop early
        self.cached_ids = EMPTY_TOKENS  # [self.seq.length] the tokens the cache holds, on CPU

    def prefill(self, context: torch.Tensor) -> None:
        # All but the last token: `propose` always needs at least one unseen token to get logits from.
        # A prompt beyond the draft's own context is not fed at all: `propose` then drafts nothing.
        max_context = self.seq.lm.max_context
        if context.shape[0] > 1 and (max_context is None or context.shape[0] - 1 <= max_context):
            self.seq.forward(context[:-1], logits_to_keep=1)
            self.cached_ids = context[:-1].clone()

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        def forward(rows: list[tuple[ModelSequence, torch.Tensor]]) -> list[torch.Tensor]:
            return [seq.forward(ids, logits_to_keep=1) for seq, ids in rows]

        return propose_together([self], [context], [k], forward)[0]

    @property
    def draft_model(self) -> DraftModelDrafter:
        return self

    def drafts_with_model(self, context: torch.Tensor, k: int) -> bool:
        return k > 0

    def usable_k(self, context: torch.Tensor, k: int) -> int:
        """``k`` cut so that drafting stays inside the draft model's context (it feeds up to L + K - 2)."""
        max_context = self.seq.lm.max_context
        return k if max_context is None else min(k, max_context - context.shape[0] + 1)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The next draft token from ``logits`` [1, vocab] (``pick_token``).  # -> [1], [1, vocab]"""
        return pick_token(logits, self.params, self.generator, self.stop_threshold)

    def rollback(self, context: torch.Tensor) -> None:
        # Keep the longest prefix the cache shares with the verified context, and always leave the last
        # context token unseen so the next round has something to feed.
        keep = min(_common_prefix_length(self.cached_ids, context), context.shape[0] - 1)
        self.seq.truncate(keep)
        self.cached_ids = self.cached_ids[:keep]


@torch.inference_mode()
def propose_together(
    drafters: Sequence[DraftModelDrafter], contexts: Sequence[torch.Tensor], ks: Sequence[int], forward: ForwardMany
) -> list[Draft]:
    """Draft for several sequences, one ``forward`` over all those still drafting per draft position.

    Each sequence first feeds what its cache has not seen (the last round's bonus token, and any accepted
    draft token never fed), then one token per step; its last drafted token is not fed. Sequences draft
    their own K: one that asked for fewer drops out of later passes. The result equals each drafter's
    ``propose`` on its own.  # contexts[i]: [t_i] int64 on CPU
    """
    ks = [d.usable_k(c, k) for d, c, k in zip(drafters, contexts, ks, strict=True)]
    feeds = [c[d.seq.length :] for d, c in zip(drafters, contexts, strict=True)]  # [>= 1] each
    tokens: list[list[torch.Tensor]] = [[] for _ in drafters]
    probs: list[list[torch.Tensor]] = [[] for _ in drafters]
    fed = [False] * len(drafters)  # did the last drafted token go through the draft (a stop rule ended the round)
    for step in range(max(ks, default=0)):
        active = [i for i, k in enumerate(ks) if k > step]
        if not active:
            break
        logits = forward([(drafters[i].seq, feeds[i]) for i in active])  # [1, vocab] each
        for i, row_logits in zip(active, logits, strict=True):
            picked = drafters[i].pick(row_logits[-1:])
            if picked is None:  # the stop rule: this sequence drafts no further this round
                ks[i], fed[i] = step, True
                continue
            token, q = picked
            tokens[i].append(token)
            if q is not None:
                probs[i].append(q)
            feeds[i] = token
    drafts = []
    for i, drafter in enumerate(drafters):
        drafted = torch.cat(tokens[i]).cpu() if tokens[i] else EMPTY_TOKENS  # [k]
        if fed[i]:  # the draft saw every drafted token
            drafter.cached_ids = torch.cat([contexts[i], drafted])
        elif tokens[i]:  # the last drafted token was never fed
            drafter.cached_ids = torch.cat([contexts[i], drafted[:-1]])
        if not tokens[i]:
            drafts.append(Draft(EMPTY_TOKENS))
            continue
        drafts.append(Draft(drafted, torch.cat(probs[i]) if probs[i] else None))
    return drafts


def pick_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, stop_threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A drafter's next token from its ``logits`` [1, vocab], and q when it was sampled (greedy: the argmax, q
    one-hot); None when the stop rule ends the round here (its confidence under ``stop_threshold``, 0: never).
    # -> [1], [1, vocab] | None"""
    if params.is_greedy:
        if stop_threshold > 0 and confidence(logits.float().softmax(dim=-1)) < stop_threshold:
            return None
        return logits.argmax(dim=-1), None
    q = logits_to_probs(logits, params)
    if stop_threshold > 0 and confidence(q) < stop_threshold:
        return None
    return sample(q, generator), q


def confidence(probs: torch.Tensor) -> float:
    """The probability of the most likely token.  # probs: [1, vocab]"""
    return float(probs.max())


def _common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    mismatch = (a[:n] != b[:n]).nonzero()
    return int(mismatch[0, 0]) if mismatch.numel() else n
