"""What distillation minimises and what it is judged by, as pure functions of two models' logits."""

from __future__ import annotations

import torch


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of KL(p ‖ q), p = softmax(target / T), q = softmax(draft / T), times T².

    # draft_logits: [b, n, vocab], target_logits: [b, n, vocab]  ->  scalar (nats)
    Forward KL makes q cover everything p proposes, which is what rejection sampling accepts; the T² factor
    (Hinton et al. 2015) keeps the gradient's size independent of T. Gradients flow into the draft only.
    """
    assert draft_logits.shape == target_logits.shape, (tuple(draft_logits.shape), tuple(target_logits.shape))
    log_p = torch.log_softmax(target_logits.detach().float() / temperature, dim=-1)  # [b, n, vocab]
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)  # [b, n, vocab]
    p = log_p.exp()
    per_token = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(dim=-1)  # [b, n]; 0·log 0 = 0
    return per_token.mean() * temperature**2


def top1_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Share of positions where the draft's argmax is the target's: greedy acceptance of one draft token.

    # draft_logits: [..., vocab], target_logits: [..., vocab]  ->  scalar in [0, 1]
    """
    assert draft_logits.shape == target_logits.shape, (tuple(draft_logits.shape), tuple(target_logits.shape))
    return (draft_logits.argmax(dim=-1) == target_logits.argmax(dim=-1)).float().mean()
