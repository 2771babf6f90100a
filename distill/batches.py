"""What each step trains on: blocks of the data, or the target's own continuations of data prompts.

A batch is a pure function of (seed, step), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from distill.config import DistillConfig


class BatchSource:
    """Draws ``[b, n]`` token blocks (``b`` = batch_size, ``n`` = seq_len) from the packed train stream."""

    def __init__(self, stream: torch.Tensor, cfg: DistillConfig, target_model: Any, device: torch.device) -> None:
        # stream: [num_tokens] int64 on CPU
        assert stream.dim() == 1, tuple(stream.shape)
        self.stream = stream
        self.cfg = cfg
        self.target_model = target_model
        self.device = device

    def batch(self, step: int) -> tuple[torch.Tensor, bool]:
        """The ``[b, n]`` tokens of step ``step`` (on the device) and whether the target wrote them."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, step])
        self_generated = bool(rng.random() < cfg.self_generated)
        starts = rng.integers(0, self.stream.numel() - cfg.seq_len + 1, size=cfg.batch_size)
        blocks = torch.stack([self.stream[s : s + cfg.seq_len] for s in starts.tolist()]).to(self.device)
        if not self_generated:
            return blocks, False
        prompt_len = max(1, cfg.seq_len // 4)
        generator = torch.Generator(device=self.device).manual_seed(int(rng.integers(2**62)))
        continued = continue_with_target(
            self.target_model, blocks[:, :prompt_len], cfg.seq_len - prompt_len, cfg.generation_temperature, generator
        )
        return continued, True


@torch.no_grad()
def continue_with_target(
    model: Any, prompts: torch.Tensor, new_tokens: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """Each prompt followed by ``new_tokens`` tokens the model samples (greedy at temperature 0).

    # prompts: [b, prompt_len] int64  ->  [b, prompt_len + new_tokens]
    All rows share one length, so no padding or attention mask is needed.
    """
    cache = DynamicCache()
    tokens = [prompts]
    logits = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    for i in range(new_tokens):
        next_token = _pick(logits.float(), temperature, generator)  # [b, 1]
        tokens.append(next_token)
        if i + 1 < new_tokens:
            logits = model(input_ids=next_token, past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.cat(tokens, dim=1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    # logits: [b, vocab]  ->  [b, 1]
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
