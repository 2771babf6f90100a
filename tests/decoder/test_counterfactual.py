"""Prompt lookup and suffix decoding replayed over a request's output (decoder.counterfactual) is what serving them
would have done.

Greedy, the emitted tokens are the target's whatever drafted them, so replaying a one-hot drafter at ceiling K over
them must give exactly the per-position counts of a request actually served with it at K: the same rounds, starting
at the same positions, proposing, verifying and accepting the same tokens. For suffix decoding that holds with the
segment's cache of earlier outputs as the served request read it, which the replay must read too (and never the
request's own output).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from decoder.counterfactual import replay
from decoder.drafters import PromptLookupConfig, PromptLookupDrafter, SuffixCache, SuffixConfig
from decoder.engine import SpeculativeDecoder
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import Plan, requested
from specd_api.rounds import Scored
from tests.conftest import tiny_lm
from tests.decoder.test_suffix import filled_cache, prompts_with_structure

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
    rules = StopConditions(max_new_tokens=40, eos_token_ids=decoder.target.eos_token_ids)
    config = PromptLookupConfig()
    accepted_somewhere = False
    for prompt in prompts(tokenizer, 8):
        served = decoder.generate(prompt, "prompt_lookup", k, GREEDY, rules)
        plain = decoder.generate(prompt, "none", 0, GREEDY, rules)  # another drafter's output: the same tokens
        assert plain.token_ids == served.token_ids
        replayed = replay(PromptLookupDrafter(config), prompt, plain.token_ids, k, rules, decoder.target.max_context)
        assert [as_tuple(t) for t in replayed] == served_tallies(served.stats.rounds), prompt
        accepted_somewhere |= served.stats.num_accepted > 0
    assert accepted_somewhere, "no lookup was ever accepted: the test would not see an off-by-one"


def test_the_replay_stops_where_the_request_ended():
    # The first token (2) is the prefill's: the first round starts after it, with the context ending in 1 2, which
    # lookup continues with 3 1 2. The request ended (EOS) after the 3: the later positions are proposed but never
    # verified. 9 tokens allowed, one emitted: K <= 7.
    tallies = replay(PromptLookupDrafter(), [9, 1, 2, 3, 1], [2, 3], 8, StopConditions(9), None)
    zeros = [0] * 4
    assert [as_tuple(t) for t in tallies] == [(7, 1, [1, 1, 1, *zeros], [1, 0, 0, *zeros], [1, 0, 0, *zeros])]
    # the budget cuts the ceiling as it cuts a served round's: 4 tokens allowed, one emitted, so K <= 2
    tallies = replay(PromptLookupDrafter(), [9, 1, 2, 3, 1], [2, 3, 1], 8, StopConditions(4), None)
    assert [as_tuple(t) for t in tallies] == [(2, 1, [1, 1], [1, 1], [1, 1])]
    assert replay(PromptLookupDrafter(), [1, 2], [], 4, StopConditions(8), None) == []
    assert replay(PromptLookupDrafter(), [1, 2], [5], 4, StopConditions(8), None) == [], "the prefill's alone"
    assert replay(PromptLookupDrafter(), [1, 2], [5, 6], 0, StopConditions(8), None) == []


# -- suffix decoding --------------------------------------------------------------------------------------------


def suffix_plan(k: int, segment: str) -> Plan:
    return replace(requested("suffix", k), segment=segment)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_suffix_replay_counts_what_serving_suffix_decoding_counted(decoder, tokenizer, k):
    """The segment's cache holds earlier outputs (and corrupted copies: proposals from it are accepted in part); each
    request is served with suffix decoding, and decoded plainly; the engine's scoring of the plain output (what the
    worker reports) must count the served rounds, with the cache it read and without it differently."""
    rules = StopConditions(max_new_tokens=30)  # no EOS: long outputs, where the cache and the own text give matches
    earlier = prompts_with_structure(len(tokenizer), seed=1, count=6)
    cache = filled_cache(decoder, earlier, rules, "seg-a")
    served_by = SpeculativeDecoder(decoder.target, suffix_cache=cache)
    alone = SpeculativeDecoder(decoder.target, suffix_cache=SuffixCache(cache.config))  # the same, empty
    from_cache = accepted = 0
    for prompt in [*prompts_with_structure(len(tokenizer), seed=7 + k, count=4), earlier[k % 6]]:
        served = served_by.decode(prompt, GREEDY, rules, suffix_plan(k, "seg-a"))
        plain = decoder.generate(prompt, "none", 0, GREEDY, rules)
        assert plain.token_ids == served.token_ids
        replayed = served_by.score({"suffix": k}, prompt, plain.token_ids, rules, "seg-a")
        assert all(t.drafter == "suffix" for t in replayed)
        assert [as_tuple(t) for t in replayed] == served_tallies(served.stats.rounds), prompt
        without = alone.score({"suffix": k}, prompt, plain.token_ids, rules, "seg-a")
        from_cache += [as_tuple(t) for t in without] != [as_tuple(t) for t in replayed]
        accepted += served.stats.num_accepted
    assert accepted > 0 and from_cache > 0, "the cache never changed a proposal: the test would not see it ignored"


def test_the_suffix_replay_reads_its_own_segment_and_not_the_output_it_scores(decoder, tokenizer):
    rules = StopConditions(max_new_tokens=30)
    prompt = prompts_with_structure(len(tokenizer), seed=3, count=1)[0]
    output = decoder.generate(prompt, "none", 0, GREEDY, rules).token_ids
    cache = SuffixCache(SuffixConfig(depth=8))
    cache.add("other", output)  # another segment's copy of this very output
    engine = SpeculativeDecoder(decoder.target, suffix_cache=cache)
    mine = engine.score({"suffix": 8}, prompt, output, rules, "seg-a")
    served = engine.decode(prompt, GREEDY, rules, suffix_plan(8, "seg-a"))
    assert [as_tuple(t) for t in mine] == served_tallies(served.stats.rounds)
    # Had the output been in the segment's cache when scored, nearly every token would have been proposed from it:
    # what the worker must never do (it scores first, then shares the output).
    cache.add("seg-a", output)
    cheat = engine.score({"suffix": 8}, prompt, output, rules, "seg-a")
    assert sum(t.tally.num_accepted for t in cheat) > sum(t.tally.num_accepted for t in mine) + 5


def test_the_engine_scores_what_the_plan_asks_but_the_drafter_that_ran(decoder):
    plan = Plan("draft", 4, counterfactual_ks=(("draft", 3), ("prompt_lookup", 10), ("suffix", 16)))
    assert decoder.counterfactual_ks(plan, "draft") == {"prompt_lookup": 10, "suffix": 16}  # draft is not one-hot
    assert decoder.counterfactual_ks(plan, "suffix") == {"prompt_lookup": 10}  # its own rounds are the data
    assert decoder.counterfactual_ks(Plan(counterfactual_ks=(("suffix", 0),)), "none") == {}
    assert decoder.counterfactual_ks(None, "none") == {}
