"""Continuous batching: a ragged batched pass computes what one pass per sequence computes, and greedy
outputs under batching (any mix of prompts, drafters, K and arrival times) equal each prompt's
single-sequence greedy output."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.engine import DecodeSession, SpeculativeDecoder
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from tests.conftest import perturbed_copy, tiny_lm

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def llama_target(tokenizer):
    return tiny_lm("llama", tokenizer, seed=0)


@pytest.fixture(scope="module")
def llama_draft(llama_target):
    return perturbed_copy(llama_target, scale=0.1, seed=3)  # accepts some drafts, rejects others


def test_ragged_forward_equals_one_sequence_at_a_time(llama_target):
    rng = random.Random(0)
    vocab = llama_target.vocab_size
    batched, single = KVPool(llama_target, 4), KVPool(llama_target, 4)
    seqs_b = [batched.open() for _ in range(4)]
    seqs_s = [single.open() for _ in range(4)]
    for round_ in range(6):
        # Each row appends its own number of tokens at its own position, then some rows roll back.
        rows = [torch.tensor([rng.randrange(vocab) for _ in range(rng.randint(1, 7))]) for _ in range(4)]
        got = batched.forward_many(list(zip(seqs_b, rows, strict=True)))
        for seq, ids, out in zip(seqs_s, rows, got, strict=True):
            want = seq.forward(ids)
            assert out.shape == want.shape
            torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9, msg=f"round {round_}")
        for sb, ss in zip(seqs_b, seqs_s, strict=True):
            keep = rng.randint(max(0, sb.length - 5), sb.length)
            sb.truncate(keep)
            ss.truncate(keep)
    for sb, ss in zip(seqs_b, seqs_s, strict=True):
        for kb, ks in zip(sb.cached_keys(), ss.cached_keys(), strict=True):
            torch.testing.assert_close(kb, ks, rtol=1e-9, atol=1e-9)


def test_ragged_forward_matches_in_float32_too(tokenizer):
    target = tiny_lm("llama", tokenizer, seed=1)
    target.model.float()
    pool, ref = KVPool(target, 3), KVPool(target, 3)
    a, b = [pool.open() for _ in range(3)], [ref.open() for _ in range(3)]
    prompts = [torch.arange(1, n + 1) for n in (5, 17, 9)]
    got = pool.forward_many(list(zip(a, prompts, strict=True)))
    for seq, ids, out in zip(b, prompts, got, strict=True):
        torch.testing.assert_close(out, seq.forward(ids), rtol=1e-4, atol=1e-4)


def test_slots_are_reused_and_exhaustion_is_an_error(llama_target):
    pool = KVPool(llama_target, 2)
    a, b = pool.open(), pool.open()
    with pytest.raises(RuntimeError, match="KV slots"):
        pool.open()
    pool.release(a)
    c = pool.open()
    assert c.slot == a.slot and c.length == 0 and b.length == 0


def random_requests(vocab: int, seed: int, count: int) -> list[tuple[list[int], str, int, int]]:
    """(prompt, drafter, K, arrival step): repetitive prompts give prompt lookup something to find."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        body = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 20))]
        prompt = body * 3 if i % 3 == 0 else body
        drafter = rng.choice(["draft", "prompt_lookup", "none"])
        k = 0 if drafter == "none" else rng.randint(1, 8)
        requests.append((prompt, drafter, k, rng.randint(0, 12)))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_greedy_equals_single_sequence_greedy(llama_target, llama_draft, seed):
    rules = StopConditions(max_new_tokens=16, eos_token_ids=llama_target.eos_token_ids)
    requests = random_requests(llama_target.vocab_size, seed, count=10)
    single = SpeculativeDecoder(llama_target, llama_draft)
    expected = [single.generate(p, "none", 0, GREEDY, rules).token_ids for p, _, _, _ in requests]

    engine = BatchEngine(llama_target, llama_draft, max_batch=6)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][3])
    active: dict[int, DecodeSession] = {}
    got: dict[int, list[int]] = {}
    step = proposed = accepted = 0
    max_seen = 0
    while pending or active:
        # Requests join between steps when they have arrived and a slot is free.
        while pending and requests[pending[0]][3] <= step and engine.free_slots:
            i = pending.pop(0)
            prompt, drafter, k, _ = requests[i]
            active[i] = engine.open(prompt, GREEDY, rules, requested(drafter, k))
        if active:
            order = list(active)
            max_seen = max(max_seen, len(order))
            engine.step([active[i] for i in order])
            for i in order:
                session = active[i]
                if session.finish_reason is not None:
                    got[i] = session.result().token_ids
                    proposed += session.stats.num_drafted
                    accepted += session.stats.num_accepted
                    engine.close(session)
                    del active[i]
        step += 1
    for i, want in enumerate(expected):
        assert got[i] == want, f"request {i} ({requests[i][1]}, K={requests[i][2]}) differs under batching"
    assert max_seen >= 3, "the schedule never batched several sequences: the test proves nothing"
    assert 0 < accepted < proposed, "drafts must be partly accepted for ragged acceptance to be exercised"


def test_batched_sampling_with_seeds_reproduces_single_sequence(llama_target, llama_draft):
    """Seeded sampling draws from each request's own generator, so batching changes nothing."""
    params = SamplingParams(temperature=0.9, seed=11)
    rules = StopConditions(max_new_tokens=12)
    prompt = [5, 6, 7, 8]
    single = SpeculativeDecoder(llama_target, llama_draft).generate(prompt, "draft", 3, params, rules)
    engine = BatchEngine(llama_target, llama_draft, max_batch=3)
    other = engine.open([9, 9, 9], GREEDY, rules, requested("prompt_lookup", 3))
    mine = engine.open(prompt, params, rules, requested("draft", 3))
    while mine.finish_reason is None:
        engine.step([s for s in (other, mine) if s.finish_reason is None])
    assert mine.result().token_ids == single.token_ids


def test_a_llama_pass_asked_for_another_model_is_refused_with_a_clear_error(tokenizer):
    gpt2 = tiny_lm("gpt2", tokenizer, seed=0)
    assert BatchEngine(gpt2).target_pool.forward_pass.name == "transformers"  # what "auto" runs it with
    with pytest.raises(ValueError, match="tiny-gpt2-0: the lean pass does not apply: GPT2LMHeadModel is not a plain"):
        BatchEngine(dataclasses.replace(gpt2, runner="lean"))


def test_a_refused_request_gives_its_slots_back(llama_target, llama_draft):
    engine = BatchEngine(llama_target, llama_draft, max_batch=2)
    too_long = [1] * (llama_target.max_context or 4096)
    for drafter in ("draft", "prompt_lookup"):
        with pytest.raises(ValueError, match="context"):
            engine.open(too_long, GREEDY, StopConditions(max_new_tokens=4), requested(drafter, 2))
    assert engine.free_slots == 2
    assert engine.draft_pool is not None and engine.draft_pool.free_slots == 2


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_to_keep_returns_the_tail_of_the_full_logits(llama_target, rows):
    full, tail = KVPool(llama_target, rows), KVPool(llama_target, rows)
    inputs = [torch.arange(1, n + 1) for n in (6, 2, 9)[:rows]]
    want = full.forward_many([(full.open(), ids) for ids in inputs])
    got = tail.forward_many([(tail.open(), ids) for ids in inputs], logits_to_keep=3)
    for w, g, ids in zip(want, got, inputs, strict=True):
        assert g.shape[0] == min(3, ids.shape[0])
        torch.testing.assert_close(g, w[-3:], rtol=1e-9, atol=1e-9)
    assert tail.lengths == full.lengths  # every token is cached, whatever logits are kept


def test_a_step_copies_its_greedy_argmaxes_to_the_host_once_whatever_the_batch(llama_target, monkeypatch):
    """Acceptance needs the target's argmaxes on the host: one copy for the whole step (one host synchronisation on
    a GPU), not one per sequence. Counted: the host copies of a step of 1, then 5 greedy sequences, one sampled among
    them (its rejection sampling stays on the logits' device)."""
    copies = 0
    host_copy = torch.Tensor.cpu

    def counted(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        nonlocal copies
        copies += 1
        return host_copy(tensor, *args, **kwargs)

    engine = BatchEngine(llama_target, None, max_batch=7)
    rules = StopConditions(max_new_tokens=8)
    one = [engine.open([3, 4, 5], GREEDY, rules, requested("none", 0))]
    many = [engine.open([3, 4 + i, 5], GREEDY, rules, requested("none", 0)) for i in range(5)]
    many.append(engine.open([7, 8], SamplingParams(temperature=0.8, seed=1), rules, requested("none", 0)))
    counts = []
    for sessions in (one, many):
        monkeypatch.setattr(torch.Tensor, "cpu", counted)
        copies = 0
        engine.step(sessions)
        monkeypatch.undo()
        counts.append(copies)
    assert counts == [1, 1], counts
