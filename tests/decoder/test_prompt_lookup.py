"""The n-gram search behind prompt lookup, on arrays small enough to check by eye."""

from __future__ import annotations

import numpy as np
import pytest

from decoder.drafters.prompt_lookup import PromptLookupConfig, find_continuation


@pytest.mark.parametrize(
    ("tokens", "k", "expected", "why"),
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1], "trigram 1 2 3 seen before: propose what followed it"),
        ([1, 2, 3, 4, 9, 1, 2, 3], 1, [4], "k caps the proposal"),
        ([5, 6, 7, 8], 3, [], "no earlier occurrence of any suffix: empty draft, not an error"),
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1], "the most recent match wins"),
        ([1, 2, 3, 9, 3], 2, [9, 3], "falls back to a unigram when no bigram matches"),
        ([4, 5, 4], 5, [5, 4], "proposal stops at the end of the context"),
        ([7], 3, [], "a single token has nothing before it"),
        ([1, 2, 3, 1, 2, 3], 0, [], "k = 0 proposes nothing"),
    ],
)
def test_find_continuation(tokens, k, expected, why):
    found = find_continuation(np.array(tokens), k, min_ngram=1, max_ngram=3)
    assert found.tolist() == expected, why


def test_longer_ngram_beats_more_recent_shorter_one():
    # Trigram (1 2 3) occurs at the start -> 4; the unigram 3 also occurs later -> 5. Longer wins.
    tokens = np.array([1, 2, 3, 4, 0, 3, 5, 1, 2, 3])
    assert find_continuation(tokens, 1, min_ngram=1, max_ngram=3).tolist() == [4]


def test_min_ngram_refuses_short_matches():
    assert find_continuation(np.array([1, 2, 3, 9, 3]), 2, min_ngram=2, max_ngram=3).tolist() == []


def test_config_is_validated():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupConfig(min_ngram=3, max_ngram=2)
