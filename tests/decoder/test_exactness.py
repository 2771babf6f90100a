"""Contract 1: greedy speculative output equals greedy target-only output, token for token."""

from __future__ import annotations

import random

import pytest

from decoder.engine import SpeculativeDecoder
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import Plan, requested
from tests.conftest import perturbed_copy, tiny_lm

GREEDY = SamplingParams()


def random_prompts(tokenizer, seed: int, count: int) -> list[list[int]]:
    """Random token prompts, some built to repeat themselves so prompt lookup finds matches."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompts = []
    for i in range(count):
        body = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 24))]
        prompts.append(body * 3 if i % 2 else body)
    return prompts


@pytest.fixture(scope="module")
def drafts(arch, tokenizer, target):
    return {
        "disagrees": tiny_lm(arch, tokenizer, seed=7, hidden=32, layers=1),
        "agrees": target,
        "sometimes": perturbed_copy(target, scale=0.1, seed=3),
    }


@pytest.mark.parametrize("draft_kind", ["disagrees", "agrees", "sometimes"])
def test_draft_model_greedy_equals_target_only(target, drafts, draft_kind, tokenizer):
    decoder = SpeculativeDecoder(target, drafts[draft_kind])
    rules = StopConditions(max_new_tokens=20, eos_token_ids=target.eos_token_ids)
    proposed = accepted = 0
    for k in range(1, 9):
        for prompt in random_prompts(tokenizer, seed=k, count=3):
            expected = decoder.generate(prompt, "none", 0, GREEDY, rules)
            got = decoder.generate(prompt, "draft", k, GREEDY, rules)
            assert got.token_ids == expected.token_ids, f"K={k} prompt={prompt}"
            assert got.finish_reason == expected.finish_reason
            proposed += got.stats.num_drafted
            accepted += got.stats.num_accepted
    alpha = accepted / proposed
    # The three drafts must really exercise three regimes, or the test proves less than it says.
    bounds = {"disagrees": (0.0, 0.5), "agrees": (1.0, 1.0), "sometimes": (0.3, 0.8)}[draft_kind]
    assert bounds[0] <= alpha <= bounds[1], f"α={alpha:.2f} outside {bounds} for a draft that {draft_kind}"


def test_prompt_lookup_greedy_equals_target_only(arch, target, tokenizer):
    decoder = SpeculativeDecoder(target)
    rules = StopConditions(max_new_tokens=24)  # no EOS: long outputs, where repetition gives lookup matches
    proposed = accepted = 0
    for k in range(1, 9):
        for prompt in random_prompts(tokenizer, seed=100 + k, count=3):
            expected = decoder.generate(prompt, "none", 0, GREEDY, rules)
            got = decoder.generate(prompt, "prompt_lookup", k, GREEDY, rules)
            assert got.token_ids == expected.token_ids, f"K={k} prompt={prompt}"
            proposed += got.stats.num_drafted
            accepted += got.stats.num_accepted
    assert proposed > 0 and accepted < proposed, "lookup never matched, or never missed"
    if arch.startswith("llama"):  # the tiny random GPT-2 never repeats itself, so only the Llama accepts lookups
        assert accepted > 0, "no lookup was ever accepted: the acceptance path was not exercised"


def test_k_can_change_every_round(target, tokenizer):
    decoder = SpeculativeDecoder(target, perturbed_copy(target, scale=0.1, seed=5))
    rules = StopConditions(max_new_tokens=30)
    prompt = random_prompts(tokenizer, seed=9, count=1)[0]
    expected = decoder.generate(prompt, "none", 0, GREEDY, rules).token_ids
    session = decoder.session(prompt, GREEDY, rules, requested("draft", 8, k_schedule=(3, 0, 8, 1, 5, 2, 7, 4)))
    session.prefill()
    while session.finish_reason is None:
        session.step()
    assert session.result().token_ids == expected
    assert {r.k for r in session.stats.rounds} > {0, 1}


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7])
def test_plans_that_change_k_every_round_and_stop_early_stay_exact(target, tokenizer, threshold):
    # A plan adapts K round by round (specd_api.round_policy) and the draft stops at its confidence threshold;
    # whatever K each round ends up with, the greedy output is the target's own.
    decoder = SpeculativeDecoder(target, perturbed_copy(target, scale=0.1, seed=5))
    rules = StopConditions(max_new_tokens=30)
    rng = random.Random(int(threshold * 10))
    ks, drafted_less = set(), False
    for prompt in random_prompts(tokenizer, seed=21, count=6):
        verify = tuple(1.0 + rng.random() for _ in range(9))  # a random, non-monotonic v(n)
        plan = Plan("draft", 8, acceptance=tuple(rng.uniform(0.3, 0.95) for _ in range(8)), proposal=(1.0,) * 8,
                    prior_strength=rng.choice([0.0, 2.0, 8.0]), cost_ratio=rng.uniform(0.0, 0.3),
                    verify_cost=(1.0, *verify[1:]), stop_threshold=threshold)  # fmt: skip
        expected = decoder.generate(prompt, "none", 0, GREEDY, rules)
        got = decoder.decode(prompt, GREEDY, rules, plan)
        assert got.token_ids == expected.token_ids, (prompt, plan)
        ks |= {r.k for r in got.stats.rounds}
        drafted_less |= any(r.num_drafted < r.k for r in got.stats.rounds)
    assert len(ks) >= 3, f"K hardly changed ({ks}): the test would not see a bug in the per-round path"
    if threshold >= 0.7:
        assert drafted_less, "the stop rule never cut a draft short"
