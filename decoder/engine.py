"""The speculative decoding loop: draft K -> verify in one target pass -> accept -> roll back -> emit.

Invariant between rounds: the target's KV cache holds every token of the context but the last one,
which is fed at the head of the next verification pass together with the draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from decoder.acceptance import Verdict, greedy_accept, rejection_sample
from decoder.drafters import (
    ChainDrafter,
    Draft,
    Drafter,
    DraftModelDrafter,
    NoDrafter,
    PromptLookupConfig,
    PromptLookupDrafter,
    SuffixCache,
    SuffixConfig,
    SuffixDrafter,
)
from decoder.kv_cache import ModelSequence, open_sequence
from decoder.models import LoadedModel, check_pair
from decoder.sampling import SamplingParams, logits_to_probs, make_generator
from decoder.stopping import StopRules, cut_round, trim_stop_string
from decoder.telemetry import RequestStats, RoundRecord
from specd_api.plan import DRAFTER_NAMES, Plan
from specd_api.speedup import runs_draft_model


def clamp_k(k: int, context_length: int, num_generated: int, rules: StopRules, max_context: int | None) -> int:
    """The largest K <= k that can neither overshoot max_new_tokens nor the model's context.

    A round emits up to K + 1 tokens, and prompt + output must fit the context (as transformers' own
    generate() requires), so K <= remaining budget - 1 and L + K + 1 <= max_context.
    """
    k = min(k, rules.max_new_tokens - num_generated - 1)
    if max_context is not None:
        k = min(k, max_context - context_length - 1)
    return max(k, 0)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # the new tokens, EOS included when it ended the request
    text: str  # decoded new tokens, special tokens skipped, cut before any stop string
    finish_reason: str  # "stop" | "length"
    stats: RequestStats

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "drafter": s.rounds[0].drafter if s.rounds else None,
            "num_rounds": s.num_rounds,
            "num_drafted": s.num_drafted,
            "num_accepted": s.num_accepted,
            "alpha": s.alpha,
            "mean_accepted_length": s.mean_accepted_length,
            "target_forward_passes": s.target_forward_passes,
            "tokens_per_second": s.tokens_per_second,
            "prompt_tokens": s.prompt_tokens,
            "num_new_tokens": s.num_new_tokens,
            "prefill_seconds": s.prefill_seconds,
            "draft_seconds": s.draft_seconds,
            "verify_seconds": s.verify_seconds,
            "accepted_per_position": s.position_tally().proposed_and_accepted(),
        }


class DecodeSession:
    """One sequence being decoded. Call ``prefill`` once, then ``step(k)`` until ``finish_reason`` is set.

    ``k`` is the ceiling of a round; the drafter's schedule picks the round's K under it (``Drafter.next_k``,
    from the plan when one is given).
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        prompt_ids: list[int],
        params: SamplingParams,
        rules: StopRules,
        generator: torch.Generator | None,
        target_sequence: ModelSequence | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if target.max_context is not None and len(prompt_ids) >= target.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the target's context ({target.max_context}) leaves no room "
                "for output"
            )
        self.target = target_sequence if target_sequence is not None else open_sequence(target)
        self.drafter = drafter
        self.params = params
        self.rules = rules
        self.generator = generator
        self.context = torch.tensor(prompt_ids, dtype=torch.long)  # [t] prompt + emitted, on CPU
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))

    def prefill(self) -> None:
        start = time.perf_counter()
        if self.context.shape[0] > 1:
            self.target.forward(self.context[:-1], logits_to_keep=1)
        self.drafter.prefill(self.context)
        self.stats.prefill_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def step(self, k: int) -> list[int]:
        """Run one round with up to ``k`` draft tokens; return the tokens it emitted."""
        k = self.round_k(k)
        # 1. Draft.
        start = time.perf_counter()
        draft = self.drafter.propose(self.context, k)
        drafted = time.perf_counter()
        # 2. Verify the last context token and all K drafts in one target pass.
        logits = self.target.forward(self.verify_input(draft))  # [K + 1, vocab]
        return self.finish_round(k, draft, logits, drafted - start, time.perf_counter() - drafted)

    def round_k(self, ceiling: int) -> int:
        """This round's K: ``ceiling`` cut to the output budget and the target's context, then the drafter's
        choice under it."""
        assert self.finish_reason is None, "step() after the request finished"
        length = self.context.shape[0]
        assert self.target.length == length - 1, "step() before prefill(), or the cache lost its invariant"
        ceiling = clamp_k(ceiling, length, len(self.generated), self.rules, self.target.lm.max_context)
        return self.drafter.next_k(ceiling)

    def verify_input(self, draft: Draft) -> torch.Tensor:
        """What the target runs this round: the last context token, then the draft.  # [K + 1] int64"""
        return torch.cat([self.context[-1:], draft.tokens])

    def rewind(self) -> None:
        """Put both caches back where the last whole round left them (a round that raised part-way may have fed the
        target and the draft model tokens the context does not hold): then ``step`` can run again."""
        if self.target.length >= self.context.shape[0]:
            self.target.truncate(self.context.shape[0] - 1)
        self.drafter.rollback(self.context)

    def finish_round(
        self,
        k: int,
        draft: Draft,
        logits: torch.Tensor,
        draft_seconds: float,
        verify_seconds: float,
        batch_size: int = 1,
    ) -> list[int]:
        """Steps 3-5 of a round, given the target's ``logits`` [K + 1, vocab] on ``verify_input(draft)``.

        ``draft_seconds`` and ``verify_seconds`` are this sequence's share of the drafting and of the target pass;
        the time of these steps is added to the verification time.
        """
        started = time.perf_counter()
        length = self.context.shape[0]

        # 3. Accept.
        verdict = self._accept(draft.tokens, draft.probs, logits)

        # 4. Emit, cut at EOS, stop strings and max_new_tokens.
        new_tokens = [*draft.tokens[: verdict.num_accepted].tolist(), verdict.next_token]
        cut = cut_round(self.generated, new_tokens, self.rules, self._decode)
        emitted = new_tokens[: cut.keep]
        self.generated.extend(emitted)
        self.context = torch.cat([self.context, torch.tensor(emitted, dtype=torch.long)])

        # 5. Roll both caches back to the accepted prefix; the bonus token is fed next round.
        self.target.truncate(length + verdict.num_accepted)
        self.drafter.rollback(self.context)
        self.drafter.update(draft.num_tokens, verdict.num_accepted)
        self.finish_reason = cut.finish_reason
        max_context = self.target.lm.max_context
        if self.finish_reason is None and max_context is not None and self.context.shape[0] >= max_context:
            self.finish_reason = "length"  # the context is full
        self.stats.observe(
            RoundRecord(
                drafter=self.drafter.name,
                k=k,
                num_drafted=draft.num_tokens,
                num_accepted=verdict.num_accepted,
                num_emitted=len(emitted),
                draft_seconds=draft_seconds,
                verify_seconds=verify_seconds + time.perf_counter() - started,
                batch_size=batch_size,
            )
        )
        return emitted

    def _accept(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor) -> Verdict:
        # draft_tokens: [k] CPU, draft_probs: [k, vocab] | None, logits: [k + 1, vocab]
        if self.params.is_greedy:
            return greedy_accept(draft_tokens, logits.argmax(dim=-1).cpu())
        target_probs = logits_to_probs(logits, self.params)  # [k + 1, vocab]
        return rejection_sample(draft_tokens.to(logits.device), draft_probs, target_probs, self.generator)

    def _decode(self, token_ids: Any) -> str:
        return str(self.target.lm.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, "result() before the request finished"
        text = trim_stop_string(self._decode(self.generated), self.rules.stop_strings)
        return GenerationResult(list(self.generated), text, self.finish_reason, self.stats)


class SpeculativeDecoder:
    """A loaded target, optionally a draft model, and the drafters they make possible. ``suffix_cache`` holds the
    outputs suffix decoding proposes from (one per worker: whoever serves requests fills it); by default an empty
    one, so suffix decoding reads the request's own text until something is added."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        prompt_lookup: PromptLookupConfig | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        if draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.prompt_lookup = prompt_lookup or PromptLookupConfig()
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters this worker can run: those that run the draft model (draft, chain) only with one."""
        return tuple(name for name in DRAFTER_NAMES if self.draft is not None or not runs_draft_model(name))

    def encode(self, text: str) -> list[int]:
        return list(self.target.tokenizer(text, add_special_tokens=True)["input_ids"])

    def session(
        self,
        prompt_ids: list[int],
        drafter: str,
        params: SamplingParams,
        rules: StopRules,
        plan: Plan | None = None,
    ) -> DecodeSession:
        """A sequence decoded with ``drafter``; with a ``plan``, K is chosen per round by its rule and the draft
        model stops at its threshold."""
        generator = make_generator(params.seed, self.target.device)
        made = self._make_drafter(drafter, params, generator, plan)
        return DecodeSession(self.target, made, prompt_ids, params, rules, generator)

    def generate(
        self,
        prompt_ids: list[int],
        drafter: str,
        k: int,
        params: SamplingParams,
        rules: StopRules,
        plan: Plan | None = None,
    ) -> GenerationResult:
        """Decode one request with ceiling ``k`` every round (each round at ``k`` unless a ``plan`` adapts it; use
        ``session`` to change the ceiling between rounds)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        session = self.session(prompt_ids, drafter, params, rules, plan)
        session.prefill()
        while session.finish_reason is None:
            session.step(k)
        return session.result()

    def _make_drafter(
        self, name: str, params: SamplingParams, generator: torch.Generator | None, plan: Plan | None = None
    ) -> Drafter:
        return make_drafter(name, self.draft, self.prompt_lookup, params, generator, plan=plan,
                            suffix_cache=self.suffix_cache)  # fmt: skip


def make_drafter(
    name: str,
    draft: LoadedModel | None,
    prompt_lookup: PromptLookupConfig,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_sequence: ModelSequence | None = None,
    plan: Plan | None = None,
    suffix_cache: SuffixCache | None = None,
) -> Drafter:
    """The drafter called ``name`` for one sequence (the draft model's cache in ``draft_sequence`` if given),
    choosing K per round by ``plan`` when given; suffix decoding reads ``suffix_cache`` for the plan's segment."""
    made: Drafter
    if runs_draft_model(name):
        if draft is None:
            raise ValueError(f"drafter {name!r} needs a draft model (--draft PATH)")
        threshold = plan.stop_threshold if plan is not None else 0.0
        model = DraftModelDrafter(draft, params, generator, draft_sequence, stop_threshold=threshold)
        made = ChainDrafter(PromptLookupDrafter(prompt_lookup), model) if name == "chain" else model
    elif name == "prompt_lookup":
        made = PromptLookupDrafter(prompt_lookup)
    elif name == "suffix":
        config = suffix_cache.config if suffix_cache is not None else SuffixConfig()
        made = SuffixDrafter(config, suffix_cache, plan.segment if plan is not None else "")
    elif name == "none":
        made = NoDrafter()
    else:
        raise ValueError(f"unknown drafter {name[:40]!r}; choose one of {', '.join(DRAFTER_NAMES)}")
    if plan is not None and plan.adaptive:
        made.adapt(plan)
    return made


def counterfactual_k(plan: Plan | None, drafter: str) -> int:
    """The ceiling prompt lookup is replayed at over a request's output (decoder.counterfactual): the plan's, unless
    prompt lookup is what ran (its own rounds are then the data)."""
    if plan is None or drafter == "prompt_lookup":
        return 0
    return max(plan.counterfactual_k, 0)
