"""One model's KV cache for one sequence: run tokens through it, and roll it back after a rejection.

Rollback truncates the cache to the accepted length; the accepted prefix is never recomputed. Every runner
implements the same interface (``ModelSequence``): a sequence is a slot of a ``decoder.runners.KVPool``, whose
forward pass the runner names (decoder/runners: native, lean, invariant, transformers' own).
"""

from __future__ import annotations

from typing import Protocol

import torch

from decoder.models import LoadedModel
from decoder.runners.pool import KVPool


class ModelSequence(Protocol):
    lm: LoadedModel

    @property
    def length(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...

    def cached_keys(self) -> list[torch.Tensor]: ...


def open_sequence(lm: LoadedModel) -> ModelSequence:
    """A cache for one sequence of ``lm``: a pool of one slot, run by the pass ``lm.runner`` names (it grows as the
    sequence does). Raises ``decoder.runners.PassNotApplicable`` (a ValueError) when that pass cannot run ``lm``."""
    return KVPool(lm, num_slots=1).open()
