"""The batch-invariant pass (decoder/runners/invariant.py): a token's logits are the same bits alone, verified among
K drafts and in a ragged batch, in every dtype, with PyTorch's kernels; so greedy speculative output equals greedy
target-only output token for token, and batched output equals single, with no tie allowance.

On this CPU the lean pass is not invariant in float32 (MKL picks its kernel by the number of rows), which is what
the float32 cases guard; the bfloat16 cases are the mode's purpose on a GPU and run here too.
``SPECD_TEST_DEVICE=cuda`` runs them on a GPU (docs/BENCHMARKS.md has that run)."""

from __future__ import annotations

import os

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.kv_cache import open_sequence
from decoder.models import from_objects
from decoder.request_stop import StopConditions
from decoder.runners.invariant import TILE
from decoder.tiny import build_model
from tests.decoder.test_native import (
    VOCAB,
    assert_batched_equals_single,
    assert_speculative_equals_target_only,
    llama,
    perturbed,
    pool_of,
)

DTYPES = [torch.float32, torch.bfloat16]
DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))


def wide_llama(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    # wide enough that MKL's float32 kernels differ between 1 and n rows (the lean pass then differs in the last bits)
    shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, head_dim=32)
    return llama(seed=seed, **{**shape, **overrides}).to(DEVICE, dtype)


def logits_three_ways(pool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One token at a time; then the same tokens verified 9, 2, 5 and 7 at a time, and 5 of them in a ragged
    batch beside another sequence's 4."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (30,), generator=generator)
    tokens = torch.randint(0, VOCAB, (2 * TILE + 1,), generator=generator)  # three tiles when verified at once
    a, b, c = pool.open(), pool.open(), pool.open()
    for seq in (a, b):
        seq.forward(prompt)
    c.forward(torch.randint(0, VOCAB, (11,), generator=generator))
    alone = torch.cat([a.forward(tokens[i : i + 1]) for i in range(len(tokens))])
    others = [b.forward(tokens)]
    for width in (2, 5, 7):
        b.truncate(30)
        others.append(b.forward(tokens[:width]))
    b.truncate(30)
    others.append(pool.forward_many([(c, tokens[:4]), (b, tokens[:5])])[1])
    others.append(pool.forward_many([(b, tokens[5:9])], logits_to_keep=1)[0])  # the last row of 4 only
    return alone, others


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tokens_logits_do_not_depend_on_what_shares_its_pass(dtype, request):
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(1))
    alone, others = logits_three_ways(pool_of(wide_llama(dtype), "invariant"))
    expected = [alone, alone[:2], alone[:5], alone[:7], alone[:5], alone[8:9]]
    for i, (got, want) in enumerate(zip(others, expected, strict=True)):
        assert got.dtype == dtype and torch.equal(got, want), f"case {i}: max diff {(got - want).abs().max()}"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="a fact about this CPU's float32 kernels")
def test_the_lean_pass_is_not_invariant_here_which_is_why_the_mode_exists(request):
    """Guards the test above: in float32 on this CPU the same comparison fails for the lean pass. If MKL ever made
    it pass, the float32 case above would no longer tell the modes apart."""
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(1))
    alone, others = logits_three_ways(pool_of(wide_llama(torch.float32), "lean"))
    assert not torch.equal(others[0], alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_logits_as_transformers(dtype):
    """Invariance is not enough: the pass must compute the model. Against transformers in float64: to float32
    rounding in float32; in bfloat16, no further off than transformers' own bfloat16 forward (each activation is
    rounded to 8 bits, so both are off by about 0.1-0.5 on logits of magnitude 7)."""
    fast = pool_of(wide_llama(dtype), "invariant").open()
    same_dtype = open_sequence(from_objects(wide_llama(dtype), None, "theirs", runner="transformers"))
    exact = open_sequence(from_objects(wide_llama(torch.float64), None, "exact", runner="transformers"))
    generator = torch.Generator().manual_seed(1)
    for i, n in enumerate((37, 1, 6, 1, 9)):
        if i == 3:  # roll back 4 tokens first
            for seq in (fast, same_dtype, exact):
                seq.truncate(seq.length - 4)
        tokens = torch.randint(0, VOCAB, (n,), generator=generator)
        got, theirs, expected = (
            fast.forward(tokens).double(),
            same_dtype.forward(tokens).double(),
            exact.forward(tokens),
        )
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-4, msg=f"step {i}")
        else:
            ours_off, theirs_off = (got - expected).abs().max(), (theirs - expected).abs().max()
            assert ours_off <= 1.25 * theirs_off + 1e-3, f"step {i}: {ours_off:.3f} off, transformers {theirs_off:.3f}"
        layers = zip(fast.cached_keys(), same_dtype.cached_keys(), exact.cached_keys(), strict=True)
        for layer, (ours, theirs, keys) in enumerate(layers):
            ours_off, theirs_off = (ours.double() - keys).abs().max(), (theirs.double() - keys).abs().max()
            assert ours_off <= (1.25 * theirs_off if dtype == torch.bfloat16 else 2e-4) + 1e-3, (
                f"step {i} layer {layer}"
            )


def bf16_pair(tokenizer, seed: int) -> tuple:
    vocab = len(tokenizer)
    target = from_objects(wide_llama(torch.bfloat16, seed, vocab_size=vocab), tokenizer, "t", runner="invariant")
    sometimes = perturbed(wide_llama(torch.bfloat16, seed, vocab_size=vocab), seed + 1)
    return target, from_objects(sometimes, tokenizer, "d", runner="invariant")


def test_speculative_greedy_equals_target_only_exactly_in_bfloat16(tokenizer):
    target, draft = bf16_pair(tokenizer, seed=4)
    assert_speculative_equals_target_only(SpeculativeDecoder(target, draft), len(tokenizer))


def test_batched_greedy_equals_single_exactly_in_bfloat16(tokenizer):
    rules = StopConditions(max_new_tokens=16)
    target, draft = bf16_pair(tokenizer, seed=8)
    engine = BatchEngine(target, draft, max_batch=4)
    assert engine.draft_pool is not None
    assert engine.target_pool.forward_pass.name == engine.draft_pool.forward_pass.name == "invariant"
    assert_batched_equals_single(engine, rules, len(tokenizer))


def test_a_model_it_does_not_cover_is_refused_by_name(tokenizer):
    gpt2 = from_objects(build_model("gpt2", len(tokenizer), 0), tokenizer, "tiny-gpt2", runner="invariant")
    with pytest.raises(ValueError, match="tiny-gpt2: the invariant pass does not apply: GPT2LMHeadModel is not a"):
        open_sequence(gpt2)
