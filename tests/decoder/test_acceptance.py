"""Acceptance on constructed distributions whose answers can be worked out by hand."""

from __future__ import annotations

import pytest
import torch

from decoder.acceptance import greedy_accept, rejection_sample, residual_distribution

VOCAB = 4


def onehot(i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), VOCAB).double()


@pytest.mark.parametrize(
    ("draft", "argmax", "accepted", "bonus", "why"),
    [
        ([1, 2, 3], [1, 2, 3, 0], 3, 0, "all match: the bonus is the argmax after the last draft token"),
        ([1, 2, 3], [1, 0, 3, 2], 1, 0, "first mismatch at position 1: keep 1, emit the target's token"),
        (
            [1, 2, 3],
            [3, 2, 3, 2],
            0,
            3,
            "mismatch at 0: a later match does not count (acceptance is a prefix)",
        ),
        ([], [2], 0, 2, "an empty draft is plain decoding"),
    ],
)
def test_greedy_accept(draft, argmax, accepted, bonus, why):
    verdict = greedy_accept(torch.tensor(draft, dtype=torch.long), torch.tensor(argmax))
    assert (verdict.num_accepted, verdict.next_token) == (accepted, bonus), why


def test_q_equal_p_accepts_everything():
    # p_i / q_i = 1 for every drafted token, so u < 1 always accepts.
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4, dtype=torch.float64)
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        draft = torch.multinomial(p[:3], 1, generator=g).squeeze(-1)
        verdict = rejection_sample(draft, p[:3].clone(), p, g)
        assert verdict.num_accepted == 3


def test_disjoint_supports_reject_everything_and_resample_from_p():
    # q puts all mass on token 0, p none: p(x)/q(x) = 0, so the first token is always rejected and the
    # residual max(0, p - q) = p.
    q = onehot(0).repeat(2, 1)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 3, dtype=torch.float64)
    for seed in range(50):
        verdict = rejection_sample(torch.tensor([0, 0]), q, p, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        assert verdict.next_token in (1, 2)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    # max(0, p - q) = [0, 0.2, 0.1, 0] -> normalised [0, 2/3, 1/3, 0]
    expected = torch.tensor([0.0, 2 / 3, 1 / 3, 0.0], dtype=torch.float64)
    torch.testing.assert_close(residual_distribution(p, q, draft_token=0), expected)


def test_residual_for_one_hot_draft_removes_the_draft_token():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    expected = torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(residual_distribution(p, None, draft_token=0), expected)


def test_one_hot_draft_is_accepted_with_probability_p_of_token():
    # Deterministic drafter proposing token 1 where p(1) = 0.3: accept rate must be 0.3.
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25] * 4], dtype=torch.float64)
    n = 20_000
    g = torch.Generator().manual_seed(0)
    accepted = sum(rejection_sample(torch.tensor([1]), None, p, g).num_accepted for _ in range(n))
    assert abs(accepted / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5


def test_one_step_output_distribution_equals_p():
    """Sampled x ~ q, accept/resample: the emitted first token must be distributed as p exactly."""
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25] * 4], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.1, 0.1, 0.3]], dtype=torch.float64)
    n = 40_000
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(VOCAB)
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        verdict = rejection_sample(x, q, p, g)
        counts[int(x) if verdict.num_accepted == 1 else verdict.next_token] += 1
    tv = 0.5 * (counts / n - p[0].float()).abs().sum()
    # The draft alone (q) is at TV 0.6 from p; a correct sampler converges to 0 (sd of TV here ~0.004).
    assert tv < 0.015, f"total variation {tv:.4f}"
