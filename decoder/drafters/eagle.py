"""The ``eagle`` drafter: an EAGLE-3 head (decoder/heads) drafting from the target's own hidden states.

The target's passes hand it the states of every token they keep (``observe``: the engine taps the prefill and each
verification pass, decoder.runners.base.FeatureTap), so it runs no target pass of its own: row p of its states is
the target's at context token p, known for every token but the context's last. Its cache's entries
0..``fed`` - 1 are built from those; a round first feeds the entries the last verification made known (entry p:
token p's states with token p + 1, one batch), then drafts one token per entry from its own output. Rollback drops
every entry built from its own output and the states of tokens no longer in the context.

Exact as any drafter: greedy drafts are the head's argmax, sampled ones are drawn from q (its probabilities over
the target's vocabulary, 0 off its draft vocabulary) and carried with the draft for rejection sampling.
"""

from __future__ import annotations

import torch

from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter
from decoder.drafters.draft_model import pick_token
from decoder.heads import LoadedHead
from decoder.heads.runner import runner_for
from decoder.runners.kv import INITIAL_CAPACITY, grown_capacity
from decoder.sampling import SamplingParams


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, loaded: LoadedHead, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.head = loaded.head
        self.params, self.generator = params, generator
        self.runner = runner_for(self.head)  # the head's layer for this sequence: native where it applies
        self.target_ids = self.head.target_ids()  # [draft_vocab] each draft row's target id
        weight = self.head.fc.weight
        # rows 0..known-1: the target's states at context tokens 0..known-1 (grown by doubling, never copied per round)
        self._states = torch.empty(INITIAL_CAPACITY, self.head.shape.features, dtype=weight.dtype, device=weight.device)
        self.known = 0
        self.fed = 0  # cache entries built from the target's states

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.shape.aux_layers

    def observe(self, states: torch.Tensor) -> None:
        """The target's states of the tokens its last pass kept, in context order.  # [m, f]"""
        end = self.known + int(states.shape[0])
        if end > self._states.shape[0]:
            grown = self._states.new_empty(grown_capacity(self._states.shape[0], end), self._states.shape[1])
            grown[: self.known] = self._states[: self.known]
            self._states = grown
        self._states[self.known : end] = states
        self.known = end

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int) -> Draft:
        t = int(context.shape[0])
        if k < 1 or t < 2 or self.known < t - 1:
            return Draft(EMPTY_TOKENS)  # no states for the context (the target's pass handed none)
        start = min(self.fed, t - 2)  # at least the last known entry: its output drafts the first token
        self.runner.truncate(start)
        device = self._states.device
        out, logits = self.runner.feed(self._states[start : t - 1], context[start + 1 : t].to(device))
        self.fed = t - 1
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for position in range(k):
            token, q = self.pick(logits)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if position + 1 < k:
                out, logits = self.runner.step(out, token.to(device))
        drafted = torch.cat(tokens).cpu()
        return Draft(drafted, torch.cat(probs) if probs else None)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token from the head's draft-vocabulary ``logits`` [1, draft_vocab], as a target id, and q over
        the target's vocabulary when sampled.  # -> [1], [1, vocab] | None"""
        if self.params.is_greedy:  # the argmax, mapped: no logits over the whole vocabulary needed
            return self.target_ids[logits.argmax(dim=-1)].cpu(), None
        picked = pick_token(self.head.spread(logits), self.params, self.generator)
        assert picked is not None  # no stop rule: every position drafts
        return picked

    def rollback(self, context: torch.Tensor) -> None:
        self.known = min(self.known, int(context.shape[0]) - 1)
        self.fed = min(self.fed, self.known)
        self.runner.truncate(self.fed)
