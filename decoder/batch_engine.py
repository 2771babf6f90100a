"""Continuous batching: several sequences decoded together, one round each per step, with ragged acceptance.

Sequences join (prefill) and leave between steps. Each sequence opens with its plan, held by its round policy
(specd_api/round_policy.py), which answers its K every step: the batch rule at the step's batch size first, then
its ceiling cut to its budget, then its plan's rule. Each step drafts for every sequence (the draft model in
one batched pass per draft position, a chain's rounds that lookup cannot serve included; prompt lookup per
sequence), verifies all of them in one batched target pass, and lets each sequence accept and roll back on its
own: each advances by its own accepted count, and no accepted token is ever recomputed (the KV slots are
truncated, not rebuilt).
A sequence whose round runs at K = 0 decodes one plain target step in the same pass.

Costs are attributed per sequence, as the controller learns them: each sequence is charged an equal share of
every batched pass it took part in (a draft pass per position among the sequences still drafting; the target
pass among all), plus the work done for it alone (its prompt lookup, its acceptance and rollback).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from decoder.drafters import Draft, Drafter, DraftModelDrafter, PromptLookupConfig, SuffixCache
from decoder.drafters.draft_model import draft_model_of, propose_together
from decoder.engine import DecodeSession, SpeculativeDecoder
from decoder.heads import LoadedHead
from decoder.kv_cache import ModelSequence
from decoder.models import LoadedModel
from decoder.request_stop import StopConditions
from decoder.runners import KVPool, PooledSequence
from decoder.runners.base import FeatureTap
from decoder.sampling import SamplingParams, make_generator
from specd_api.plan import Plan, requested
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
        head: LoadedHead | None = None,
    ) -> None:
        super().__init__(target, draft, prompt_lookup, suffix_cache, head)
        self.max_batch = max_batch
        self.target_pool = KVPool(target, max_batch, capacity=target.max_context or 1024)
        self.draft_pool = KVPool(draft, max_batch, capacity=draft.max_context or 1024) if draft else None
        self._stalls: dict[DecodeSession, tuple[int, float]] = {}  # injected: session -> (round, seconds)

    @property
    def free_slots(self) -> int:
        return self.target_pool.free_slots

    def open(self, prompt_ids: list[int], params: SamplingParams, rules: StopConditions, plan: Plan) -> DecodeSession:
        """A new sequence in a free slot, decoded as ``plan`` says, prefilled: its first token emitted
        (``session.generated``), and ready for ``step`` unless that finished it (``session.finish_reason``). Raises
        ValueError on a bad request (a drafter this engine does not offer, a prompt too long)."""
        generator = make_generator(params.seed, self.target.device)
        target_seq = self.target_pool.open()
        draft_seq: PooledSequence | None = None
        try:
            if runs_draft_model(plan.drafter) and self.draft_pool is not None:
                draft_seq = self.draft_pool.open()
            policy = self._open_policy(plan, params, generator, draft_seq, target_seq.verifies_trees)
            session = DecodeSession(self.target, policy, prompt_ids, params, rules, generator, target_seq)
            session.prefill()
        except BaseException:
            self.target_pool.release(target_seq)
            if draft_seq is not None:
                assert self.draft_pool is not None
                self.draft_pool.release(draft_seq)
            raise
        return session

    def close(self, session: DecodeSession) -> None:
        """Give the sequence's KV slots back (finished or cancelled)."""
        assert isinstance(session.target, PooledSequence)
        self._stalls.pop(session, None)
        self.target_pool.release(session.target)
        self._release_drafter(session.drafter)

    @torch.inference_mode()
    def step(self, sessions: Sequence[DecodeSession]) -> list[list[int]]:
        """One round for each session, decoded together (each one's K is its round policy's at this batch size);
        returns the tokens each emitted."""
        assert sessions, "a step of no sequence"
        ks = [s.policy.round_k(len(sessions), s.draft_budget()) for s in sessions]
        # 1. Draft, batched across the sequences that use the draft model; each is charged its share.
        draft_seconds = [0.0] * len(sessions)
        drafts = self._draft(sessions, ks, draft_seconds)
        # 2. Verify every sequence's last token + draft in one target pass.
        rows: list[tuple[PooledSequence, torch.Tensor]] = []
        for s, d in zip(sessions, drafts, strict=True):
            assert isinstance(s.target, PooledSequence)
            rows.append((s.target, s.verify_input(d)))
        taps = [s.feature_tap() for s in sessions]
        wanted = {tap.layers for tap in taps if tap is not None}
        assert len(wanted) <= 1, f"one pass taps one set of layers, not {sorted(wanted)}"
        tap = FeatureTap(wanted.pop()) if wanted else None
        started = time.perf_counter()
        logits = self.target_pool.forward_many(rows, trees=[d.tree for d in drafts], tap=tap)  # [k_i + 1, vocab] each
        self._stall(sessions)  # an injected stall lands inside the timed pass, as a real one would
        states = [  # each sequence's states where its drafter reads them: [k_i + 1, f] each, or None
            tap.rows[i] if tap is not None and tap.rows is not None and mine is not None else None
            for i, mine in enumerate(taps)
        ]
        verify_share = (time.perf_counter() - started) / len(sessions)
        # 3-5. Accept, emit and roll back, each sequence on its own (the greedy ones' argmaxes taken together).
        argmaxes = greedy_argmaxes([s.params.is_greedy for s in sessions], logits)
        return [
            s.finish_round(k, d, out, seconds, verify_share, len(sessions), argmax, mine)
            for s, k, d, out, seconds, argmax, mine in zip(
                sessions, ks, drafts, logits, draft_seconds, argmaxes, states, strict=True
            )
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

    def capture_graphs(self) -> int:
        """Capture every step shape of the target's and the draft's pools, before serving: with the graphs pass on a
        GPU, one CUDA graph per bucket (decoder/runners/buckets.py), so that no step of a served request stalls on a
        capture. The number captured: 0 on a CPU (and for the eager passes), where this costs nothing."""
        return sum(pool.capture_all() for pool in (self.target_pool, self.draft_pool) if pool is not None)

    def warm_up(self, max_k: int = WARM_UP_MAX_K, batch_sizes: Sequence[int] = WARM_UP_BATCH_SIZES) -> int:
        """Decode a few rounds of every drafter at every K up to ``max_k`` and at each batch size, before serving.
        The first pass of each shape pays one-off costs (kernel selection, buffers): served, those rounds ran up to
        25 % slower, and the controller learned them as costs. Nothing here is reported. Returns the rounds run."""
        span = max(min(97, self.target.vocab_size - 3), 1)
        prompt = [(i * 7) % span + 3 for i in range(WARM_UP_PROMPT_TOKENS // 2)] * 2  # repeats: lookup finds n-grams
        rules = StopConditions(max_new_tokens=2 * max_k * (max_k + 1) + 8)
        rounds = 0
        for drafter in self.drafters:
            if drafter == "chain":
                continue  # its rounds are prompt lookup's and the draft model's, in the shapes warmed for those
            ks = [k for k in ([0] if drafter == "none" else range(1, max_k + 1)) for _ in range(2)]  # 2 rounds per K
            for batch in sorted({min(b, self.free_slots) for b in batch_sizes if b >= 1}):
                # Every shape, whatever the batch rule would say: the plan's threshold is the batch.
                plan = requested(drafter, max(ks), ks, max_batch_size=batch)
                sessions = [self.open(prompt, SamplingParams(), rules, plan) for _ in range(batch)]
                try:
                    for _ in ks:
                        live = [s for s in sessions if s.finish_reason is None]
                        if live:
                            self.step(live)
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
            if ks[i] > 0:
                s.ready_drafter()  # its first drafting round: the drafter prefills (timed apart)
            started = time.perf_counter()
            model = draft_model_of(s.drafter)
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

    def _release_drafter(self, drafter: Drafter) -> None:
        model = draft_model_of(drafter)
        if model is not None and self.draft_pool is not None:
            assert isinstance(model.seq, PooledSequence)
            self.draft_pool.release(model.seq)


def greedy_argmaxes(greedy: Sequence[bool], logits: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each greedy sequence's argmax per row, on the host, from one argmax over all their rows and one copy (one
    host synchronisation per step on a GPU, not one per sequence); None for a sampled one. An argmax is per row, so
    taking it together changes no token.
    # logits: [k_i + 1, vocab] each -> [k_i + 1] int64 each (or None)"""
    chosen = [out for out, g in zip(logits, greedy, strict=True) if g]
    if not chosen:
        return [None] * len(logits)
    together = iter(torch.cat(chosen).argmax(dim=-1).cpu().split([out.shape[0] for out in chosen]))
    return [next(together) if g else None for g in greedy]
