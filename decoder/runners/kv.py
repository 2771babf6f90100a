"""The Llama passes' KV storage (native, lean, invariant): every slot's keys and values in two preallocated tensors.

Public on purpose: the passes read and write ``keys`` and ``values`` directly (a slot's positions ``0..length``),
and the native kernel binds to them by address. Rollback is the pool's length change: nothing here is copied then;
only growth copies (``reserve``, doubling).

Shapes (the notation of ``decoder/__init__.py``): ``[layers, slots, kv, capacity, d]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decoder.runners.base import KVStore, PassNotApplicable

INITIAL_CAPACITY = 256  # tokens; a store doubles its capacity when a forward needs more


def why_not_plain_llama(model: Any) -> str:
    """Why the Llama passes cannot run ``model``; empty when they can (a plain ``LlamaForCausalLM``: no sliding
    window, no tensor-parallel split)."""
    config = model.config
    if type(model).__name__ != "LlamaForCausalLM":
        return f"{type(model).__name__} is not a plain Llama model (LlamaForCausalLM)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"a tensor-parallel split (pretraining_tp {config.pretraining_tp})"
    if getattr(config, "sliding_window", None):
        return f"sliding-window attention ({config.sliding_window})"
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers}
    if kinds != {"LlamaAttention"}:
        return f"attention modules {sorted(kinds)}, not LlamaAttention"
    return ""


@dataclass(frozen=True)
class LlamaShape:
    """The sizes a Llama pass and its storage are laid out by."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> LlamaShape:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(len(model.model.layers), heads, config.num_key_value_heads, head_dim)


def grown_capacity(capacity: int, needed: int, floor: int = INITIAL_CAPACITY) -> int:
    """What a buffer of ``capacity`` positions grows to for ``needed``: doubled, from ``floor`` at least, until it
    holds them (a sequence that grows one token at a time copies its buffer O(log length) times)."""
    capacity = max(floor, capacity)
    while capacity < needed:
        capacity *= 2
    return capacity


class SlotTensors:
    """Keys and values of ``num_slots`` sequences: ``keys[layer, slot, :, position]`` is one token's key."""

    def __init__(self, model: Any, num_slots: int, capacity: int) -> None:
        weight = model.model.layers[0].self_attn.k_proj.weight
        self.shape = LlamaShape.of(model)
        self.num_slots = num_slots
        self.dtype, self.device = weight.dtype, weight.device
        self.keys = self._allocate(capacity)  # [layers, slots, kv, capacity, d]
        self.values = self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def _allocate(self, capacity: int) -> torch.Tensor:
        s = self.shape
        shape = (s.layers, self.num_slots, s.kv_heads, capacity, s.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def reserve(self, needed: int, lengths: Sequence[int]) -> None:
        """Room for ``needed`` positions; the first ``lengths[slot]`` of every slot are copied when it grows."""
        if needed <= self.capacity:
            return
        keep = max(lengths)
        new_capacity = grown_capacity(self.capacity, needed)
        keys, values = self._allocate(new_capacity), self._allocate(new_capacity)
        keys[:, :, :, :keep] = self.keys[:, :, :, :keep]
        values[:, :, :, :keep] = self.values[:, :, :, :keep]
        self.keys, self.values = keys, values

    def cached_keys(self, slot: int, length: int) -> list[torch.Tensor]:
        """Per layer: the keys ``slot`` holds, [1, kv_heads, length, head_dim]."""
        return [self.keys[i, slot : slot + 1, :, :length] for i in range(self.shape.layers)]

    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Entry ``start + rows[j]`` of ``slot`` to ``start + j``, in every layer (a gathered copy: no overlap)."""
        source = torch.tensor(rows, device=self.device) + start
        for tensor in (self.keys, self.values):
            tensor[:, slot, :, start : start + len(rows)] = tensor[:, slot, :, source]


class LlamaTensorPass:
    """What the two PyTorch Llama passes (lean, invariant) share: the model's shape, transformers' rotary function,
    the applicability check, the dtype they report and their slot store. Subclasses set ``name`` and ``forward``."""

    name: str

    def __init__(self, model: Any, device: Any) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model, self.device = model, device
        self.shape = LlamaShape.of(model)
        self.rope = apply_rotary_pos_emb

    @classmethod
    def create(cls, model: Any, device: Any) -> Any:
        reason = why_not_plain_llama(model)
        if reason:
            raise PassNotApplicable(f"the {cls.name} pass does not apply: {reason}")
        return cls(model, device)

    @property
    def dtype_name(self) -> str:
        return str(self.model.lm_head.weight.dtype).removeprefix("torch.")

    kernel = "torch"
    trees = False  # a pass that verifies draft trees says so (decoder/runners/base.py ForwardPass.trees)
    features = False  # a pass that fills a feature tap says so (ForwardPass.features)

    def new_store(self, num_slots: int, capacity: int) -> SlotTensors:
        return SlotTensors(self.model, num_slots, capacity)

    def capture_all(self, store: KVStore) -> int:
        return 0  # eager: nothing to capture (the graphs pass overrides it)
