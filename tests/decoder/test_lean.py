"""The lean pass (decoder/runners/lean.py) gives transformers' logits (to float64 rounding) through prefill, decode,
rollback and multi-token verification, for the Llama variants it accepts; other models are left to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig

from decoder.kv_cache import open_sequence
from decoder.models import from_objects
from decoder.runners.kv import INITIAL_CAPACITY, why_not_plain_llama

VOCAB = 97


def llama(**overrides) -> torch.nn.Module:
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**base, **overrides})).double().eval()


VARIANTS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "mqa": {"num_key_value_heads": 1},
    "head_dim_24": {"head_dim": 24},
    "attention_bias": {"attention_bias": True, "mlp_bias": True},
    "rope_llama3": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    },
    "tied": {"tie_word_embeddings": True},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_logits_as_transformers(variant):
    model = llama(**VARIANTS[variant])
    assert not why_not_plain_llama(model)
    fast = open_sequence(from_objects(model, None, "fast", runner="lean"))
    slow = open_sequence(from_objects(model, None, "slow", runner="transformers"))
    generator = torch.Generator().manual_seed(1)
    steps = [
        ("prefill", torch.randint(0, VOCAB, (37,), generator=generator)),
        ("decode", torch.randint(0, VOCAB, (1,), generator=generator)),
        ("verify K=5", torch.randint(0, VOCAB, (6,), generator=generator)),
        ("rollback 4, verify K=3", None),
        ("decode", torch.randint(0, VOCAB, (1,), generator=generator)),
    ]
    for name, tokens in steps:
        if tokens is None:  # roll both back, then verify a new draft
            fast.truncate(fast.length - 4)
            slow.truncate(slow.length - 4)
            tokens = torch.randint(0, VOCAB, (4,), generator=generator)
        got, expected = fast.forward(tokens), slow.forward(tokens)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10, msg=f"{variant}: {name}")
        assert fast.length == slow.length
        for a, b in zip(fast.cached_keys(), slow.cached_keys(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_logits_to_keep_returns_the_last_rows():
    model = llama()
    fast = open_sequence(from_objects(model, None, "fast", runner="lean"))
    tokens = torch.arange(1, 11)
    full = fast.forward(tokens)
    fast.truncate(0)
    torch.testing.assert_close(fast.forward(tokens, logits_to_keep=1), full[-1:])


def test_cache_grows_past_its_initial_capacity():
    model = llama()
    fast = open_sequence(from_objects(model, None, "fast", runner="lean"))
    slow = open_sequence(from_objects(model, None, "slow", runner="transformers"))
    tokens = torch.randint(0, VOCAB, (INITIAL_CAPACITY - 3,), generator=torch.Generator().manual_seed(2))
    fast.forward(tokens), slow.forward(tokens)
    extra = torch.arange(8)  # crosses the capacity boundary
    torch.testing.assert_close(fast.forward(extra), slow.forward(extra), rtol=0, atol=1e-10)
    assert fast.length == INITIAL_CAPACITY + 5


@pytest.mark.parametrize(
    ("model", "fast", "why"),
    [
        (lambda: llama(), True, "plain Llama"),
        (lambda: AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)),
         False, "another architecture"),
        (lambda: AutoModelForCausalLM.from_config(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=16)),
         False, "sliding-window attention"),
    ],
)  # fmt: skip
def test_only_plain_llama_takes_the_fast_path(model, fast, why):
    built = model().double()  # float64: the lean pass is auto's choice for a Llama (not the float32 native one)
    assert (not why_not_plain_llama(built)) is fast, why
    assert open_sequence(from_objects(built, None, "m")).pool.forward_pass.name == ("lean" if fast else "transformers")


def test_runner_transformers_opts_out():
    seq = open_sequence(from_objects(llama(), None, "m", runner="transformers"))
    assert seq.pool.forward_pass.name == "transformers"
