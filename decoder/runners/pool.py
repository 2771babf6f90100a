"""The KV pool: the slots of many sequences of one model, each slot's length, and the forward pass that runs them.

``KVPool`` asks ``select_pass`` once for the model's pass (the runner setting is read there and nowhere else) and
keeps the pass's storage. ``forward_many`` runs one pass over several sequences at once, each appending its own
number of tokens at its own position (ragged): that is what continuous batching with ragged acceptance needs. A
rollback is a length change (``PooledSequence.truncate``): nothing is copied, and later forwards overwrite the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from decoder.models import LoadedModel
from decoder.runners.base import FeatureTap, ForwardPass, KVStore, PassNotApplicable, RaggedRows
from decoder.runners.kv import INITIAL_CAPACITY
from decoder.runners.select import select_pass
from decoder.tree import DraftTree


class TreesNotVerified(PassNotApplicable):
    """Rows with draft trees were given to a pass that runs chains only; the message names the pass."""


class FeaturesNotTapped(PassNotApplicable):
    """Hidden states were asked of a pass that hands logits only; the message names the pass."""


class KVPool:
    """The KV caches of up to ``num_slots`` sequences of one model, and a ragged batched forward."""

    def __init__(self, lm: LoadedModel, num_slots: int, capacity: int = INITIAL_CAPACITY) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        try:
            self.forward_pass: ForwardPass = select_pass(lm.model, lm.runner, lm.device)
        except PassNotApplicable as e:
            raise PassNotApplicable(f"{lm.name}: {e}") from None
        self.lm = lm
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.store: KVStore = self.forward_pass.new_store(num_slots, capacity)

    # -- slots ---------------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def open(self) -> PooledSequence:
        """A sequence in a free slot, with an empty cache."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return PooledSequence(self, slot)

    def release(self, seq: PooledSequence) -> None:
        assert seq.slot not in self._free, f"slot {seq.slot} released twice"
        self.lengths[seq.slot] = 0
        self._free.append(seq.slot)

    # -- forward -------------------------------------------------------------------------------------------

    def forward_many(
        self,
        rows: Sequence[tuple[PooledSequence, torch.Tensor]],
        logits_to_keep: int = 0,
        trees: Sequence[DraftTree | None] | None = None,
        tap: FeatureTap | None = None,
    ) -> list[torch.Tensor]:
        """Append each row's tokens to its sequence in one pass; return each row's next-token logits. ``trees``:
        per row, None for a chain, or the draft tree its tokens after the first are (a root and the tree's tokens:
        ``PooledSequence.keep_path`` then keeps the accepted path's entries). ``tap``: the pass also fills it with
        every token's hidden states (``FeatureTap``).

        # rows[i]: (sequence, input_ids [n_i] int64)  ->  [n_i, vocab] each, or [min(n_i, logits_to_keep), vocab]
        """
        assert rows, "forward_many() with no rows"
        slots = [seq.slot for seq, _ in rows]
        assert len(set(slots)) == len(slots), "a sequence appears twice in one forward"
        for seq, ids in rows:
            assert seq.pool is self and ids.dim() == 1 and ids.numel() > 0, tuple(ids.shape)
        starts = [self.lengths[s] for s in slots]
        counts = [int(ids.shape[0]) for _, ids in rows]
        if trees is not None and any(tree is not None for tree in trees):
            self._check_trees(trees, counts)
        else:
            trees = None
        if tap is not None:
            self.check_tap(tap)
        self.store.reserve(max(s + n for s, n in zip(starts, counts, strict=True)), self.lengths)
        inputs = [ids for _, ids in rows]
        ragged = RaggedRows(slots, inputs, starts, counts, None if trees is None else list(trees), tap)
        outputs = self.forward_pass.forward(self.store, ragged, logits_to_keep)
        for slot, start, n in zip(slots, starts, counts, strict=True):
            self.lengths[slot] = start + n
        return outputs

    def check_tap(self, tap: FeatureTap) -> None:
        """Refuse a tap this pool's pass cannot fill: a pass without features, a layer outside the model."""
        if not self.forward_pass.features:
            raise FeaturesNotTapped(f"{self.lm.name}: the {self.forward_pass.name} pass hands no hidden states")
        layers = self.lm.num_layers
        if not tap.layers or any(not 0 <= layer < layers for layer in tap.layers):
            raise ValueError(f"{self.lm.name}: feature layers {list(tap.layers)} outside 0..{layers - 1}")

    def _check_trees(self, trees: Sequence[DraftTree | None], counts: Sequence[int]) -> None:
        if not self.forward_pass.trees:
            raise TreesNotVerified(f"{self.lm.name}: the {self.forward_pass.name} pass does not verify draft trees")
        assert len(trees) == len(counts), f"{len(trees)} trees for {len(counts)} rows"
        for tree, n in zip(trees, counts, strict=True):
            assert tree is None or tree.size + 1 == n, f"a row of {n} tokens for a tree of {tree.size} nodes"

    def cached_keys(self, slot: int) -> list[torch.Tensor]:
        """Per layer: the keys ``slot`` holds, [1, kv_heads, length, head_dim]."""
        return self.store.cached_keys(slot, self.lengths[slot])

    def capture_all(self) -> int:
        """Capture every step shape this pool can run (the graphs pass on a GPU: one CUDA graph per bucket), so that
        no step captures while serving; the number captured now (0 on a CPU, and for a pass that captures nothing)."""
        return self.forward_pass.capture_all(self.store)


class PooledSequence:
    """One sequence's view of a pool: the decoder.kv_cache.ModelSequence interface."""

    def __init__(self, pool: KVPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.lm = pool.lm

    @property
    def length(self) -> int:
        return self.pool.lengths[self.slot]

    def forward(
        self,
        input_ids: torch.Tensor,
        logits_to_keep: int = 0,
        tree: DraftTree | None = None,
        tap: FeatureTap | None = None,
    ) -> torch.Tensor:
        """Append ``input_ids`` and return their next-token logits (``tree``: they are a root and its nodes;
        ``tap``: filled with their hidden states too).

        # input_ids: [n] int64  ->  [n, vocab], or [logits_to_keep, vocab] when > 0
        """
        return self.pool.forward_many([(self, input_ids)], logits_to_keep, None if tree is None else [tree], tap)[0]

    @property
    def verifies_trees(self) -> bool:
        """Whether this sequence's pass verifies draft trees (``forward``'s ``tree``)."""
        return self.pool.forward_pass.trees

    def keep_path(self, root_entry: int, rows: Sequence[int]) -> None:
        """After a tree verified from cache entry ``root_entry`` (the length before its pass): keep the rows of the
        accepted path (``DraftTree.kept_rows``) as the entries from ``root_entry`` on, and drop the rest."""
        assert rows and rows[0] == 0 and root_entry + rows[-1] < self.length, (root_entry, list(rows), self.length)
        assert all(a < b for a, b in itertools.pairwise(rows)), f"rows {list(rows)} are not ascending"
        self.pool.store.keep(self.slot, root_entry, rows)
        self.pool.lengths[self.slot] = root_entry + len(rows)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens; the rest is overwritten by later forwards."""
        assert 0 <= length <= self.length, f"cannot truncate a cache of {self.length} tokens to {length}"
        self.pool.lengths[self.slot] = length

    def cached_keys(self) -> list[torch.Tensor]:
        return self.pool.cached_keys(self.slot)
