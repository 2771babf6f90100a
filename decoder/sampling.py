"""Turning logits into the distribution a token is drawn from.

The same processing (temperature, top-k, top-p) is applied to the target's and the drafter's logits,
so that rejection sampling compares like with like (Leviathan et al. 2023, section 3.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specd_api.modes import GREEDY_BELOW


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflow; the distribution is the argmax's anyway.
        return self.temperature < GREEDY_BELOW


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A private RNG for one request. A seeded sampled request is reproducible whatever else runs because it also
    decodes without speculation unless it names its own (``specd_api.plan.seeded``)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warp logits into a probability distribution over the vocabulary.

    # logits: [n, vocab]  ->  returns [n, vocab] float32, rows sum to 1
    Greedy is represented as the one-hot of the argmax, so the same acceptance rule stays exact.
    """
    assert logits.dim() == 2, f"expected [n, vocab], got {tuple(logits.shape)}"
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = _shifted_to_zero(logits) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if params.top_p < 1.0:
        logits = _mask_outside_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _shifted_to_zero(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` minus each row's largest, so that dividing by a small temperature cannot overflow: softmax, top-k and
    top-p are all unchanged by a shift, and every entry is then <= 0 (unshifted, a float16 or bfloat16 model's logits
    near the dtype's range, over a temperature of 1e-5, overflow to +inf and make the row NaN). Entries at +inf (a
    float16 overflow) become 0 and the rest -inf: the row's limit, uniform over its infinite tokens. A row with every
    entry -inf (or NaN) stays NaN: there is no distribution to draw from, and the sampler's error fails that request."""
    # logits: [n, vocab] float32
    top = logits.amax(dim=-1, keepdim=True)  # [n, 1]
    return torch.where(torch.isposinf(logits), 0.0, logits - top)


def _mask_outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (the nucleus)."""
    # logits: [n, vocab]
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [n, vocab]
    # A token is dropped when the mass strictly before it already reaches top_p. The most likely token always stays:
    # its mass before is 0, and so is a top_p under float32's smallest number (1e-46 compares as 0 with a float32
    # tensor): no top_p drops every token, which would leave no distribution and kill the decode loop.
    mass_before = cumulative - torch.softmax(sorted_logits, dim=-1)
    drop_sorted = mass_before >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row.  # probs: [n, vocab] -> [n] int64"""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
