"""llama.cpp's ngram-simple rule, case by case (its agreement with a running llama-server's own counts is
tests/llama/test_adapter.py's)."""

from __future__ import annotations

import pytest
import torch

from specd.llama.ngram_simple import NgramSimpleDrafter, ngram_simple_draft

# positions:  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
HISTORY = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6]


def test_the_draft_is_what_followed_the_latest_earlier_match_of_the_last_n_tokens() -> None:
    # the pattern is the history's last 2 tokens and the sampled one: (5, 6, 7) at position 5
    assert ngram_simple_draft(HISTORY, 7, 3, 3) == [8, 1, 2]
    # m caps the draft (n 2: the pattern (6, 7) at position 6)
    assert ngram_simple_draft(HISTORY, 7, 2, 3) == [8, 1, 2]
    assert ngram_simple_draft(HISTORY, 7, 2, 4) == [8, 1, 2, 3]
    assert ngram_simple_draft(HISTORY, 7, 3, 2) == []  # a draft shorter than n is never made: m < n never drafts


def test_the_latest_match_wins() -> None:
    history = [0, 5, 6, 1, 1, 1, 5, 6, 2, 2, 2, 0, 0, 0, 0, 0, 5]
    assert ngram_simple_draft(history, 6, 2, 3) == [2, 2, 2]


def test_position_zero_and_the_start_just_before_the_patterns_own_never_match() -> None:
    history = [5, 6, 1, 2, 3, 0, 0, 0, 0, 0, 7, 7]
    assert ngram_simple_draft(history, 5, 1, 3) == []  # (5,) only at position 0
    # (7, 7) starts at 10 in the history and the pattern (history[11], sampled) = (7, 7) starts at 11:
    # the search begins at len - n - 1 = 9, so neither 10 nor the pattern's own start is a match
    assert ngram_simple_draft(history, 7, 2, 3) == []
    assert ngram_simple_draft([*history[:9], 7, 7, 4, 4, 4, 7], 7, 2, 3) == [4, 4, 4]


def test_no_draft_from_a_short_history_or_when_fewer_than_n_tokens_follow_the_match() -> None:
    assert ngram_simple_draft(HISTORY[:7], 7, 3, 3) == []  # 7 <= n + m + 1
    # the latest match (2, 3, 4) at 12 has 2 tokens after it; the earlier one at 1, with 4 after it, is not looked at
    history = [0, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 2, 3, 4, 2, 3]
    assert ngram_simple_draft(history, 4, 3, 8) == []
    assert ngram_simple_draft(history[:12], 4, 3, 8) == []  # 12 <= n + m + 1
    assert ngram_simple_draft([*history[:12], 9, 2, 3], 4, 3, 8) == [5, 6, 7, 8, 0, 0, 0, 0]  # where it is the latest


def test_the_drafter_drafts_at_its_m_and_cuts_to_the_rounds_k() -> None:
    drafter = NgramSimpleDrafter(3, 3)
    context = torch.tensor([*HISTORY, 7])
    assert drafter.propose(context, 3).tokens.tolist() == [8, 1, 2]
    assert drafter.propose(context, 1).tokens.tolist() == [8]  # the round's budget cuts the server's draft
    assert drafter.propose(context, 0).tokens.tolist() == []
    # a K above m drafts no more than m
    assert drafter.propose(context, 8).tokens.tolist() == [8, 1, 2]
    with pytest.raises(ValueError, match="at least 1"):
        NgramSimpleDrafter(0, 8)
