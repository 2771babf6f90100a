"""The first token never waits for a drafter (decoder/engine.py): the target's prefill gives it, it is emitted when a
sequence opens, and the drafter prefills only before the first round that drafts, timed apart from drafting."""

from __future__ import annotations

import pytest

from decoder.batch_engine import BatchEngine
from decoder.drafters import draft_model_of
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from tests.conftest import perturbed_copy, tiny_lm

GREEDY = SamplingParams()
PROMPT = [5, 9, 14, 5, 9, 14, 5, 9]  # repeats: prompt lookup and suffix decoding find matches
DRAFTERS = ("none", "draft", "prompt_lookup", "chain", "suffix")


@pytest.fixture(scope="module")
def engine(tokenizer) -> BatchEngine:
    target = tiny_lm("llama", tokenizer, seed=0)
    return BatchEngine(target, perturbed_copy(target, scale=0.1, seed=3), max_batch=4)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_sequence_opens_with_its_first_token_and_an_unprefilled_drafter(engine: BatchEngine, drafter: str) -> None:
    rules = StopConditions(max_new_tokens=12)
    plain = engine.open(list(PROMPT), GREEDY, rules, requested("none", 0))
    session = engine.open(list(PROMPT), GREEDY, rules, requested(drafter, 4))
    try:
        assert len(session.generated) == 1 and session.stats.num_rounds == 0, "the prefill emitted the first token"
        assert session.generated == plain.generated, "the prefill's token is target-only's first token"
        assert session.target.length == len(PROMPT), "the target's cache holds the context but its last token"
        assert not session.drafter_ready and session.stats.draft_prefill_seconds == 0.0
        model = draft_model_of(session.drafter)
        assert model is None or model.seq.length == 0, "no draft model pass before the first token"
        engine.step([session])
        assert session.drafter_ready == (drafter != "none"), "the first round that drafts prefilled the drafter"
        assert session.stats.rounds[0].num_drafted <= 4
        while session.finish_reason is None:
            engine.step([session])
        while plain.finish_reason is None:
            engine.step([plain])
        assert session.generated == plain.generated
        assert session.stats.num_new_tokens == len(session.generated)
    finally:
        engine.close(session)
        engine.close(plain)


def test_a_request_that_never_drafts_never_prefills_its_drafter(engine: BatchEngine) -> None:
    # the plan's batch threshold is 1 and two sequences decode together: no round drafts
    rules = StopConditions(max_new_tokens=6)
    sessions = [engine.open(list(PROMPT), GREEDY, rules, requested("draft", 4, max_batch_size=1)) for _ in range(2)]
    try:
        while any(s.finish_reason is None for s in sessions):
            engine.step([s for s in sessions if s.finish_reason is None])
        for s in sessions:
            assert all(r.k == 0 for r in s.stats.rounds)
            assert not s.drafter_ready and s.drafter.draft_model is not None
            assert s.drafter.draft_model.seq.length == 0
    finally:
        for s in sessions:
            engine.close(s)


def test_a_one_token_request_is_done_at_its_prefill(engine: BatchEngine) -> None:
    session = engine.open(list(PROMPT), GREEDY, StopConditions(max_new_tokens=1), requested("draft", 4))
    try:
        assert session.finish_reason == "length" and len(session.result().token_ids) == 1
        assert session.stats.num_rounds == 0 and session.stats.num_new_tokens == 1
    finally:
        engine.close(session)
