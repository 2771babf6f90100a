"""Where acceptance is decided: which draft tokens the target keeps, and the bonus token.

Both rules are exact. Greedy keeps the longest prefix of the draft that equals the target's argmax.
Sampling is the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023: draft token x_i is kept
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the replacement is drawn from the
normalised residual max(0, p_i - q_i); if all K are kept the bonus token is drawn from p_K. A
deterministic drafter (prompt lookup) proposes with a one-hot q, passed as ``draft_probs=None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of verifying one round's draft."""

    num_accepted: int  # leading draft tokens kept, 0..K
    next_token: int  # the bonus token: the target's own choice after the last accepted token


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> Verdict:
    """Keep the draft while it equals the target's argmax.

    # draft_tokens: [k] int64, target_argmax: [k + 1] int64 (the target's argmax after each prefix)
    """
    k = draft_tokens.shape[0]
    assert target_argmax.shape == (k + 1,), f"{tuple(target_argmax.shape)} != ({k + 1},)"
    mismatch = (draft_tokens != target_argmax[:k]).nonzero()
    num_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return Verdict(num_accepted, int(target_argmax[num_accepted]))


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling: the emitted tokens are distributed exactly as if sampled from the target.

    # draft_tokens: [k] int64
    # draft_probs:  [k, vocab] the drafter's q_i, or None for a deterministic drafter (one-hot q)
    # target_probs: [k + 1, vocab] the target's p_i, after the same temperature / top-k / top-p
    """
    k = draft_tokens.shape[0]
    assert target_probs.dim() == 2 and target_probs.shape[0] == k + 1, tuple(target_probs.shape)
    if draft_probs is not None:
        assert draft_probs.shape == (k, target_probs.shape[1]), tuple(draft_probs.shape)

    positions = torch.arange(k, device=target_probs.device)
    p = target_probs[positions, draft_tokens]  # [k] p_i(x_i)
    q = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones_like(p)  # [k]
    u = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
    # Accept x_i  <=>  u_i < p_i(x_i) / q_i(x_i)  <=>  u_i * q_i(x_i) < p_i(x_i)   (no division by zero)
    rejected = (u * q >= p).nonzero()
    num_accepted = int(rejected[0, 0]) if rejected.numel() else k

    if num_accepted == k:
        next_probs = target_probs[k]  # [vocab] the bonus token comes from the target as is
    else:
        next_probs = residual_distribution(
            target_probs[num_accepted],
            draft_probs[num_accepted] if draft_probs is not None else None,
            int(draft_tokens[num_accepted]),
        )
    next_token = torch.multinomial(next_probs, num_samples=1, generator=generator)
    return Verdict(num_accepted, int(next_token))


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft_token: int) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after rejecting ``draft_token``.

    # p, q: [vocab]; q None means one-hot at draft_token
    """
    if q is None:
        residual = p.clone()
        residual[draft_token] = 0.0  # max(0, p - onehot) is p with the draft token removed
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    # A rejection has probability sum(max(0, p - q)), so it cannot happen when the residual is empty;
    # only floating-point rounding gets here, and then p itself is the right answer.
    return residual / total if total > 0 else p
