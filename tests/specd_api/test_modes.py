"""Sampling modes and learning segments (specd_api/modes.py): a segment's sampled requests are learned under
``<segment>#sampled``, its greedy ones under its own name; no client segment can be a learning segment."""

from __future__ import annotations

import math

import pytest

from specd_api.modes import (
    GREEDY_BELOW,
    base_segment,
    learning_segment,
    mode_of,
    sampling_mode,
    valid_learning_segment,
    validate_learning_segment,
)
from specd_api.segments import valid_segment


@pytest.mark.parametrize(
    ("temperature", "mode", "why"),
    [
        (0.0, "greedy", "temperature 0 is the argmax"),
        (GREEDY_BELOW / 2, "greedy", "below GREEDY_BELOW the engine takes the argmax too"),
        (GREEDY_BELOW, "sampled", "from GREEDY_BELOW on, tokens are drawn"),
        (0.8, "sampled", "an ordinary sampled request"),
        (math.nan, "greedy", "not a number: never sampled by the engine (validation refuses it first)"),
    ],
)
def test_the_sampling_mode_is_the_engines(temperature: float, mode: str, why: str) -> None:
    assert sampling_mode(temperature) == mode, why


def test_a_segments_sampled_requests_are_learned_under_a_name_no_client_can_give() -> None:
    assert learning_segment("prose", 0.0) == "prose"
    sampled = learning_segment("prose", 0.8)
    assert sampled == "prose#sampled" and not valid_segment(sampled), "'#' is never in a client's segment"
    assert base_segment(sampled) == "prose" and base_segment("prose") == "prose"
    assert mode_of(sampled) == "sampled" and mode_of("prose") == "greedy"
    assert valid_learning_segment(sampled) and valid_learning_segment("prose")
    for bad in ("#sampled", "a#b#sampled", "", "x" * 129 + "#sampled", "prose#greedy"):
        assert not valid_learning_segment(bad), bad
        with pytest.raises(ValueError):
            validate_learning_segment(bad)
    assert validate_learning_segment("x" * 128 + "#sampled") == "x" * 128 + "#sampled"
