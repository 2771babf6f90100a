"""The native pass (runner ``native``): every row of a pass in one call into ``llama_step.c`` (decoder/native), over
the pool's ``SlotTensors``. Batch-invariant: each token's logits are the same bits whatever else is in the pass."""

from __future__ import annotations

from typing import Any

import torch

from decoder.native.llama import CacheBinding, NativeLlama
from decoder.runners.base import KVStore, PassNotApplicable, RaggedRows
from decoder.runners.kv import SlotTensors, why_not_plain_llama
from decoder.tree import ROOT


class NativePass:
    """A plain float32 Llama model's packed weights (``NativeLlama``, shared by every pass of the model) and the
    kernel's view of the store it last ran on."""

    name = "native"
    dtype_name = "float32"  # the kernel's arithmetic, whatever the panels hold (decoder/native/llama.py)
    trees = True  # a row may be a draft tree: its tokens' parents go to the kernel
    features = True  # the kernel copies the states entering the tapped layers

    def __init__(self, native: NativeLlama, model: Any) -> None:
        self.native = native
        self.model = model
        self._binding: CacheBinding | None = None

    @property
    def kernel(self) -> str:
        """The build's instruction set for this model's products ("avx2", or "avx512bf16" for bfloat16 weights on
        a CPU with it): logits are the same bits within one, within bfloat16 rounding across them."""
        return self.native.isa

    @classmethod
    def create(cls, model: Any, device: torch.device) -> NativePass:
        """The pass, or ``PassNotApplicable`` naming the first thing the kernel does not cover."""
        reason = why_not_plain_llama(model) or (f"it runs on a CPU, not on {device}" if device.type != "cpu" else "")
        why: list[str] = []  # the kernel's own reason (dtype, sizes, no gcc or AVX2, SPECD_NATIVE=0)
        native = None if reason else NativeLlama.create(model, why)
        if native is None:
            raise PassNotApplicable(f"the native pass does not apply: {reason or why[0]}")
        return cls(native, model)

    def new_store(self, num_slots: int, capacity: int) -> SlotTensors:
        return SlotTensors(self.model, num_slots, capacity)

    def capture_all(self, store: KVStore) -> int:
        return 0  # one call into the kernel per pass: nothing to capture

    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        """Every row's tokens in one native pass."""
        assert isinstance(store, SlotTensors)
        if self._binding is None or self._binding.keys is not store.keys:  # a new store, or this one grew
            self._binding = self.native.bind_cache(store.keys, store.values)
        kept = rows.kept(logits_to_keep)
        inputs = rows.inputs
        tokens = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        if tokens.dtype != torch.long or not tokens.is_contiguous():
            tokens = tokens.to(torch.long).contiguous()
        spans = list(zip(rows.slots, rows.starts, rows.counts, kept, strict=True))
        parents = None if rows.trees is None else tree_parents(rows)
        tap = rows.tap
        logits, states = self.native.forward(
            self._binding, spans, tokens, torch.get_num_threads(), parents, tap.layers if tap is not None else ()
        )  # [sum(kept), vocab], [sum(count), layers * hidden] | None
        if tap is not None and states is not None:
            tap.fill(list(states.split(rows.counts)))
        return [logits] if len(spans) == 1 else list(logits.split(kept))


def tree_parents(rows: RaggedRows) -> list[int]:
    """Each token's parent within its row, as the kernel takes them: -1 for a row's first token (the root), i - 1
    along a chain, a draft tree's node i (the row's token i + 1) below its parent's token."""
    parents: list[int] = []
    for row, n in enumerate(rows.counts):
        tree = rows.tree(row)
        parents += [ROOT, *(range(n - 1) if tree is None else (parent + 1 for parent in tree.parents))]
    return parents
