"""Continuous batching: several sequences decoded together, one round each per step, with ragged acceptance.

Sequences join (prefill) and leave between steps. Each step drafts for every sequence (the draft model in
one batched pass per draft position, a chain's rounds that lookup cannot serve included; prompt lookup per
sequence), verifies all of them in one batched target pass, and lets each sequence accept and roll back on its
own: each advances by its own accepted count, and no accepted token is ever recomputed (the KV slots are
truncated, not rebuilt).
A sequence asked to draft 0 tokens decodes one plain target step in the same pass.

Costs are attributed per sequence, as the controller learns them: each sequence is charged an equal share of
every batched pass it took part in (a draft pass per position among the sequences still drafting; the target
pass among all), plus the work done for it alone (its prompt lookup, its acceptance and rollback).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from decoder.drafters import Draft, Drafter, DraftModelDrafter, PromptLookupConfig, SuffixCache
from decoder.drafters.draft_model import propose_together
from decoder.engine import DecodeSession, SpeculativeDecoder, make_drafter
from decoder.kv_cache import ModelSequence
from decoder.models import LoadedModel
from decoder.runners import KVPool, PooledSequence
from decoder.sampling import SamplingParams, make_generator
from decoder.stopping import StopRules
from specd_api.plan import Plan
from specd_api.speedup import runs_draft_model

WARM_UP_MAX_K = 8  # the K ceilings the default policy lets the draft model run
WARM_UP_BATCH_SIZES = (1, 2, 4)
WARM_UP_PROMPT_TOKENS = 64


class BatchEngine(SpeculativeDecoder):
    """A SpeculativeDecoder with KV slots for ``max_batch`` sequences decoded together (``open``/``step``)."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        prompt_lookup: PromptLookupConfig | None = None,
        max_batch: int = 16,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        super().__init__(target, draft, prompt_lookup, suffix_cache)
        self.max_batch = max_batch
        self.target_pool = KVPool(target, max_batch, capacity=target.max_context or 1024)
        self.draft_pool = KVPool(draft, max_batch, capacity=draft.max_context or 1024) if draft else None
        self._stalls: dict[DecodeSession, tuple[int, float]] = {}  # injected: session -> (round, seconds)

    @property
    def free_slots(self) -> int:
        return self.target_pool.free_slots

    def open(
        self, prompt_ids: list[int], drafter: str, params: SamplingParams, rules: StopRules, plan: Plan | None = None
    ) -> DecodeSession:
        """A new sequence in a free slot, prefilled and ready for ``step``. Raises ValueError on a bad request."""
        generator = make_generator(params.seed, self.target.device)
        target_seq = self.target_pool.open()
        made: Drafter | None = None
        try:
            made = self._pooled_drafter(drafter, params, generator, plan)
            session = DecodeSession(self.target, made, prompt_ids, params, rules, generator, target_seq)
            session.prefill()
        except BaseException:
            self.target_pool.release(target_seq)
            if made is not None:
                self._release_drafter(made)
            raise
        return session

    def close(self, session: DecodeSession) -> None:
        """Give the sequence's KV slots back (finished or cancelled)."""
        assert isinstance(session.target, PooledSequence)
        self._stalls.pop(session, None)
        self.target_pool.release(session.target)
        self._release_drafter(session.drafter)

    @torch.inference_mode()
    def step(self, sessions: Sequence[DecodeSession], ks: Sequence[int]) -> list[list[int]]:
        """One round for each session (ceiling ``ks[i]``; the round's K is its drafter's choice under it, cut to
        the budget); returns the tokens each emitted."""
        assert len(sessions) == len(ks) and sessions, (len(sessions), len(ks))
        ks = [s.round_k(k) for s, k in zip(sessions, ks, strict=True)]
        # 1. Draft, batched across the sequences that use the draft model; each is charged its share.
        draft_seconds = [0.0] * len(sessions)
        drafts = self._draft(sessions, ks, draft_seconds)
        # 2. Verify every sequence's last token + draft in one target pass.
        rows: list[tuple[PooledSequence, torch.Tensor]] = []
        for s, d in zip(sessions, drafts, strict=True):
            assert isinstance(s.target, PooledSequence)
            rows.append((s.target, s.verify_input(d)))
        started = time.perf_counter()
        logits = self.target_pool.forward_many(rows)  # [K_i + 1, vocab] each
        self._stall(sessions)  # an injected stall lands inside the timed pass, as a real one would
        verify_share = (time.perf_counter() - started) / len(sessions)
        # 3-5. Accept, emit and roll back, each sequence on its own.
        return [
            s.finish_round(k, d, out, seconds, verify_share, len(sessions))
            for s, k, d, out, seconds in zip(sessions, ks, drafts, logits, draft_seconds, strict=True)
        ]

    def inject_stall(self, session: DecodeSession, seconds: float, at_round: int) -> None:
        """Fault injection (decoder.worker.fault_injection): sleep ``seconds`` once, inside the timed target pass of
        ``session``'s round ``at_round`` (0-based), so that its round record and telemetry carry the stall."""
        self._stalls[session] = (at_round, seconds)

    def _stall(self, sessions: Sequence[DecodeSession]) -> None:
        for s in sessions:
            due = self._stalls.get(s)
            if due is not None and s.stats.num_rounds >= due[0]:
                del self._stalls[s]
                time.sleep(due[1])

    def warm_up(self, max_k: int = WARM_UP_MAX_K, batch_sizes: Sequence[int] = WARM_UP_BATCH_SIZES) -> int:
        """Decode a few rounds of every drafter at every K up to ``max_k`` and at each batch size, before serving.
        The first pass of each shape pays one-off costs (kernel selection, buffers): served, those rounds ran up to
        25 % slower, and the controller learned them as costs. Nothing here is reported. Returns the rounds run."""
        span = max(min(97, self.target.vocab_size - 3), 1)
        prompt = [(i * 7) % span + 3 for i in range(WARM_UP_PROMPT_TOKENS // 2)] * 2  # repeats: lookup finds n-grams
        rules = StopRules(max_new_tokens=2 * max_k * (max_k + 1) + 8)
        rounds = 0
        for drafter in self.drafters:
            if drafter == "chain":
                continue  # its rounds are prompt lookup's and the draft model's, in the shapes warmed for those
            for batch in sorted({min(b, self.free_slots) for b in batch_sizes if b >= 1}):
                sessions = [self.open(prompt, drafter, SamplingParams(), rules) for _ in range(batch)]
                try:
                    for k in [0] if drafter == "none" else range(1, max_k + 1):
                        for _ in range(2):
                            live = [s for s in sessions if s.finish_reason is None]
                            if live:
                                self.step(live, [k] * len(live))
                                rounds += 1
                finally:
                    for session in sessions:
                        self.close(session)
        return rounds

    def _draft(self, sessions: Sequence[DecodeSession], ks: Sequence[int], seconds: list[float]) -> list[Draft]:
        """Every session's draft; adds each one's share of the drafting time to ``seconds[i]``."""
        drafts: list[Draft | None] = [None] * len(sessions)
        # The sequences whose round the draft model drafts (a chain's when prompt lookup finds no match).
        together: list[int] = []
        models: list[DraftModelDrafter] = []
        for i, s in enumerate(sessions):
            started = time.perf_counter()
            model = s.drafter.draft_model
            if model is not None and s.drafter.drafts_with_model(s.context, ks[i]):
                together.append(i)
                models.append(model)
            seconds[i] += time.perf_counter() - started
        if together:
            pool = self.draft_pool
            assert pool is not None
            row_of = {id(m.seq): i for i, m in zip(together, models, strict=True)}

            def forward(batch: list[tuple[ModelSequence, torch.Tensor]]) -> list[torch.Tensor]:
                rows = [(seq, ids) for seq, ids in batch if isinstance(seq, PooledSequence)]
                assert len(rows) == len(batch)
                started = time.perf_counter()
                out = pool.forward_many(rows, logits_to_keep=1)
                share = (time.perf_counter() - started) / len(rows)
                for seq, _ in rows:
                    seconds[row_of[id(seq)]] += share
                return out

            started = time.perf_counter()
            made = propose_together(
                models,
                [sessions[i].context for i in together],
                [ks[i] for i in together],
                forward,
            )
            # Picking tokens (sampling, the stop rule) ran per sequence between the passes: split it evenly too.
            rest = time.perf_counter() - started - sum(seconds[i] for i in together)
            for i, draft in zip(together, made, strict=True):
                drafts[i] = draft
                seconds[i] += max(rest, 0.0) / len(together)
        for i, (s, k) in enumerate(zip(sessions, ks, strict=True)):
            if drafts[i] is None:
                started = time.perf_counter()
                drafts[i] = s.drafter.propose(s.context, k)
                seconds[i] += time.perf_counter() - started
        return [d for d in drafts if d is not None]

    def _pooled_drafter(
        self, name: str, params: SamplingParams, generator: torch.Generator | None, plan: Plan | None
    ) -> Drafter:
        """Like ``_make_drafter``, with the draft model's cache in a slot of the pool (released by ``close``)."""
        sequence = self.draft_pool.open() if runs_draft_model(name) and self.draft_pool is not None else None
        return make_drafter(name, self.draft, self.prompt_lookup, params, generator, sequence, plan, self.suffix_cache)

    def _release_drafter(self, drafter: Drafter) -> None:
        model = drafter.draft_model
        if model is not None and self.draft_pool is not None:
            assert isinstance(model.seq, PooledSequence)
            self.draft_pool.release(model.seq)
