"""The chain drafter: prompt lookup first, the draft model when lookup finds no match.

Exactness alone cannot see a chain that picks the wrong source, or a draft model whose cache fell behind the rounds
lookup served (the target corrects any proposal). So besides greedy output equal to the target's, every round's
proposal is checked against what lookup, or a draft model fed the whole context from scratch, proposes on that
round's context, in the single-sequence engine and under batching.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.drafters import ChainDrafter, Draft, DraftModelDrafter, PromptLookupConfig, PromptLookupDrafter
from decoder.engine import DecodeSession, SpeculativeDecoder, make_drafter
from decoder.models import LoadedModel
from decoder.request_stop import StopConditions
from decoder.runners import PooledSequence
from decoder.sampling import SamplingParams, make_generator
from specd_api.plan import Plan, requested
from tests.conftest import perturbed_copy, tiny_lm

GREEDY = SamplingParams()
RoundLog = list[tuple[torch.Tensor, int, Draft]]  # (context, K, proposal) per round


def chain_prompts(vocab: int, seed: int, count: int) -> list[list[int]]:
    """Random prompts, every other one repeating itself: some rounds find a lookup match, some do not."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        body = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 16))]
        prompts.append(body * 2 if i % 2 else body)
    return prompts


def fresh_proposal(draft: LoadedModel, context: torch.Tensor, k: int) -> tuple[str, list[int]]:
    """What a chain must propose on ``context``: lookup's tokens when it finds any, else what a draft model that
    has seen nothing before proposes (greedy)."""
    found = PromptLookupDrafter().propose(context, k)
    if found.num_tokens:
        return "lookup", found.tokens.tolist()
    model = DraftModelDrafter(draft, GREEDY, None)
    model.prefill(context)
    return "draft", model.propose(context, k).tokens.tolist()


def record_proposals(chain: ChainDrafter, log: RoundLog) -> None:
    """Log every proposal ``chain`` makes (the single-sequence engine calls ``propose`` each round)."""
    propose = chain.propose

    def logged(context: torch.Tensor, k: int) -> Draft:
        draft = propose(context, k)
        log.append((context.clone(), k, draft))
        return draft

    chain.propose = logged  # type: ignore[method-assign]


def assert_rounds_propose_what_a_fresh_chain_would(draft: LoadedModel, log: RoundLog) -> None:
    """Each logged round proposed what lookup or a fresh draft model proposes on its context; both sources served,
    and the draft model served a round right after lookup served one (so it had tokens to catch up on)."""
    sources = []
    for context, k, proposed in log:
        source, want = fresh_proposal(draft, context, k)
        assert proposed.tokens.tolist() == want, f"{source} round, K={k}, context={context.tolist()}"
        sources.append(source)
    assert {"lookup", "draft"} <= set(sources), f"one source served every round ({set(sources)}): nothing chained"
    assert any(a == "lookup" and b == "draft" for a, b in itertools.pairwise(sources)), (
        "the draft model never drafted after a lookup round: its catch-up was not exercised"
    )


# -- the choice, one round -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_target(tokenizer) -> LoadedModel:
    return tiny_lm("llama", tokenizer, seed=0)


@pytest.fixture(scope="module")
def llama_draft(llama_target) -> LoadedModel:
    return perturbed_copy(llama_target, scale=0.1, seed=3)  # accepts some drafts, rejects others


SAMPLED = SamplingParams(temperature=1.0)


def sampling_chain(draft: LoadedModel, seed: int) -> ChainDrafter:
    model = DraftModelDrafter(draft, SAMPLED, make_generator(seed, draft.device))
    return ChainDrafter(PromptLookupDrafter(), model)


def test_a_round_with_a_lookup_match_proposes_lookups_tokens(llama_draft):
    context = torch.tensor([5, 6, 7, 8, 9, 5, 6])  # "5 6" was followed by 7 8 9 5 6
    chain = sampling_chain(llama_draft, seed=0)
    chain.prefill(context)
    held = chain.model.seq.length
    assert not chain.drafts_with_model(context, 3)
    draft = chain.propose(context, 3)
    assert draft.tokens.tolist() == [7, 8, 9]
    assert draft.probs is None, "lookup's proposal is one-hot"
    assert chain.model.seq.length == held, "a lookup round must not run the draft model"


def test_a_round_without_a_lookup_match_proposes_the_draft_models_tokens(llama_draft):
    context = torch.tensor([5, 6, 7, 8, 9])  # no token repeats: lookup finds nothing
    assert PromptLookupDrafter().propose(context, 3).num_tokens == 0
    chain = sampling_chain(llama_draft, seed=1)
    chain.prefill(context)
    assert chain.drafts_with_model(context, 3)
    draft = chain.propose(context, 3)
    alone = sampling_chain(llama_draft, seed=1).model  # the same draft model and seed, without lookup in front
    alone.prefill(context)
    want = alone.propose(context, 3)
    assert draft.tokens.tolist() == want.tokens.tolist() and draft.num_tokens == 3
    assert draft.probs is not None and want.probs is not None, "the draft model's proposal carries its q"
    torch.testing.assert_close(draft.probs, want.probs, rtol=0, atol=0)
    assert not chain.drafts_with_model(context, 0), "K = 0 drafts nothing"


def test_the_chains_draft_model_honours_the_plans_stop_threshold(llama_target, llama_draft):
    plan = Plan("chain", 4, stop_threshold=0.6)
    chain = make_drafter(plan, llama_draft, PromptLookupConfig(), GREEDY, None)
    assert isinstance(chain, ChainDrafter) and chain.model.stop_threshold == 0.6
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(llama_target).session([5, 6], GREEDY, StopConditions(4), plan)
    assert "chain" not in SpeculativeDecoder(llama_target).drafters, "no draft model: no chain"
    assert "chain" in SpeculativeDecoder(llama_target, llama_draft).drafters


# -- whole requests, one sequence --------------------------------------------------------------------------------


def test_chain_greedy_equals_target_only_and_proposes_what_a_fresh_chain_would(arch, tokenizer, target):
    draft = perturbed_copy(target, scale=0.1, seed=3)
    decoder = SpeculativeDecoder(target, draft)
    rules = StopConditions(max_new_tokens=20)  # no EOS: long outputs, where repetition gives lookup matches
    log: RoundLog = []
    proposed = accepted = 0
    for k in (1, 3, 5, 8):
        for prompt in chain_prompts(len(tokenizer), seed=k, count=4):
            expected = decoder.generate(prompt, "none", 0, GREEDY, rules)
            session = decoder.session(prompt, GREEDY, rules, requested("chain", k))
            assert isinstance(session.drafter, ChainDrafter)
            record_proposals(session.drafter, log)
            session.prefill()
            while session.finish_reason is None:
                session.step()
            assert session.result().token_ids == expected.token_ids, f"K={k} prompt={prompt}"
            assert session.stats.rounds[0].drafter == "chain"
            proposed += session.stats.num_drafted
            accepted += session.stats.num_accepted
    assert 0 < accepted < proposed, "drafts must be partly rejected, or rollback is not exercised"
    assert_rounds_propose_what_a_fresh_chain_would(draft, log)


# -- under batching ------------------------------------------------------------------------------------------------


def draft_slot(session: DecodeSession) -> int:
    """The draft pool slot of ``session``'s draft model."""
    model = session.drafter.draft_model
    assert model is not None and isinstance(model.seq, PooledSequence)
    return model.seq.slot


def test_batched_chain_rounds_join_the_draft_pass_and_equal_single_sequence_rounds(llama_target, llama_draft):
    """Chain sequences decoded beside draft, prompt lookup and plain ones: each emits the target's greedy output in
    the very rounds the single-sequence engine runs, and a chain's draft-model rounds share the batched draft pass
    with the draft drafter's."""
    rules = StopConditions(max_new_tokens=16)
    vocab = llama_target.vocab_size
    prompts = chain_prompts(vocab, seed=40, count=8)
    drafters = ["chain", "draft", "chain", "prompt_lookup", "chain", "none", "chain", "draft"]
    ks = [4, 3, 6, 4, 2, 0, 5, 4]
    single = SpeculativeDecoder(llama_target, llama_draft)
    want_tokens = [single.generate(p, "none", 0, GREEDY, rules).token_ids for p in prompts]
    want_rounds = [
        [(r.k, r.num_drafted, r.num_accepted) for r in single.generate(p, d, k, GREEDY, rules).stats.rounds]
        for p, d, k in zip(prompts, drafters, ks, strict=True)
    ]

    engine = BatchEngine(llama_target, llama_draft, max_batch=len(prompts))
    pool = engine.draft_pool
    assert pool is not None
    passes: list[set[int]] = []  # the draft slots of each draft-model pass
    forward_many = pool.forward_many

    def spied(rows, logits_to_keep=0, trees=None, tap=None):
        passes.append({seq.slot for seq, _ in rows})
        return forward_many(rows, logits_to_keep, trees, tap)

    pool.forward_many = spied  # type: ignore[method-assign]
    sessions = [engine.open(p, GREEDY, rules, requested(d, k)) for p, d, k in zip(prompts, drafters, ks, strict=True)]
    chain_slots = {draft_slot(s) for s in sessions if isinstance(s.drafter, ChainDrafter)}
    draft_slots = {draft_slot(s) for s in sessions if isinstance(s.drafter, DraftModelDrafter)}
    passes.clear()  # the prefills
    live = list(range(len(sessions)))
    while live:
        engine.step([sessions[i] for i in live])
        live = [i for i in live if sessions[i].finish_reason is None]
    for i, session in enumerate(sessions):
        assert session.result().token_ids == want_tokens[i], f"request {i} ({drafters[i]}) differs under batching"
        got_rounds = [(r.k, r.num_drafted, r.num_accepted) for r in session.stats.rounds]
        assert got_rounds == want_rounds[i], f"request {i} ({drafters[i]}): its rounds differ under batching"
    assert any(p & chain_slots and p & draft_slots for p in passes), "chain rounds never joined the draft pass"
    for session in sessions:
        engine.close(session)
    assert engine.free_slots == pool.free_slots == len(prompts), "closing a chain gives both its slots back"


def test_a_batched_chain_proposes_what_a_fresh_chain_would(llama_target, llama_draft, monkeypatch):
    """The batch engine drafts a chain's model rounds itself (``propose_together``), not through ``propose``: its
    proposals are read where the target takes them."""
    rules = StopConditions(max_new_tokens=20)
    engine = BatchEngine(llama_target, llama_draft, max_batch=4)
    prompts = chain_prompts(llama_target.vocab_size, seed=50, count=4)
    sessions = [engine.open(p, GREEDY, rules, requested("chain", 5)) for p in prompts]
    log: RoundLog = []
    round_ks: dict[int, int] = {}
    verify_input = DecodeSession.verify_input

    def logged(self: DecodeSession, draft: Draft) -> torch.Tensor:  # the last context token, then the proposal
        log.append((self.context.clone(), round_ks[id(self)], draft))
        return verify_input(self, draft)

    monkeypatch.setattr(DecodeSession, "verify_input", logged)
    live = sessions
    while live:
        round_ks.update({id(s): s.policy.round_k(len(live), s.draft_budget()) for s in live})  # 5, cut to the budget
        engine.step(live)
        live = [s for s in live if s.finish_reason is None]
    assert_rounds_propose_what_a_fresh_chain_would(llama_draft, log)
    for session in sessions:
        engine.close(session)
