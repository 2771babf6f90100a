"""Prompt lookup replayed over a request's output (decoder.counterfactual) is what serving it would have done.

Greedy, the emitted tokens are the target's whatever drafted them, so replaying prompt lookup at ceiling K over
them must give exactly the per-position counts of a request actually served with prompt lookup at K: the same
rounds, starting at the same positions, proposing, verifying and accepting the same tokens.
"""

from __future__ import annotations

import random

import pytest

from decoder.counterfactual import Scored, replay_lookup
from decoder.drafters import PromptLookupConfig
from decoder.engine import SpeculativeDecoder
from decoder.sampling import SamplingParams
from decoder.stopping import StopRules
from tests.conftest import tiny_lm

GREEDY = SamplingParams()


def served_tallies(rounds) -> list[tuple[int, int, list[int], list[int], list[int]]]:
    """Per ceiling K, the served prompt lookup rounds' (K, rounds, proposed, verified, accepted) per position,
    counted here from the rounds (not with the PositionTally the replay counts with)."""
    by_k: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
    for r in rounds:
        if r.k == 0:
            continue  # a round the budget cut to K = 0 is plain decoding
        count, proposed, verified, accepted = by_k.setdefault(r.k, ([0], [0] * r.k, [0] * r.k, [0] * r.k))
        count[0] += 1
        for i in range(r.num_drafted):
            proposed[i] += 1
            verified[i] += i <= r.num_accepted
            accepted[i] += i < r.num_accepted
    return [(k, by_k[k][0][0], *by_k[k][1:]) for k in sorted(by_k)]


def as_tuple(t: Scored) -> tuple[int, int, list[int], list[int], list[int]]:
    return t.k, t.tally.rounds, t.tally.proposed, t.tally.verified, t.tally.accepted


def prompts(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(11)
    vocab = len(tokenizer)
    out = []
    for i in range(count):
        body = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 12))]
        out.append(body * (2 + i % 3))  # repeats: lookup finds matches, some accepted, some not
    return out


@pytest.fixture(scope="module")
def decoder(tokenizer):
    return SpeculativeDecoder(tiny_lm("llama", tokenizer, seed=0))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_replay_counts_what_serving_prompt_lookup_counted(decoder, tokenizer, k):
    rules = StopRules(max_new_tokens=40, eos_token_ids=decoder.target.eos_token_ids)
    config = PromptLookupConfig()
    accepted_somewhere = False
    for prompt in prompts(tokenizer, 8):
        served = decoder.generate(prompt, "prompt_lookup", k, GREEDY, rules)
        plain = decoder.generate(prompt, "none", 0, GREEDY, rules)  # another drafter's output: the same tokens
        assert plain.token_ids == served.token_ids
        replayed = replay_lookup(prompt, plain.token_ids, config, k, rules, decoder.target.max_context)
        assert [as_tuple(t) for t in replayed] == served_tallies(served.stats.rounds), prompt
        accepted_somewhere |= served.stats.num_accepted > 0
    assert accepted_somewhere, "no lookup was ever accepted: the test would not see an off-by-one"


def test_the_replay_stops_where_the_request_ended():
    # the proposal reaches past the last emitted token: those positions are proposed but never verified
    tallies = replay_lookup([1, 2, 3, 1, 2], [3], PromptLookupConfig(), 8, StopRules(8), None)  # ended by EOS
    zeros = [0] * 4
    assert [as_tuple(t) for t in tallies] == [(7, 1, [1, 1, 1, *zeros], [1, 0, 0, *zeros], [1, 0, 0, *zeros])]
    # the budget cuts the ceiling as it cuts a served round's: 3 tokens allowed, so K <= 2 in the first round
    tallies = replay_lookup([1, 2, 3, 1, 2], [3, 1], PromptLookupConfig(), 8, StopRules(3), None)
    assert [as_tuple(t) for t in tallies] == [(2, 1, [1, 1], [1, 1], [1, 1])]
    assert replay_lookup([1, 2], [], PromptLookupConfig(), 4, StopRules(8), None) == []
    assert replay_lookup([1, 2], [5, 6], PromptLookupConfig(), 0, StopRules(8), None) == []
