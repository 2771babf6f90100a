"""transformers' own pass (runner ``transformers``): the model's forward and its ``DynamicCache``, one per slot, for
any causal LM. It is what ``auto`` runs where no Llama pass applies, and the reference the other passes are tested
against.

A row runs as its own call (no padding, so a row's logits are what a single-sequence forward gives, whatever else
is in the pass). A rollback reaches the cache lazily: the pool lowers the slot's length, and the next forward of the
slot crops the cache to it. In transformers 5, ``Cache.crop(n)`` takes a *negative* count of tokens to remove (a
positive argument, the v4 "final length" meaning, raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from decoder.runners.base import KVStore, RaggedRows


class SlotCaches:
    """One ``DynamicCache`` per slot."""

    def __init__(self, num_slots: int) -> None:
        # No config: plain full-attention layers, which `crop` restores exactly.
        self.caches = [DynamicCache() for _ in range(num_slots)]

    def reserve(self, needed: int, lengths: Sequence[int]) -> None:
        """Nothing to do: a DynamicCache grows as it is fed."""

    def at(self, slot: int, length: int) -> DynamicCache:
        """The cache of ``slot`` holding its first ``length`` tokens (a fresh one for a sequence that starts)."""
        if length == 0:
            self.caches[slot] = DynamicCache()
        cache = self.caches[slot]
        excess = int(cache.get_seq_length()) - length
        assert excess >= 0, f"slot {slot} holds {cache.get_seq_length()} tokens, fewer than its length {length}"
        if excess:
            cache.crop(-excess)
        return cache

    def cached_keys(self, slot: int, length: int) -> list[torch.Tensor]:
        """Per layer: the keys held, [1, kv_heads, length, head_dim]."""
        return [layer.keys[:, :, :length] for layer in self.caches[slot].layers]  # type: ignore[union-attr,index]

    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Entry ``start + rows[j]`` to ``start + j`` in every layer; the next ``at`` crops what follows."""
        for layer in self.caches[slot].layers:
            source = torch.tensor(rows, device=layer.keys.device) + start  # type: ignore[union-attr]
            for tensor in (layer.keys, layer.values):  # type: ignore[union-attr]  # [1, kv_heads, length, head_dim]
                tensor[:, :, start : start + len(rows)] = tensor[:, :, source]  # type: ignore[index]


class TransformersPass:
    """``model(input_ids, past_key_values=...)`` per row: any causal LM, any dtype, any device."""

    name = "transformers"

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device

    @property
    def dtype_name(self) -> str:
        return str(self.model.get_output_embeddings().weight.dtype).removeprefix("torch.")

    kernel = "torch"
    trees = True
    features = True  # transformers' hidden_states: entry j is the states entering layer j

    def new_store(self, num_slots: int, capacity: int) -> SlotCaches:
        return SlotCaches(num_slots)

    def capture_all(self, store: KVStore) -> int:
        return 0  # eager, any shape: nothing to capture

    @torch.inference_mode()
    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        assert isinstance(store, SlotCaches)
        logits, states = [], []
        for row, (slot, input_ids, start) in enumerate(zip(rows.slots, rows.inputs, rows.starts, strict=True)):
            tree = rows.tree(row)
            shape = {} if tree is None else {  # the tree's own mask and positions (decoder/tree.py)
                "attention_mask": tree.visible(start, self.device)[None, None],
                "position_ids": tree.positions(start, self.device)[None],
            }  # fmt: skip
            out = self.model(
                input_ids=input_ids.to(self.device, non_blocking=True).unsqueeze(0),
                past_key_values=store.at(slot, start),
                use_cache=True,
                logits_to_keep=logits_to_keep,
                output_hidden_states=rows.tap is not None,
                **shape,
            )
            logits.append(out.logits[0])  # [n or logits_to_keep, vocab]
            if rows.tap is not None:  # [n, layers * hidden]
                states.append(torch.cat([out.hidden_states[layer][0] for layer in rows.tap.layers], dim=-1))
        if rows.tap is not None:
            rows.tap.fill(states)
        return logits
