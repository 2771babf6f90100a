"""Logit warping: the same function for target and draft, so it must be right on its own."""

from __future__ import annotations

import math

import pytest
import torch

from decoder.sampling import SamplingParams, logits_to_probs, sample


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax = [1/4, 3/4]
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))  # logits doubled: [1/10, 9/10]
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.9]]))


def test_top_k_keeps_k_largest():
    probs = logits_to_probs(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("top_p", "kept", "why"),
    [
        (0.5, [True, False, False, False], "0.6 >= 0.5 already: the nucleus is the top token"),
        (0.7, [True, True, False, False], "0.6 < 0.7, 0.6 + 0.25 >= 0.7"),
        (0.9, [True, True, True, False], "0.85 < 0.9, needs the third token"),
        (1.0, [True, True, True, True], "top_p = 1 disables the filter"),
    ],
)
def test_top_p_keeps_smallest_nucleus(top_p, kept, why):
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    out = logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert (out[0] > 0).tolist() == kept, why


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}],
)
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_vanishing_temperature_is_greedy_not_nan():
    params = SamplingParams(temperature=1e-40)
    assert params.is_greedy
    assert logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), params).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize(
    ("top_p", "why"),
    [
        (1e-46, "under float32's smallest subnormal: compares as 0 with a float32 tensor"),
        (5e-324, "the smallest positive double JSON can spell"),
        (1e-30, "small but representable: the mass before the top token (0) is still below it"),
    ],
)
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p, why):
    """A top_p that underflows float32 must not drop every token: softmax of all -inf is NaN, and the sampler would
    raise in the decode thread. The nucleus always holds the most likely token, whatever top_p is."""
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], why
    assert sample(probs, None).tolist() == [1, 3]
