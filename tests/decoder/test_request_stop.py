"""Stops: EOS, stop strings and max_new_tokens end a request, and nothing is emitted past them."""

from __future__ import annotations

import pytest
import torch

from decoder.engine import SpeculativeDecoder
from decoder.request_stop import StopConditions, cut_round, trim_stop_string
from decoder.sampling import SamplingParams

LETTERS = "abcdefghij"


def decode(ids) -> str:
    return "".join(LETTERS[i] for i in ids)


@pytest.mark.parametrize(
    ("generated", "new", "rules", "keep", "reason", "why"),
    [
        ([], [1, 2, 3], StopConditions(10), 3, None, "nothing to stop at"),
        ([], [1, 9, 3], StopConditions(10, frozenset({9})), 2, "stop", "EOS is kept and ends the request"),
        ([], [1, 9, 3], StopConditions(2, frozenset({9})), 2, "stop", "EOS as the last token of the budget"),
        ([1, 2], [3, 4, 5], StopConditions(4), 2, "length", "only 2 tokens of budget were left"),
        ([], [0, 1, 2, 3], StopConditions(10, stop_strings=("bc",)), 3, "stop", "'bc' is complete at token 3"),
        ([0, 1], [2, 3], StopConditions(10, stop_strings=("bc",)), 1, "stop", "a stop string spanning two rounds"),
        ([], [1, 9, 2], StopConditions(1, frozenset({9})), 1, "length", "budget cuts before the EOS is reached"),
    ],
)
def test_cut_round(generated, new, rules, keep, reason, why):
    cut = cut_round(generated, new, rules, decode)
    assert (cut.keep, cut.finish_reason) == (keep, reason), why


def test_trim_stop_string_cuts_at_the_earliest():
    assert trim_stop_string("hello END world STOP", ("STOP", "END")) == "hello "


def test_rules_are_validated():
    with pytest.raises(ValueError):
        StopConditions(0)
    with pytest.raises(ValueError):
        StopConditions(5, stop_strings=("",))


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_never_emits_past_max_new_tokens(target, k, max_new_tokens):
    decoder = SpeculativeDecoder(target, target)  # agrees always: every round tries to emit K + 1
    result = decoder.generate([5, 6, 7], "draft", k, SamplingParams(), StopConditions(max_new_tokens))
    assert len(result.token_ids) == max_new_tokens
    assert result.finish_reason == "length"


def test_stops_at_eos_inside_an_accepted_run(target):
    decoder = SpeculativeDecoder(target, target)
    free = decoder.generate([5, 6, 7], "none", 0, SamplingParams(), StopConditions(30)).token_ids
    eos = free[6]  # pretend the 7th generated token is the end of sequence
    result = decoder.generate([5, 6, 7], "draft", 8, SamplingParams(), StopConditions(30, frozenset({eos})))
    assert result.token_ids == free[: free.index(eos) + 1]
    assert result.finish_reason == "stop"


def test_stop_string_ends_generation_and_is_not_in_the_text(target):
    decoder = SpeculativeDecoder(target, target)
    free = decoder.generate([5, 6, 7], "none", 0, SamplingParams(), StopConditions(30))
    stop = free.text[10:13]
    assert stop, "the free-running text is too short for this test"
    result = decoder.generate([5, 6, 7], "draft", 6, SamplingParams(), StopConditions(30, stop_strings=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]
    assert len(result.token_ids) < len(free.token_ids)


def test_stop_string_split_across_byte_tokens_at_a_round_boundary(tokenizer):
    """Byte-level BPE spreads '€' over several tokens; a round boundary inside it must not hide the stop."""
    ids = tokenizer("ab€cd", add_special_tokens=False)["input_ids"]

    def decode_ids(token_ids) -> str:
        return tokenizer.decode(list(token_ids))

    rules = StopConditions(10, stop_strings=("€",))
    completes = next(i for i in range(1, len(ids) + 1) if "€" in decode_ids(ids[:i]))
    for split in range(len(ids)):  # every place a round could end
        cut = cut_round(ids[:split], ids[split:], rules, decode_ids)
        if split < completes:
            assert (split + cut.keep, cut.finish_reason) == (completes, "stop"), f"round boundary after {split} tokens"


def test_context_full_ends_with_length(tokenizer):
    """Prompt + output never exceed the target's context; the request ends with "length", not a crash."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from decoder.models import from_objects

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=16)
    lm = from_objects(AutoModelForCausalLM.from_config(config).double(), tokenizer, "short-context")
    decoder = SpeculativeDecoder(lm, lm)
    prompt = list(range(5, 15))  # 10 tokens, room for 6 more
    reference = decoder.generate(prompt, "none", 0, SamplingParams(), StopConditions(30))
    assert reference.finish_reason == "length" and len(prompt) + len(reference.token_ids) == 16
    for drafter in ("draft", "prompt_lookup"):
        result = decoder.generate(prompt, drafter, 8, SamplingParams(), StopConditions(30))
        assert result.token_ids == reference.token_ids and result.finish_reason == "length", drafter
    with pytest.raises(ValueError, match="no room"):
        decoder.generate(list(range(16)), "none", 0, SamplingParams(), StopConditions(4))


def test_draft_with_a_shorter_context_drafts_nothing_beyond_it(tokenizer):
    from transformers import AutoModelForCausalLM, GPT2Config

    from decoder.models import from_objects

    def gpt2(positions: int, seed: int):
        torch.manual_seed(seed)
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=positions)
        return from_objects(AutoModelForCausalLM.from_config(config).double(), tokenizer, f"ctx{positions}")

    target, short_draft = gpt2(64, 0), gpt2(8, 1)
    prompt = list(range(5, 25))  # 20 tokens: beyond the draft's 8
    expected = SpeculativeDecoder(target).generate(prompt, "none", 0, SamplingParams(), StopConditions(10)).token_ids
    result = SpeculativeDecoder(target, short_draft).generate(prompt, "draft", 4, SamplingParams(), StopConditions(10))
    assert result.token_ids == expected and result.stats.num_drafted == 0
