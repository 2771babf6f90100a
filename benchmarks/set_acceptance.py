"""A drafter with a set acceptance α, for cost studies on models whose own acceptance means nothing (random weights).

It proposes the target's own greedy continuation, recorded in a first target-only pass, with each position
replaced by another token at rate 1 − α (``corrupted``: independently per position, deterministic given a seed),
while it runs the real draft model's forward exactly as the draft model drafter does (one pass per proposed token
but the last, the same widths, the same KV cache rolled back the same way), so a round costs what a draft model's
round costs. The engine verifies these proposals like any other, so its output is still the target's own.

Each position of the text is verified at most once (once verified it is emitted, accepted or corrected), so the
positions a run verifies are independent Bernoulli(α) trials: α is the per-position conditional acceptance of
Leviathan et al. (a round of K proposals emits (1 − α^(K+1)) / (1 − α) tokens on average), measured here as
accepted / verified (``specd_api.position_tally``'s prefix rule), not accepted / proposed. Where the target's pass
is not exact in its dtype (the lean pass in bfloat16 is not batch-invariant), the emitted text may leave the
recorded one, and from there on the set proposals miss: the curve reports the α it measured and whether each
output matched target-only, so such a run shows itself.

    from benchmarks.set_acceptance import corrupted, SetAcceptanceDrafter
"""

from __future__ import annotations

import torch

from decoder.drafters.draft_model import DraftModelDrafter
from decoder.kv_cache import ModelSequence
from decoder.models import LoadedModel
from decoder.sampling import SamplingParams
from specd_api.position_tally import PositionTally
from specd_api.rounds import RoundRecord


def corrupted(reference: torch.Tensor, start: int, alpha: float, vocab_size: int, seed: int) -> torch.Tensor:
    """``reference`` with every position from ``start`` on replaced, with probability 1 − ``alpha`` each and
    independently, by a different token of ``[0, vocab_size)``; the same answer for the same seed.
    # reference: [t] int64 (a prompt and the target's greedy continuation) -> [t] int64"""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if vocab_size < 2:
        raise ValueError(f"a corrupted token needs a vocabulary of at least 2, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    n = reference.shape[0]
    keep = torch.rand(n, generator=generator, dtype=torch.float64) < alpha  # [t]
    keep[:start] = True
    offset = torch.randint(1, vocab_size, (n,), generator=generator)  # [t] never 0: never the right token
    return torch.where(keep, reference, (reference + offset) % vocab_size)


class SetAcceptanceDrafter(DraftModelDrafter):
    """The draft model's rounds, proposing ``proposals`` (``corrupted``) instead of the draft's own tokens.

    Named "draft": its rounds are the draft model's rounds in every cost they record. Every draft step goes through
    ``pick`` (``propose`` and the batch engine's ``propose_together`` alike), and the token it picks is the one at the
    position the draft model's cache has just reached: no state of its own.
    """

    def __init__(self, lm: LoadedModel, proposals: torch.Tensor, sequence: ModelSequence | None = None) -> None:
        super().__init__(lm, SamplingParams(), None, sequence)
        self.proposals = proposals.to(lm.device)  # [t_max] on the model's device: fed back without a copy

    def usable_k(self, context: torch.Tensor, k: int) -> int:
        return min(super().usable_k(context, k), self.proposals.shape[0] - context.shape[0])

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The set proposal at the position after the draft's cache; the draft's own argmax is paid for and
        dropped.  # logits: [1, vocab] -> [1]"""
        logits.argmax(dim=-1)  # what the draft model drafter's pick costs
        position = self.seq.length  # the draft has just read every token before this one
        return self.proposals[position : position + 1], None


def verified_acceptance(rounds: list[RoundRecord]) -> tuple[int, int]:
    """(accepted, verified) positions over ``rounds``, by the prefix rule: α = accepted / verified."""
    tally = PositionTally()
    for r in rounds:
        tally.add(r.num_drafted, r.num_accepted)
    return tally.num_accepted, sum(tally.verified)
