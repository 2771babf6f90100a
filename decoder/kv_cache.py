"""One model's KV cache for one sequence: run tokens through it, and roll it back after a rejection.

Rollback truncates the cache to the accepted length; the accepted prefix is never recomputed. Every runner
implements the same interface (``ModelSequence``): a sequence is a slot of a ``decoder.runners.KVPool``, whose
forward pass the runner names (decoder/runners: native, lean, invariant, graphs, transformers' own).

``open_sequence`` makes a new one-slot pool each call; ``SparePools`` keeps such pools from one request to the next
(what ``SpeculativeDecoder`` decodes in): a pool is not free to make everywhere (the graphs pass allocates its whole
capacity and, on a GPU, captures one CUDA graph per bucket it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from decoder.models import LoadedModel
from decoder.runners.base import FeatureTap
from decoder.runners.pool import KVPool, PooledSequence
from decoder.tree import DraftTree


class ModelSequence(Protocol):
    lm: LoadedModel

    @property
    def length(self) -> int: ...

    @property
    def verifies_trees(self) -> bool: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        logits_to_keep: int = 0,
        tree: DraftTree | None = None,
        tap: FeatureTap | None = None,
    ) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...

    def keep_path(self, root_entry: int, rows: Sequence[int]) -> None: ...

    def cached_keys(self) -> list[torch.Tensor]: ...


def open_sequence(lm: LoadedModel) -> ModelSequence:
    """A cache for one sequence of ``lm``: a pool of one slot, run by the pass ``lm.runner`` names (it grows as the
    sequence does). Raises ``decoder.runners.PassNotApplicable`` (a ValueError) when that pass cannot run ``lm``."""
    return KVPool(lm, num_slots=1).open()


class SparePools:
    """One-slot pools of one model kept from one request to the next: ``open`` lends a spare pool's slot (a new
    pool's when every spare is lent), ``release`` takes it back for the next request. A sequence never released is
    never reused (it goes with its pool)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._spare: list[KVPool] = []

    def open(self) -> PooledSequence:
        """An empty sequence of ``lm``, in a spare pool if there is one."""
        try:
            pool = self._spare.pop()
        except IndexError:
            pool = KVPool(self.lm, num_slots=1)
        return pool.open()

    def release(self, seq: ModelSequence) -> None:
        """Give ``seq``'s slot back (its pool becomes a spare); ``seq`` must not be used again."""
        assert isinstance(seq, PooledSequence) and seq.lm is self.lm, "a sequence these pools did not lend"
        seq.pool.release(seq)
        self._spare.append(seq.pool)

    def capture_all(self) -> int:
        """Capture every step shape of a spare pool before serving (``KVPool.capture_all``); the number captured."""
        seq = self.open()
        try:
            return seq.pool.capture_all()
        finally:
            self.release(seq)
