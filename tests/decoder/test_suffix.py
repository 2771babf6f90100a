"""Suffix decoding: the trie's longest match and most frequent continuation, the per-segment cache's bounds, and
exactness (greedy output equal to the target's in the single and batch engines, the target's distribution when
sampling)."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.drafters import SuffixCache, SuffixConfig, SuffixDrafter
from decoder.drafters.suffix_cache import NODE_BYTES, TOKEN_BYTES, TRIE_BYTES
from decoder.drafters.suffix_trie import SuffixTrie, TextSuffixTrie
from decoder.engine import SpeculativeDecoder
from decoder.models import LoadedModel
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import Plan
from tests.conftest import tiny_lm
from tests.decoder.distribution import (
    PROMPT,
    REJECT_BELOW,
    chi_square_pvalue,
    exact_distribution,
    small_vocab_lm,
    small_vocab_tokenizer,
)

GREEDY = SamplingParams()

# -- the trie: longest match -------------------------------------------------------------------------------------

MATCH_CASES = [
    # (sequences put in, depth, text, expected match length, why)
    ([[1, 2, 3, 4]], 8, [9, 1, 2], 2, "'1 2' occurred followed by 3; '9 1 2' never occurred"),
    ([[1, 2, 3, 4]], 8, [2, 3, 4], 0, "'2 3 4', '3 4' and '4' occurred only at the end: nothing followed them"),
    ([[1, 2, 3, 4]], 8, [5, 2, 3], 2, "the longest suffix that continues is '2 3' (then 4)"),
    ([[1, 2, 3, 4, 5]], 4, [1, 2, 3, 4], 3, "depth 4: a match of 3 leaves room for the token after it"),
    ([[1, 2], [3, 1, 2, 7]], 8, [3, 1, 2], 3, "the second sequence has '3 1 2' followed by 7"),
    ([[6, 6, 6]], 8, [6, 6], 2, "'6 6' at 0 was followed by 6"),
    ([[1, 2, 3]], 8, [], 0, "an empty text matches nothing"),
]


@pytest.mark.parametrize(("sequences", "depth", "text", "length", "why"), MATCH_CASES)
def test_the_longest_match_is_the_longest_suffix_followed_by_a_token(sequences, depth, text, length, why):
    trie = SuffixTrie(depth)
    for sequence in sequences:
        trie.insert(sequence)
    assert trie.match(text)[1] == length, why


# -- the trie: most frequent continuation -------------------------------------------------------------------------

CONTINUATION_CASES = [
    # (sequences, depth, text, k, min_probability, per_match_token, tokens, probabilities, why)
    (
        [[7, 1, 2], [7, 1, 2], [7, 1, 3]],
        8,
        [7],
        2,
        0.0,
        8.0,
        (1, 2),
        (1.0, 2 / 3),
        "7 was always followed by 1; '7 1' by 2 twice and 3 once",
    ),
    (
        [[7, 1, 2], [7, 1, 2], [7, 1, 3]],
        8,
        [7],
        2,
        0.7,
        8.0,
        (1,),
        (1.0,),
        "2 after '7 1' has frequency 2/3, under 0.7: the proposal stops before it",
    ),
    ([[7, 1], [7, 2]], 8, [7], 1, 0.0, 8.0, (2,), (0.5,), "a tie goes to the continuation seen last"),
    ([[7, 2], [7, 1], [7, 1]], 8, [7], 1, 0.0, 8.0, (1,), (2 / 3,), "1 followed 7 twice, 2 once: counts beat recency"),
    ([[5, 6, 7, 8, 9]], 8, [4, 5], 4, 0.0, 1.0, (6,), (1.0,), "a 1-token match proposes 1 token per matched token"),
    ([[5, 6, 7, 8, 9]], 8, [5, 6], 1, 0.0, 8.0, (7,), (1.0,), "K = 1 caps it"),
    (
        [[1, 2, 3, 4, 5, 6]],
        3,
        [1, 2],
        4,
        0.0,
        8.0,
        (3, 4, 5, 6),
        (1.0,) * 4,
        "depth 3: at the bound the walk re-anchors on the path's last token and goes on",
    ),
    (
        [[1, 2, 3], [1, 2, 4], [1, 2, 5]],
        8,
        [1, 2],
        3,
        0.3,
        8.0,
        (5,),
        (1 / 3,),
        "three continuations seen once: the newest at 1/3, then '1 2 5' ended (nothing followed it)",
    ),
    ([[1, 2, 3]], 8, [9], 3, 0.0, 8.0, (), (), "no match: no proposal"),
]


@pytest.mark.parametrize(
    ("sequences", "depth", "text", "k", "min_probability", "per_match", "tokens", "probabilities", "why"),
    CONTINUATION_CASES,
)
def test_the_proposal_is_the_most_frequent_continuation_of_the_match(
    sequences, depth, text, k, min_probability, per_match, tokens, probabilities, why
):
    trie = SuffixTrie(depth)
    for sequence in sequences:
        trie.insert(sequence)
    found = trie.continuation(text, k, min_probability, per_match)
    assert found.tokens == tokens, why
    assert found.probabilities == pytest.approx(probabilities), why


def occurrences(sequences: list[list[int]], s: list[int]) -> int:
    return sum(1 for q in sequences for i in range(len(q) - len(s) + 1) if q[i : i + len(s)] == s)


def random_sequences(rng: random.Random, count: int, vocab: int = 6, length: int = 40) -> list[list[int]]:
    """Few distinct tokens: substrings repeat, so counts above 1 and branching nodes are common."""
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, length))] for _ in range(count)]


def test_counts_are_occurrence_counts_and_remove_undoes_insert():
    rng = random.Random(0)
    depth = 5
    trie = SuffixTrie(depth)
    kept = random_sequences(rng, 6)
    gone = random_sequences(rng, 6)
    for sequence in [*kept, *gone]:
        trie.insert(sequence)
    nodes_of_kept = SuffixTrie(depth)
    for sequence in kept:
        nodes_of_kept.insert(sequence)
    for sequence in gone:
        trie.remove(sequence)
    assert trie.nodes == nodes_of_kept.nodes, "removing an output must free exactly the nodes only it made"
    for _ in range(500):
        probe = [rng.randrange(6) for _ in range(rng.randint(1, depth))]
        assert trie.count(probe) == occurrences(kept, probe), f"count of {probe}"
    for sequence in kept:
        trie.remove(sequence)
    assert trie.nodes == 0 and trie.count([0]) == 0


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_the_requests_own_trie_grown_token_by_token_answers_as_one_built_whole(depth):
    """The own text's trie leaves strings seen once in the text: its counts and proposals must be those of the eager
    trie with the whole text inserted, at every length of the text (rounds of a few tokens), and for any text."""
    rng = random.Random(depth)
    for trial in range(40):
        vocab = 2 if trial % 4 == 0 else 5  # two tokens: the text overlaps itself ("a a a")
        text = random_sequences(rng, 1, vocab=vocab, length=60)[0]
        grown = TextSuffixTrie(depth)
        done = 0
        while done < len(text):
            step = rng.randint(1, 7)
            grown.extend(text[done : done + step])
            done = min(done + step, len(text))
            whole = SuffixTrie(depth)
            whole.insert(text[:done])
            so_far = text[:done]
            for _ in range(20):
                probe = [rng.randrange(vocab) for _ in range(rng.randint(1, depth))]
                assert grown.count(probe) == whole.count(probe), f"count of {probe} in {so_far}"
            for k, min_probability, per_match in ((8, 0.0, 8.0), (3, 0.4, 1.0), (12, 0.1, 2.0)):
                want = whole.continuation(so_far, k, min_probability, per_match)
                assert grown.continuation(None, k, min_probability, per_match) == want, f"own text {so_far}"
                other = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
                assert grown.continuation(other, k, min_probability, per_match) == whole.continuation(
                    other, k, min_probability, per_match
                ), f"text {other} over {so_far}"
    novel = list(range(100, 160))  # no token repeats: every string is seen once
    grown, whole = TextSuffixTrie(depth), SuffixTrie(depth)
    grown.extend(novel)
    whole.insert(novel)
    assert grown.nodes == len(novel) < whole.nodes, "strings seen once must stay in the text"


# -- the cache -----------------------------------------------------------------------------------------------------


def small_cache(cache_bytes: int = 400_000, share: float = 0.5, depth: int = 8) -> SuffixCache:
    return SuffixCache(SuffixConfig(depth=depth, cache_bytes=cache_bytes, max_segment_share=share))


def accounted(cache: SuffixCache) -> int:
    """The cache's bytes recounted from what it holds."""
    segments = {o.segment for o in cache.outputs()}
    return sum(cache.segment_bytes(s) for s in segments)


def test_the_byte_cap_holds_when_filled_far_past_it_and_the_oldest_outputs_go_first():
    cache = small_cache()
    rng = random.Random(2)
    added = []
    for i in range(300):  # ~60x the cap: random tokens from a large vocabulary make ~depth nodes per token
        output = [10_000 + i, *(rng.randrange(50_000) for _ in range(rng.randint(5, 60)))]  # a unique first token
        cache.add("s", output)
        added.append(output)
        assert cache.bytes <= cache.config.cache_bytes * cache.config.max_segment_share
        assert cache.bytes == accounted(cache), "the running byte count drifted from what the cache holds"
    held = [list(o.tokens) for o in cache.outputs()]
    assert held == added[len(added) - len(held) :], "the cache must hold the newest outputs, in order"
    assert 0 < len(held) < 50
    assert cache.continuation("s", [added[0][0]], 1).tokens == (), "the oldest output was evicted"
    assert cache.continuation("s", [added[-1][0]], 1).tokens == (added[-1][1],), "the newest is read"


def test_a_segment_cannot_take_more_than_its_share():
    cache = small_cache(share=0.4)
    rng = random.Random(3)
    quiet = [[1, 2, 3, 4, 5, 6, 7, 8]] * 3
    for output in quiet:
        cache.add("quiet", output)
    quiet_bytes = cache.segment_bytes("quiet")
    cap = int(cache.config.cache_bytes * 0.4)
    for _ in range(200):
        cache.add("busy", [rng.randrange(50_000) for _ in range(40)])
        assert cache.segment_bytes("busy") <= cap
        assert cache.bytes <= cache.config.cache_bytes
    assert cache.segment_bytes("quiet") == quiet_bytes, "a busy segment evicted a quiet one's outputs"
    assert cache.continuation("quiet", [1, 2], 2).tokens == (3, 4)


def test_the_global_cap_evicts_from_the_segment_holding_the_most():
    """Two segments flooding up to their share (60 % each) overfill the cache; a third, quiet one keeps its outputs:
    past the cap the largest segment loses its oldest output, not whichever segment's output is oldest."""
    cache = small_cache(share=0.6)
    rng = random.Random(4)
    quiet = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    for output in quiet:
        cache.add("quiet", output)
    quiet_bytes = cache.segment_bytes("quiet")
    for i in range(240):
        cache.add("ab"[i % 2], [rng.randrange(50_000) for _ in range(40)])
        assert cache.bytes <= cache.config.cache_bytes
    assert cache.segment_bytes("quiet") == quiet_bytes, "the flood evicted a quiet segment's outputs"
    assert cache.continuation("quiet", [1, 2], 2).tokens == (3, 4)
    held = {s: cache.segment_bytes(s) for s in "ab"}
    assert abs(held["a"] - held["b"]) < 0.1 * cache.config.cache_bytes, held  # the flood shares what is left


def test_an_output_longer_than_a_share_holds_is_cut_and_an_emptied_segment_frees_its_trie():
    cache = small_cache(cache_bytes=100_000, share=0.6)  # two segments at their share are past the cap
    assert 0 < cache.max_output_tokens < 1000
    cache.add("s", list(range(1000, 3000)))
    assert len(cache.outputs()[0].tokens) == cache.max_output_tokens
    assert cache.segment_bytes("s") <= cache.segment_cap
    for i in range(200):  # another segment pushes "s" out entirely
        cache.add("t", [random.Random(i).randrange(50_000) for _ in range(30)])
    assert cache.segment_bytes("s") == 0 and "s" not in {o.segment for o in cache.outputs()}
    assert cache.bytes == accounted(cache)


def test_node_bytes_bound_what_a_trie_really_allocates():
    """The cache's bytes are an upper bound of the memory its tries take (tracemalloc), at several sizes."""
    rng = random.Random(5)
    for outputs in (1, 10, 100):
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            trie = SuffixTrie(16)
            for _ in range(outputs):
                trie.insert([rng.randrange(50_000) for _ in range(100)])
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        charged = TRIE_BYTES + trie.nodes * NODE_BYTES + outputs * 100 * TOKEN_BYTES
        assert used <= charged, f"{outputs} outputs: {used} bytes allocated, {charged} charged"


def test_a_disabled_cache_holds_nothing():
    cache = small_cache(cache_bytes=0)
    cache.add("s", [1, 2, 3])
    assert cache.outputs() == [] and cache.bytes == 0


# -- the drafter ---------------------------------------------------------------------------------------------------


def test_the_drafter_reads_its_own_segment_and_takes_the_higher_scoring_proposal():
    cache = small_cache()
    cache.add("a", [4, 5, 6, 7, 8, 9])
    context = torch.tensor([1, 2, 3, 4, 5])
    mine = SuffixDrafter(cache.config, cache, "a")
    mine.prefill(context)
    assert mine.propose(context, 3).tokens.tolist() == [6, 7], "'4 5' then 6 7 in segment a (2 matched: 2 tokens)"
    theirs = SuffixDrafter(cache.config, cache, "b")
    theirs.prefill(context)
    assert theirs.propose(context, 3).num_tokens == 0, "segment b must not read segment a's outputs"
    own_text = torch.tensor([4, 5, 1, 4, 5, 2, 4, 5])  # its own text followed '4 5' by 1 once, by 2 once
    drafter = SuffixDrafter(cache.config, cache, "a")
    drafter.prefill(own_text)
    assert drafter.propose(own_text, 3).tokens.tolist() == [6, 7], "the cache's 6 7 scores 2, the own 2 4 0.5 + 0.5"
    alone = SuffixDrafter(cache.config, None, "a")
    alone.prefill(own_text)
    assert alone.propose(own_text, 3).tokens.tolist() == [2, 4], "without the cache: its own text (a tie: the newest)"
    tied = SuffixDrafter(cache.config, cache, "a")
    repeat = torch.tensor([4, 5, 1, 1, 4, 5])  # its own '4 5' then 1 1 scores 2, as the cache's 6 7: a tie
    tied.prefill(repeat)
    assert tied.propose(repeat, 3).tokens.tolist() == [1, 1], "a tie goes to the request's own text"
    assert alone.propose(own_text, 0).num_tokens == 0
    assert drafter.propose(own_text, 3).probs is None, "a suffix proposal is one-hot"


def test_the_own_window_indexes_the_prompts_tail():
    config = SuffixConfig(depth=8, own_window=4)
    drafter = SuffixDrafter(config)
    prompt = torch.tensor([1, 2, 3, 9, 9, 9, 9, 1, 2])  # '1 2 3' lies before the window's 4 tokens
    drafter.prefill(prompt)
    assert drafter.propose(prompt, 2).num_tokens == 0
    wide = SuffixDrafter(SuffixConfig(depth=8))
    wide.prefill(prompt)
    assert wide.propose(prompt, 2).tokens.tolist() == [3, 9]


# -- exactness -----------------------------------------------------------------------------------------------------


def prompts_with_structure(vocab: int, seed: int, count: int) -> list[list[int]]:
    """Prompts from a few shared fragments: the cache (earlier outputs) and the prompts' own text both match."""
    rng = random.Random(seed)
    fragments = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 8))] for _ in range(4)]
    return [[t for _ in range(rng.randint(1, 4)) for t in rng.choice(fragments)] for _ in range(count)]


def filled_cache(
    decoder: SpeculativeDecoder, prompts: list[list[int]], rules: StopConditions, segment: str
) -> SuffixCache:
    """Earlier outputs of the target on ``prompts`` (what a worker serves), and a corrupted copy of each, so that
    proposals from the cache are accepted in part."""
    cache = SuffixCache(SuffixConfig(depth=8))
    rng = random.Random(0)
    for prompt in prompts:
        output = decoder.generate(prompt, "none", 0, GREEDY, rules).token_ids
        cache.add(segment, output)
        cache.add(segment, [t if rng.random() < 0.7 else rng.randrange(1, 50) for t in output])
    return cache


def test_suffix_greedy_equals_target_only(arch, target, tokenizer):
    rules = StopConditions(max_new_tokens=20)  # no EOS: long outputs, where repetition gives matches
    plain = SpeculativeDecoder(target)
    earlier = prompts_with_structure(len(tokenizer), seed=1, count=6)
    decoder = SpeculativeDecoder(target, suffix_cache=filled_cache(plain, earlier, rules, ""))
    proposed = accepted = 0
    for k in (1, 3, 5, 8):
        for prompt in [*prompts_with_structure(len(tokenizer), seed=1 + k, count=3), earlier[k % 6]]:
            expected = plain.generate(prompt, "none", 0, GREEDY, rules)
            got = decoder.generate(prompt, "suffix", k, GREEDY, rules)
            assert got.token_ids == expected.token_ids, f"K={k} prompt={prompt}"
            assert got.stats.rounds[0].drafter == "suffix"
            proposed += got.stats.num_drafted
            accepted += got.stats.num_accepted
    assert 0 < accepted < proposed, "proposals must be partly rejected, or rollback is not exercised"


@pytest.fixture(scope="module")
def llama_target(tokenizer) -> LoadedModel:
    return tiny_lm("llama", tokenizer, seed=0)


def test_batched_suffix_rounds_equal_single_sequence_rounds(llama_target):
    """Suffix sequences beside prompt lookup and plain ones, each with its segment's cache: the target's greedy
    output, in the very rounds the single-sequence engine runs."""
    rules = StopConditions(max_new_tokens=16)
    vocab = llama_target.vocab_size
    plain = SpeculativeDecoder(llama_target)
    cache = filled_cache(plain, prompts_with_structure(vocab, seed=30, count=6), rules, "seg-a")
    prompts = prompts_with_structure(vocab, seed=31, count=6)
    drafters = ["suffix", "prompt_lookup", "suffix", "none", "suffix", "suffix"]
    ks = [4, 3, 6, 0, 2, 8]
    segments = ["seg-a", "seg-b"] * 3  # two segments' caches: seg-b holds nothing
    plans = [Plan(d, k, segment=s) for d, k, s in zip(drafters, ks, segments, strict=True)]
    single = SpeculativeDecoder(llama_target, suffix_cache=cache)
    want_tokens = [plain.generate(p, "none", 0, GREEDY, rules).token_ids for p in prompts]
    want_rounds = [
        [(r.k, r.num_drafted, r.num_accepted) for r in single.decode(p, GREEDY, rules, plan).stats.rounds]
        for p, plan in zip(prompts, plans, strict=True)
    ]
    engine = BatchEngine(llama_target, max_batch=len(prompts), suffix_cache=cache)
    sessions = [engine.open(p, GREEDY, rules, plan) for p, plan in zip(prompts, plans, strict=True)]
    live = list(range(len(sessions)))
    while live:
        engine.step([sessions[i] for i in live])
        live = [i for i in live if sessions[i].finish_reason is None]
    assert [s.drafter.segment for s in sessions if isinstance(s.drafter, SuffixDrafter)] == ["seg-a"] * 3 + ["seg-b"]
    drafted = 0
    for i, session in enumerate(sessions):
        assert session.result().token_ids == want_tokens[i], f"request {i} ({drafters[i]}) differs under batching"
        got_rounds = [(r.k, r.num_drafted, r.num_accepted) for r in session.stats.rounds]
        assert got_rounds == want_rounds[i], f"request {i} ({drafters[i]}): its rounds differ under batching"
        drafted += session.stats.num_drafted if drafters[i] == "suffix" else 0
        engine.close(session)
    assert drafted > 0, "suffix never proposed: nothing was tested"


def test_suffix_sampling_matches_the_target_distribution():
    """With sampling, a suffix proposal is a one-hot q: the output follows the target's distribution exactly. The
    cache holds the target's own samples after the prompt, so first rounds propose (and are accepted, or not)."""
    tokenizer = small_vocab_tokenizer()
    target = small_vocab_lm(tokenizer, 0, "target")
    params = SamplingParams(temperature=1.0)
    plain = SpeculativeDecoder(target)
    cache = SuffixCache(SuffixConfig(depth=8))
    for seed in range(20):  # the cached outputs start with the prompt's last tokens, so the first round matches
        sample = plain.generate(list(PROMPT), "none", 0, SamplingParams(1.0, seed=1000 + seed), StopConditions(4))
        cache.add("", [*PROMPT[-2:], *sample.token_ids])
    decoder = SpeculativeDecoder(target, suffix_cache=cache)
    rules = StopConditions(max_new_tokens=4)
    samples, proposed = [], 0
    for seed in range(1000):
        got = decoder.generate(list(PROMPT), "suffix", 3, SamplingParams(1.0, seed=seed), rules)
        samples.append(tuple(got.token_ids[:2]))
        proposed += got.stats.rounds[0].num_drafted
    assert proposed > 500, "the first round rarely proposed: the test would not see a wrong acceptance"
    pvalue = chi_square_pvalue(samples, exact_distribution(target, PROMPT, params, 2))
    assert pvalue > REJECT_BELOW, f"samples do not follow the target distribution (chi-square p = {pvalue:.2e})"
