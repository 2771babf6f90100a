"""The speculative decoding loop: draft K -> verify in one target pass -> accept -> roll back -> emit.

A sequence runs its plan through its round policy (specd_api/round_policy.py), built when it opens: the policy holds
the drafter and answers each round's K; the loop tells it what each round kept.

The first token never waits for a drafter: the target's prefill of the whole prompt gives it (its last position's
logits, chosen as any plain round chooses), and it is emitted then. The drafter prefills before the first round that
drafts, timed apart (``RequestStats.draft_prefill_seconds``): a request that never drafts never pays it.

Invariant between rounds: the target's KV cache holds every token of the context but the last one,
which is fed at the head of the next verification pass together with the draft.

Shapes in the notation of ``decoder/__init__.py``: ``t`` the context, ``k`` the tokens drafted this round.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decoder.acceptance import Verdict, greedy_accept, rejection_sample
from decoder.capped_encoding import CappedEncoder, PromptTooLong, TooLong
from decoder.counterfactual import replay
from decoder.drafters import (
    EMPTY_TOKENS,
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
    draft_model_of,
)
from decoder.drafters.eagle import EagleDrafter
from decoder.heads import LoadedHead
from decoder.kv_cache import ModelSequence, SparePools, open_sequence
from decoder.models import LoadedModel, check_pair
from decoder.request_stop import StopConditions, cut_round, draft_budget, trim_stop_string
from decoder.runners.base import FeatureTap
from decoder.sampling import SamplingParams, logits_to_probs, make_generator
from decoder.telemetry import RequestStats
from decoder.tree import DraftTree, TreeVerdict, greedy_path, offered_along, sample_path
from specd_api.errors import ModelLoadError
from specd_api.plan import DRAFTER_NAMES, SCORABLE, Plan, offers, requested
from specd_api.round_policy import RoundPolicy
from specd_api.rounds import RoundRecord, Scored
from specd_api.speedup import runs_draft_model, runs_head


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
            "draft_prefill_seconds": s.draft_prefill_seconds,
            "draft_seconds": s.draft_seconds,
            "verify_seconds": s.verify_seconds,
            "accepted_per_position": s.position_tally().proposed_and_accepted(),
        }


class DecodeSession:
    """One sequence being decoded. Call ``prefill`` once, then ``step()`` until ``finish_reason`` is set.

    Its ``policy`` (built from its plan when it opened) holds its drafter and picks each round's K.
    """

    def __init__(
        self,
        target: LoadedModel,
        policy: RoundPolicy[Drafter],
        prompt_ids: list[int],
        params: SamplingParams,
        rules: StopConditions,
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
        self.policy = policy
        self.params = params
        self.rules = rules
        self.generator = generator
        self.context = torch.tensor(prompt_ids, dtype=torch.long)  # [t] prompt + emitted, on CPU
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        self.drafter_ready = False  # the drafter has prefilled (``ready_drafter``)

    @property
    def drafter(self) -> Drafter:
        return self.policy.drafter

    @torch.inference_mode()
    def prefill(self) -> list[int]:
        """The target's prefill of the prompt; its last logits give the first token, emitted now (returned; empty
        when a stop string cut it). The request may be finished by it (EOS, a stop, max_new_tokens 1)."""
        start = time.perf_counter()
        tap = self.feature_tap()
        logits = self.target.forward(self.context, logits_to_keep=1, tap=tap)  # [1, vocab]: the prompt's last position
        if tap is not None and tap.rows is not None:
            self.drafter.observe(tap.rows[0])  # every prompt token's states
        verdict = self._accept(EMPTY_TOKENS, None, logits)
        emitted = self._emit([verdict.next_token])
        self.stats.prefill_seconds = time.perf_counter() - start
        self.stats.prefill_tokens = len(emitted)
        return emitted

    def ready_drafter(self) -> None:
        """Prefill the drafter (once, before its first round that drafts), timed apart from drafting."""
        if self.drafter_ready:
            return
        start = time.perf_counter()
        self.drafter.prefill(self.context)
        self.drafter_ready = True
        self.stats.draft_prefill_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def step(self) -> list[int]:
        """Run one round, alone (a batch of one); return the tokens it emitted."""
        k = self.policy.round_k(1, self.draft_budget())
        if k > 0:
            self.ready_drafter()
        # 1. Draft.
        start = time.perf_counter()
        draft = self.drafter.propose(self.context, k)
        drafted = time.perf_counter()
        # 2. Verify the last context token and all K drafts (or the tree's nodes) in one target pass.
        tap = self.feature_tap()
        logits = self.target.forward(self.verify_input(draft), tree=draft.tree, tap=tap)  # [k + 1, vocab]
        states = tap.rows[0] if tap is not None and tap.rows is not None else None
        return self.finish_round(k, draft, logits, drafted - start, time.perf_counter() - drafted, states=states)

    def feature_tap(self) -> FeatureTap | None:
        """What the target's next pass must hand this sequence's drafter besides logits (a head's states)."""
        layers = self.drafter.feature_layers
        return FeatureTap(layers) if layers else None

    def draft_budget(self) -> int:
        """The most tokens the next round may draft before the output budget or the target's context runs out."""
        assert self.finish_reason is None, "step() after the request finished"
        length = self.context.shape[0]
        assert self.target.length == length - 1, "step() before prefill(), or the cache lost its invariant"
        return draft_budget(length, len(self.generated), self.rules, self.target.lm.max_context)

    def verify_input(self, draft: Draft) -> torch.Tensor:
        """What the target runs this round: the last context token, then the draft.  # [k + 1] int64"""
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
        target_argmax: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> list[int]:
        """Steps 3-5 of a round, given the target's ``logits`` [K + 1, vocab] on ``verify_input(draft)`` (and its
        hidden states there, [K + 1, f], where the drafter reads them: ``feature_tap``).

        ``draft_seconds`` and ``verify_seconds`` are this sequence's share of the drafting and of the target pass;
        the time of these steps is added to the verification time. ``target_argmax`` (greedy only, on the host):
        the logits' argmax per row where the caller took it for a whole batch at once (``greedy_argmaxes``).
        """
        started = time.perf_counter()
        length = self.context.shape[0]

        # 3. Accept: a chain's longest kept prefix, or a tree's path.
        if draft.tree is None:
            verdict = self._accept(draft.tokens, draft.probs, logits, target_argmax)
            kept, offered = draft.tokens[: verdict.num_accepted].tolist(), draft.num_tokens
        else:
            path = self._accept_tree(draft.tree, logits, target_argmax)
            verdict = Verdict(path.num_accepted, path.next_token)
            kept, offered = draft.tree.tokens_of(path.path), offered_along(draft.tree, path.path)

        # 4. Emit, cut at EOS, stop strings and max_new_tokens.
        emitted = self._emit([*kept, verdict.next_token])

        # 5. Roll both caches back to the accepted prefix (a tree: its path's entries moved into place); the bonus
        # token is fed next round. The round policy learns what the target kept.
        if draft.tree is None:
            self.target.truncate(length + verdict.num_accepted)
        else:
            self.target.keep_path(length - 1, draft.tree.kept_rows(path.path))
        if states is not None:  # the kept rows' states: the root's and the accepted tokens'
            rows = range(verdict.num_accepted + 1) if draft.tree is None else draft.tree.kept_rows(path.path)
            self.drafter.observe(states[list(rows)])
        self.drafter.rollback(self.context)
        self.policy.observe(offered, verdict.num_accepted)
        self.stats.observe(
            RoundRecord(
                drafter=self.drafter.name,
                k=k,
                num_drafted=offered,
                num_accepted=verdict.num_accepted,
                num_emitted=len(emitted),
                draft_seconds=draft_seconds,
                verify_seconds=verify_seconds + time.perf_counter() - started,
                batch_size=batch_size,
            )
        )
        return emitted

    def _emit(self, new_tokens: list[int]) -> list[int]:
        """Add ``new_tokens`` to the output, cut at EOS, stop strings and max_new_tokens; set ``finish_reason`` when
        the request is done (or the context full). Returns what was emitted."""
        cut = cut_round(self.generated, new_tokens, self.rules, self._decode)
        emitted = new_tokens[: cut.keep]
        self.generated.extend(emitted)
        self.context = torch.cat([self.context, torch.tensor(emitted, dtype=torch.long)])
        self.finish_reason = cut.finish_reason
        max_context = self.target.lm.max_context
        if self.finish_reason is None and max_context is not None and self.context.shape[0] >= max_context:
            self.finish_reason = "length"  # the context is full
        return emitted

    def _accept(
        self,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        target_argmax: torch.Tensor | None = None,
    ) -> Verdict:
        # draft_tokens: [k] CPU, draft_probs: [k, vocab] | None, logits: [k + 1, vocab], target_argmax: [k + 1] CPU
        if self.params.is_greedy:
            return greedy_accept(draft_tokens, logits.argmax(dim=-1).cpu() if target_argmax is None else target_argmax)
        target_probs = logits_to_probs(logits, self.params)  # [k + 1, vocab]
        return rejection_sample(draft_tokens.to(logits.device), draft_probs, target_probs, self.generator)

    def _accept_tree(self, tree: DraftTree, logits: torch.Tensor, target_argmax: torch.Tensor | None) -> TreeVerdict:
        # logits: [n + 1, vocab], target_argmax: [n + 1] CPU; the tree's children chosen one-hot
        if self.params.is_greedy:
            return greedy_path(tree, logits.argmax(dim=-1).cpu() if target_argmax is None else target_argmax)
        return sample_path(tree, None, logits_to_probs(logits, self.params), self.generator)

    def _decode(self, token_ids: Any) -> str:
        return str(self.target.lm.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, "result() before the request finished"
        text = trim_stop_string(self._decode(self.generated), self.rules.stop_strings)
        return GenerationResult(list(self.generated), text, self.finish_reason, self.stats)


class SpeculativeDecoder:
    """A loaded target, optionally a draft model, and the drafters they make possible. ``suffix_cache`` holds the
    outputs suffix decoding proposes from (one per worker: whoever serves requests fills it); by default an empty
    one, so suffix decoding reads the request's own text until something is added. A plan runs under its own batch
    threshold (none: no batch rule; a worker resolves it first, ``specd_api.plan.runnable``).

    One sequence at a time (``session``, ``decode``) decodes in KV pools kept from one request to the next
    (``SparePools``): a request pays for no pool of its own (on a GPU, the graphs pass would capture its CUDA graphs
    per pool). ``decode`` gives its slots back; a ``session`` run by hand keeps its own."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        prompt_lookup: PromptLookupConfig | None = None,
        suffix_cache: SuffixCache | None = None,
        head: LoadedHead | None = None,
    ) -> None:
        if draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.head = head
        self.prompt_lookup = prompt_lookup or PromptLookupConfig()
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()
        self.spare_target = SparePools(target)  # one-sequence decoding's slots (no pool is made before one is asked)
        if head is not None:
            self._check_features(head)
        self.spare_draft = SparePools(draft) if draft is not None else None

    def _check_features(self, head: LoadedHead) -> None:
        """Refuse a head whose target runs on a pass that hands no hidden states (the graphs pass)."""
        seq = self.spare_target.open()
        forward_pass = seq.pool.forward_pass
        self.spare_target.release(seq)
        if not forward_pass.features:
            raise ModelLoadError(
                f"head {head.name!r}: the target's {forward_pass.name} pass hands no hidden states for it to draft "
                "from; run the target with runner lean, invariant or transformers"
            )

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters this worker offers (``specd_api.plan.offers`` reads it): those that run the draft model
        (draft, chain) only with one, those that run a head (eagle) only with one."""
        return tuple(
            name
            for name in DRAFTER_NAMES
            if (self.draft is not None or not runs_draft_model(name)) and (self.head is not None or not runs_head(name))
        )

    def encode(self, text: str, cap: int | None = None) -> list[int]:
        """``text``'s token ids, special tokens added; with ``cap``, raises ``PromptTooLong`` for a text of more
        than ``cap`` tokens, and the tokenizer's work stops there where ``decoder.capped_encoding`` reproduces it."""
        if cap is not None and self._capped is not None:
            capped = self._capped.encode(text, cap)
            if isinstance(capped, TooLong):
                raise PromptTooLong(capped.at_least, cap)
            return capped
        ids = list(self.target.tokenizer(text, add_special_tokens=True)["input_ids"])
        if cap is not None and len(ids) > cap:
            raise PromptTooLong(len(ids), cap)
        return ids

    @functools.cached_property
    def _capped(self) -> CappedEncoder | None:
        return CappedEncoder.of(self.target.tokenizer)

    def session(
        self, prompt_ids: list[int], params: SamplingParams, rules: StopConditions, plan: Plan
    ) -> DecodeSession:
        """A sequence decoded as ``plan`` says (its drafter, K ceiling, stop rule and per-round rule), in slots of
        the spare pools."""
        generator = make_generator(params.seed, self.target.device)
        target_seq = self.spare_target.open()
        draft_seq = self.spare_draft.open() if self.spare_draft is not None and runs_draft_model(plan.drafter) else None
        try:
            policy = self._open_policy(plan, params, generator, draft_seq, target_seq.verifies_trees)
            return DecodeSession(self.target, policy, prompt_ids, params, rules, generator, target_seq)
        except BaseException:
            self.spare_target.release(target_seq)
            if draft_seq is not None and self.spare_draft is not None:
                self.spare_draft.release(draft_seq)
            raise

    def decode(
        self, prompt_ids: list[int], params: SamplingParams, rules: StopConditions, plan: Plan
    ) -> GenerationResult:
        """Decode one request as ``plan`` says (use ``session`` to run it round by round); its slots go back to the
        spare pools, finished or not."""
        session = self.session(prompt_ids, params, rules, plan)
        try:
            session.prefill()
            while session.finish_reason is None:
                session.step()
            return session.result()
        finally:
            self._give_back(session)

    def _give_back(self, session: DecodeSession) -> None:
        """``session``'s slots back to the spare pools (it came from ``session``)."""
        self.spare_target.release(session.target)
        model = draft_model_of(session.drafter)
        if model is not None and self.spare_draft is not None:
            self.spare_draft.release(model.seq)

    def generate(
        self, prompt_ids: list[int], drafter: str, k: int, params: SamplingParams, rules: StopConditions
    ) -> GenerationResult:
        """Decode one request with ``drafter`` at ceiling ``k`` every round (a caller's own plan: ``decode`` runs
        any plan)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return self.decode(prompt_ids, params, rules, requested(drafter, k))

    def counterfactual_ks(self, plan: Plan | None, ran: str) -> dict[str, int]:
        """The drafters to replay over a request's output (``score``), each at its ceiling: those ``plan`` asks scored
        that this engine offers, but ``ran``, the one that served it (its own rounds are the data)."""
        if plan is None:
            return {}
        ks = plan.counterfactual_ks
        return {d: k for d, k in ks if k > 0 and d != ran and d in SCORABLE and offers(self.drafters, d)}

    def score(
        self,
        ks: Mapping[str, int],
        prompt_ids: Sequence[int],
        generated: Sequence[int],
        rules: StopConditions,
        segment: str,
    ) -> list[Scored]:
        """Each drafter of ``ks`` (one-hot: prompt lookup, suffix decoding) replayed over ``generated`` at its
        ceiling, made as serving makes it (``make_drafter``: suffix decoding reads ``segment``'s outputs in the suffix
        cache as it stands, so score a request before its output joins the cache)."""
        scored: list[Scored] = []
        for name, k in ks.items():
            assert name in SCORABLE, f"{name!r} is not a one-hot drafter: a replay cannot score it"
            plan = Plan(name, k, segment=segment)
            drafter = make_drafter(plan, None, self.prompt_lookup, SamplingParams(), None, None, self.suffix_cache)
            scored += replay(drafter, prompt_ids, generated, k, rules, self.target.max_context)
        return scored

    def _open_policy(
        self,
        plan: Plan,
        params: SamplingParams,
        generator: torch.Generator | None,
        draft_sequence: ModelSequence | None = None,
        trees: bool = False,
    ) -> RoundPolicy[Drafter]:
        """The round policy of a sequence opening with ``plan``, holding its drafter (the draft model's cache in
        ``draft_sequence`` if given; ``trees``: the target's pass verifies draft trees). Raises ValueError for a
        drafter this engine does not offer."""
        if not offers(self.drafters, plan.drafter):
            if runs_head(plan.drafter):
                raise ValueError(f"drafter {plan.drafter!r} needs a draft head (--head PATH)")
            if plan.drafter in DRAFTER_NAMES:
                raise ValueError(f"drafter {plan.drafter!r} needs a draft model (--draft PATH)")
            raise ValueError(f"unknown drafter {plan.drafter[:40]!r}; choose one of {', '.join(DRAFTER_NAMES)}")
        drafter = make_drafter(plan, self.draft, self.prompt_lookup, params, generator, draft_sequence,
                               self.suffix_cache, trees, self.head)  # fmt: skip
        return RoundPolicy.open(plan, drafter)


def make_drafter(
    plan: Plan,
    draft: LoadedModel | None,
    prompt_lookup: PromptLookupConfig,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_sequence: ModelSequence | None = None,
    suffix_cache: SuffixCache | None = None,
    trees: bool = False,
    head: LoadedHead | None = None,
) -> Drafter:
    """The drafter ``plan`` names, for one sequence (the draft model's cache in ``draft_sequence`` if given): the
    draft model stops at the plan's threshold, suffix decoding reads ``suffix_cache`` for the plan's segment, prompt
    lookup proposes trees of ``prompt_lookup.branches`` matches where ``trees`` (the target's pass verifies them), a
    head drafts from the target's states (``head``).
    The caller has checked that it is offered (``SpeculativeDecoder.drafters``)."""
    name = plan.drafter
    if runs_draft_model(name):
        assert draft is not None, f"drafter {name!r} without a draft model"
        model = DraftModelDrafter(draft, params, generator, draft_sequence, stop_threshold=plan.stop_threshold)
        return ChainDrafter(PromptLookupDrafter(prompt_lookup), model) if name == "chain" else model
    if name == "prompt_lookup":
        return PromptLookupDrafter(prompt_lookup, trees)
    if runs_head(name):
        assert head is not None, f"drafter {name!r} without a draft head"
        return EagleDrafter(head, params, generator)
    if name == "suffix":
        config = suffix_cache.config if suffix_cache is not None else SuffixConfig()
        return SuffixDrafter(config, suffix_cache, plan.segment)
    assert name == "none", f"unknown drafter {name[:40]!r}"
    return NoDrafter()
