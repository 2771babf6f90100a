"""How well a draft matches its target on held-out text: greedy α at K = 4, KL, and top-1 agreement."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from decoder.models import LoadedModel, from_objects
from distill.config import EVAL_K, EVAL_PROMPT_TOKENS, MAX_EVAL_BLOCKS
from distill.loss import forward_kl, top1_agreement

if TYPE_CHECKING:
    from decoder.engine import SpeculativeDecoder

EVAL_BATCH = 8  # held-out blocks per forward pass


@dataclass(frozen=True)
class HeldOut:
    """What the draft is judged on, cut once from the held-out token stream."""

    prompts: list[list[int]]  # α: the target greedily continues each; the draft proposes K = 4 per round
    blocks: torch.Tensor  # [num_blocks, n] KL and top-1 agreement over every position


@dataclass(frozen=True)
class Evaluation:
    alpha: float  # greedy acceptance rate at K = EVAL_K, pooled over all rounds of all prompts
    kl: float  # mean KL(p_target ‖ q_draft) per token at temperature 1, nats
    agreement: float  # share of tokens where the draft's argmax is the target's

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Evaluation:
        return cls(alpha=float(values["alpha"]), kl=float(values["kl"]), agreement=float(values["agreement"]))

    def describe(self) -> str:
        return (
            f"α {self.alpha:.3f} (greedy, K={EVAL_K}), KL {self.kl:.3f} nats/token, "
            f"top-1 agreement {self.agreement:.3f}"
        )


def held_out(stream: torch.Tensor, num_prompts: int, block_len: int) -> HeldOut:
    """``num_prompts`` prompts and up to MAX_EVAL_BLOCKS blocks, evenly spread over the held-out stream.

    # stream: [num_tokens] int64
    """
    assert stream.dim() == 1 and stream.numel() >= 2, tuple(stream.shape)
    prompt_len = min(EVAL_PROMPT_TOKENS, stream.numel())
    starts = torch.linspace(0, stream.numel() - prompt_len, num_prompts).round().long().tolist()
    prompts = [stream[s : s + prompt_len].tolist() for s in starts]
    block_len = min(block_len, stream.numel())
    available = stream.numel() // block_len
    picks = torch.linspace(0, available - 1, min(MAX_EVAL_BLOCKS, available)).round().long()  # [num_blocks]
    blocks = torch.stack([stream[i * block_len : (i + 1) * block_len] for i in picks.tolist()])
    return HeldOut(prompts, blocks)


def evaluate(target: LoadedModel, draft_model: Any, data: HeldOut, eval_tokens: int) -> Evaluation:
    """Judge ``draft_model`` (left in eval mode) against the target on ``data``."""
    from decoder.native.llama import forget

    forget(draft_model)  # trained in place since any earlier evaluation: no packed copy of old weights
    draft = from_objects(draft_model, target.tokenizer, "draft")
    from decoder.engine import SpeculativeDecoder

    kl, agreement = logit_match(target.model, draft.model, data.blocks)
    alpha = greedy_alpha(SpeculativeDecoder(target, draft), "draft", data.prompts, eval_tokens)
    return Evaluation(alpha=alpha, kl=kl, agreement=agreement)


def greedy_alpha(decoder: SpeculativeDecoder, drafter: str, prompts: list[list[int]], eval_tokens: int) -> float:
    """Accepted / proposed over greedy speculative decoding of every prompt by ``drafter`` at K = EVAL_K (pooled, not
    a mean of ratios)."""
    from decoder.request_stop import StopConditions
    from decoder.sampling import SamplingParams

    accepted = proposed = 0
    for prompt_ids in prompts:
        stats = decoder.generate(prompt_ids, drafter, EVAL_K, SamplingParams(), StopConditions(eval_tokens)).stats
        accepted, proposed = accepted + stats.num_accepted, proposed + stats.num_drafted
    return accepted / proposed if proposed else 0.0


@torch.no_grad()
def logit_match(target_model: Any, draft_model: Any, blocks: torch.Tensor) -> tuple[float, float]:
    """Mean per-token KL(p ‖ q) at temperature 1 and top-1 agreement over ``blocks``.

    # blocks: [num_blocks, n] int64
    """
    kl_sum = agree_sum = 0.0
    for batch in blocks.split(EVAL_BATCH):
        batch = batch.to(next(draft_model.parameters()).device)
        target_logits = target_model(input_ids=batch, use_cache=False).logits  # [b, n, vocab]
        draft_logits = draft_model(input_ids=batch, use_cache=False).logits  # [b, n, vocab]
        kl_sum += float(forward_kl(draft_logits, target_logits)) * len(batch)
        agree_sum += float(top1_agreement(draft_logits.float(), target_logits.float())) * len(batch)
    return kl_sum / len(blocks), agree_sum / len(blocks)
