"""Stops: EOS, stop strings and max_new_tokens end a request, and nothing is emitted past them."""

from __future__ import annotations

import pytest

from decoder.engine import SpeculativeDecoder
from decoder.sampling import SamplingParams
from decoder.stopping import StopRules, cut_round, trim_stop_string

LETTERS = "abcdefghij"


def decode(ids) -> str:
    return "".join(LETTERS[i] for i in ids)


@pytest.mark.parametrize(
    ("generated", "new", "rules", "keep", "reason", "why"),
    [
        ([], [1, 2, 3], StopRules(10), 3, None, "nothing to stop at"),
        ([], [1, 9, 3], StopRules(10, frozenset({9})), 2, "stop", "EOS is kept and ends the request"),
        ([], [1, 9, 3], StopRules(2, frozenset({9})), 2, "stop", "EOS as the last token of the budget"),
        ([1, 2], [3, 4, 5], StopRules(4), 2, "length", "only 2 tokens of budget were left"),
        ([], [0, 1, 2, 3], StopRules(10, stop_strings=("bc",)), 3, "stop", "'bc' is complete at token 3"),
        ([0, 1], [2, 3], StopRules(10, stop_strings=("bc",)), 1, "stop", "a stop string spanning two rounds"),
        ([], [1, 9, 2], StopRules(1, frozenset({9})), 1, "length", "budget cuts before the EOS is reached"),
    ],
)
def test_cut_round(generated, new, rules, keep, reason, why):
    cut = cut_round(generated, new, rules, decode)
    assert (cut.keep, cut.finish_reason) == (keep, reason), why


def test_trim_stop_string_cuts_at_the_earliest():
    assert trim_stop_string("hello END world STOP", ("STOP", "END")) == "hello "


def test_rules_are_validated():
    with pytest.raises(ValueError):
        StopRules(0)
    with pytest.raises(ValueError):
        StopRules(5, stop_strings=("",))


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_never_emits_past_max_new_tokens(target, k, max_new_tokens):
    decoder = SpeculativeDecoder(target, target)  # agrees always: every round tries to emit K + 1
    result = decoder.generate([5, 6, 7], "draft", k, SamplingParams(), StopRules(max_new_tokens))
    assert len(result.token_ids) == max_new_tokens
    assert result.finish_reason == "length"


def test_stops_at_eos_inside_an_accepted_run(target):
    decoder = SpeculativeDecoder(target, target)
    free = decoder.generate([5, 6, 7], "none", 0, SamplingParams(), StopRules(30)).token_ids
    eos = free[6]  # pretend the 7th generated token is the end of sequence
    result = decoder.generate([5, 6, 7], "draft", 8, SamplingParams(), StopRules(30, frozenset({eos})))
    assert result.token_ids == free[: free.index(eos) + 1]
    assert result.finish_reason == "stop"


def test_stop_string_ends_generation_and_is_not_in_the_text(target):
    decoder = SpeculativeDecoder(target, target)
    free = decoder.generate([5, 6, 7], "none", 0, SamplingParams(), StopRules(30))
    stop = free.text[10:13]
    assert stop, "the free-running text is too short for this test"
    result = decoder.generate([5, 6, 7], "draft", 6, SamplingParams(), StopRules(30, stop_strings=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]
    assert len(result.token_ids) < len(free.token_ids)
