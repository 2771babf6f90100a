"""One model's KV cache for one sequence: run tokens through it, and roll it back after a rejection.

Rollback truncates the cache to the accepted length; the accepted prefix is never recomputed. Two runners
implement the same interface: ``CachedSequence`` (transformers' own forward and DynamicCache, any causal
LM) and ``decoder.llama_fast.open_llama_sequence`` (a lean Llama forward over preallocated tensors).
In transformers 5, ``Cache.crop(n)`` takes a *negative* count of tokens to remove (a positive
argument, the v4 "final length" meaning, raises), so rollback goes through ``truncate`` here only.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from decoder.models import LoadedModel


class ModelSequence(Protocol):
    lm: LoadedModel

    @property
    def length(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...

    def cached_keys(self) -> list[torch.Tensor]: ...


def open_sequence(lm: LoadedModel) -> ModelSequence:
    """A cache for one sequence of ``lm``: the Llama pool where it applies (runners "auto", "native", "lean")."""
    from decoder.llama_fast import open_llama_sequence, supports_fast_path

    if lm.runner != "transformers" and supports_fast_path(lm.model):
        return open_llama_sequence(lm)
    if lm.runner == "invariant":
        raise ValueError(f"{lm.name}: the invariant runner supports plain Llama models, not {type(lm.model).__name__}")
    return CachedSequence(lm)


class CachedSequence:
    """A model plus the KV cache of the tokens it has seen so far."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        # No config: plain full-attention layers, which `crop` restores exactly.
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``input_ids`` to the cache and return their next-token logits.

        # input_ids: [n] int64 (any device)  ->  [n, vocab], or [logits_to_keep, vocab] when > 0
        """
        assert input_ids.dim() == 1 and input_ids.numel() > 0, tuple(input_ids.shape)
        out = self.lm.model(
            input_ids=input_ids.to(self.lm.device, non_blocking=True).unsqueeze(0),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits[0]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and drop the rest."""
        excess = self.length - length
        assert excess >= 0, f"cannot truncate a cache of {self.length} tokens to {length}"
        if excess:
            self.cache.crop(-excess)

    def cached_keys(self) -> list[torch.Tensor]:
        """Per layer: the keys held, [1, kv_heads, length, head_dim]."""
        return [layer.keys for layer in self.cache.layers]  # type: ignore[union-attr,misc]
