"""A lean forward pass for Llama-family models over preallocated KV caches (the gpt-fast approach).

It reuses the model's own modules (embeddings, rotary embedding, projections, norms, MLP, head) and
replaces only the per-call machinery around them: transformers' wrappers, mask construction and the
concatenating cache. Rollback is a length change: nothing is copied.

``LlamaKVPool`` holds the caches of many sequences ("slots") in one tensor and runs one forward pass over
several of them at once, each appending its own number of tokens at its own position (ragged): that is
what continuous batching with ragged acceptance needs. ``open_llama_sequence`` opens a pool of one slot. A pass over
one sequence computes what transformers' sdpa forward computes (in float64, to its rounding, tested; a float32
model on a CPU computes its LM head with oneDNN, ``OutputHead``, which differs from transformers' in the last bits).

Only plain ``LlamaForCausalLM`` models take this path (no sliding window, no tensor-parallel split);
everything else runs through transformers (decoder.kv_cache.CachedSequence).

Shape comments, one notation across decoder/: ``b`` sequences in a pass, ``n`` one sequence's new tokens, ``w``
the widest row of a ragged pass (the others padded), ``r`` its real tokens, ``end`` the positions attended to,
``heads``/``kv``/``d`` the query heads, key-value heads and head size; ``t`` is a context's length (prompt plus
emitted) and ``K`` a round's draft length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from decoder.llama_invariant import forward_invariant
from decoder.models import LoadedModel
from decoder.native.llama import CacheBinding, NativeLlama

INITIAL_CAPACITY = 256  # tokens; a pool doubles its capacity when a forward needs more


def supports_fast_path(model: Any) -> bool:
    config = model.config
    return (
        type(model).__name__ == "LlamaForCausalLM"
        and getattr(config, "pretraining_tp", 1) == 1
        and not getattr(config, "sliding_window", None)
        and all(type(layer.self_attn).__name__ == "LlamaAttention" for layer in model.model.layers)
    )


class OutputHead:
    """The LM head. For a float32 model on a CPU with oneDNN, its weights prepacked for oneDNN (a copy made once):
    the head is the largest single matrix of a small model (8,192 x 384 for the shipped target, a quarter of its
    weights), and plain ``F.linear`` streams it at about 13 GB/s on the development machine against 31 GB/s for
    oneDNN (1 row: 932 -> 401 us; 5 rows, a K=4 verify: 2,030 -> 786 us). Elsewhere (float64, bf16, GPUs) it is the
    model's own module. Neither kernel is batch-invariant (a row's logits depend on how many rows a pass has, in the
    last bits), so exactness is judged on tokens, as before."""

    def __init__(self, lm_head: torch.nn.Module) -> None:
        self.module = lm_head
        weight = getattr(lm_head, "weight", None)
        self._packed: torch.Tensor | None = None
        if (
            isinstance(lm_head, torch.nn.Linear)
            and lm_head.bias is None
            and weight is not None
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
        ):
            self._packed = weight.detach().to_mkldnn()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """# hidden: [..., hidden] -> [..., vocab]"""
        if self._packed is None:
            return self.module(hidden)
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [r, hidden]
        logits = torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self._packed, None).to_dense()  # [r, vocab]
        return logits.view(*hidden.shape[:-1], logits.shape[-1])


class LlamaKVPool:
    """The KV caches of up to ``num_slots`` sequences of one Llama model, and a ragged batched forward."""

    def __init__(self, lm: LoadedModel, num_slots: int, capacity: int = INITIAL_CAPACITY) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if not supports_fast_path(lm.model):
            kind = type(lm.model).__name__
            raise ValueError(f"{lm.name}: the batched runner supports plain Llama models, not {kind}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        config = lm.model.config
        self.lm = lm
        why: list[str] = []
        self.native = NativeLlama.create(lm.model, why) if lm.runner in ("auto", "native") else None
        if lm.runner == "native" and self.native is None:
            raise ValueError(f"{lm.name}: the native runner does not apply: {why[0]}")
        self.invariant = lm.runner == "invariant"  # decoder/llama_invariant.py
        self._head = OutputHead(lm.model.lm_head) if self.native is None and not self.invariant else None
        self._rope = apply_rotary_pos_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = len(lm.model.model.layers)
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._keys = self._allocate(capacity)
        self._values = self._allocate(capacity)
        self._binding: CacheBinding | None = None  # the native pass's view of this pool's cache

    @property
    def forward_pass(self) -> str:
        """Which pass runs: "native", "invariant" or "lean"."""
        return "native" if self.native is not None else "invariant" if self.invariant else "lean"

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

    # -- storage -------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return int(self._keys.shape[3])

    def _allocate(self, capacity: int) -> torch.Tensor:
        # [layers, slots, kv_heads, capacity, head_dim]
        weight = self.lm.model.model.layers[0].self_attn.k_proj.weight
        shape = (self.num_layers, self.num_slots, self.num_kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = max(INITIAL_CAPACITY, self.capacity)
        while new_capacity < needed:
            new_capacity *= 2
        keep = max(self.lengths)
        keys, values = self._allocate(new_capacity), self._allocate(new_capacity)
        keys[:, :, :, :keep] = self._keys[:, :, :, :keep]
        values[:, :, :, :keep] = self._values[:, :, :, :keep]
        self._keys, self._values = keys, values

    # -- forward -------------------------------------------------------------------------------------------

    def forward_many(
        self, rows: Sequence[tuple[PooledSequence, torch.Tensor]], logits_to_keep: int = 0
    ) -> list[torch.Tensor]:
        """Append each row's tokens to its sequence in one pass; return each row's next-token logits.

        # rows[i]: (sequence, input_ids [n_i] int64)  ->  [n_i, vocab] each, or [min(n_i, logits_to_keep), vocab]
        """
        assert rows, "forward_many() with no rows"
        slots = [seq.slot for seq, _ in rows]
        assert len(set(slots)) == len(slots), "a sequence appears twice in one forward"
        for seq, ids in rows:
            assert seq.pool is self and ids.dim() == 1 and ids.numel() > 0, tuple(ids.shape)
        starts = [self.lengths[s] for s in slots]
        counts = [int(ids.shape[0]) for _, ids in rows]
        self._reserve(max(s + n for s, n in zip(starts, counts, strict=True)))
        if self.native is not None:
            outputs = self._forward_native(slots, [ids for _, ids in rows], starts, counts, logits_to_keep)
        elif self.invariant:
            outputs = forward_invariant(self, slots, [ids for _, ids in rows], starts, counts, logits_to_keep)
        else:
            outputs = self._forward_torch(slots, [ids for _, ids in rows], starts, counts, logits_to_keep)
        for slot, start, n in zip(slots, starts, counts, strict=True):
            self.lengths[slot] = start + n
        return outputs

    def _forward_native(
        self, slots: list[int], inputs: list[torch.Tensor], starts: list[int], counts: list[int], logits_to_keep: int
    ) -> list[torch.Tensor]:
        """Every row's tokens in one native pass (decoder/native): batch-invariant, each token's logits the same
        whatever else is in the pass."""
        assert self.native is not None
        if self._binding is None or self._binding.keys is not self._keys:
            self._binding = self.native.bind_cache(self._keys, self._values)
        kept = [min(n, logits_to_keep) if logits_to_keep else n for n in counts]
        tokens = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        if tokens.dtype != torch.long or not tokens.is_contiguous():
            tokens = tokens.to(torch.long).contiguous()
        rows = list(zip(slots, starts, counts, kept, strict=True))
        logits = self.native.forward(self._binding, rows, tokens, torch.get_num_threads())  # [sum(kept), vocab]
        return [logits] if len(rows) == 1 else list(logits.split(kept))

    @torch.inference_mode()
    def _forward_torch(
        self, slots: list[int], inputs: list[torch.Tensor], starts: list[int], counts: list[int], logits_to_keep: int
    ) -> list[torch.Tensor]:
        if len(slots) == 1:
            return [self._forward_one(slots[0], inputs[0], starts[0], logits_to_keep)]
        return self._forward_ragged(slots, inputs, starts, counts, logits_to_keep)

    def _forward_one(self, slot: int, input_ids: torch.Tensor, start: int, logits_to_keep: int) -> torch.Tensor:
        """One sequence: the masks transformers would use, so the logits are bit-identical to its forward."""
        model = self.lm.model.model
        n = input_ids.shape[0]
        end = start + n
        x = model.embed_tokens(input_ids.to(self.lm.device, non_blocking=True)).unsqueeze(0)  # [1, n, hidden]
        positions = torch.arange(start, end, device=x.device).unsqueeze(0)  # [1, n]
        cos, sin = model.rotary_emb(x, positions)
        # New tokens see the whole cache and, among themselves, what precedes them. On an empty cache that is
        # plain causal attention (no O(n^2) mask for a long prompt); SDPA's is_causal aligns top-left, so it
        # is right only there.
        causal = n > 1 and start == 0
        mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(start) if n > 1 and not causal else None
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)  # [1, heads, n, d]
            k = attn.k_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, kv, n, d]
            v = attn.v_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            self._keys[i, slot, :, start:end] = k[0]
            self._values[i, slot, :, start:end] = v[0]
            o = F.scaled_dot_product_attention(
                q,
                self._keys[i, slot : slot + 1, :, :end],
                self._values[i, slot : slot + 1, :, :end],
                attn_mask=mask,
                is_causal=causal,
                scale=attn.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # [1, heads, n, d]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # the head only where logits are wanted (a prefill needs one row)
        assert self._head is not None
        return self._head(model.norm(x))[0]  # [n or logits_to_keep, vocab]

    def _forward_ragged(
        self, slots: list[int], inputs: list[torch.Tensor], starts: list[int], counts: list[int], logits_to_keep: int
    ) -> list[torch.Tensor]:
        """Several sequences, padded to the longest row; padding is neither cached nor returned."""
        model = self.lm.model.model
        device = self.lm.device
        b, width = len(slots), max(counts)
        ids = torch.zeros(b, width, dtype=torch.long)  # [b, w], padded with token 0
        for row, tokens in enumerate(inputs):
            ids[row, : counts[row]] = tokens
        ids = ids.to(device)
        start = torch.tensor(starts, device=device)  # [b]
        offsets = torch.arange(width, device=device)  # [w]
        positions = start[:, None] + offsets[None, :]  # [b, w]
        real = offsets[None, :] < torch.tensor(counts, device=device)[:, None]  # [b, w] not padding
        row_of, col_of = real.nonzero(as_tuple=True)  # [r] each: the real (row, column) pairs
        slot_of = torch.tensor(slots, device=device)[row_of]  # [r]
        pos_of = positions[row_of, col_of]  # [r]
        end = max(s + n for s, n in zip(starts, counts, strict=True))
        slot_index = torch.tensor(slots, device=device)  # [b]
        # Query j of row r sees cached positions <= start_r + j: its own prefix and the tokens before it.
        mask = (torch.arange(end, device=device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [b, 1, w, end]
        x = model.embed_tokens(ids)  # [b, w, hidden]
        cos, sin = model.rotary_emb(x, positions)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, width, self.num_heads, self.head_dim).transpose(1, 2)  # [b, heads, w, d]
            k = attn.k_proj(h).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, kv, w, d]
            v = attn.v_proj(h).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            # Write only the real tokens: [t, kv, d] into (slot, :, position).
            self._keys[i][slot_of, :, pos_of] = k.transpose(1, 2)[row_of, col_of]
            self._values[i][slot_of, :, pos_of] = v.transpose(1, 2)[row_of, col_of]
            keys = self._keys[i, :, :, :end].index_select(0, slot_index)  # [b, kv, end, d]
            values = self._values[i, :, :, :end].index_select(0, slot_index)
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=self.num_kv_heads != self.num_heads
            )  # [b, heads, w, d]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, width, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logits_to_keep:  # the head only on each row's last real tokens
            kept = [min(n, logits_to_keep) for n in counts]
            first_kept = torch.tensor([n - k for n, k in zip(counts, kept, strict=True)], device=device)  # [b]
            row_of, col_of = ((offsets[None, :] >= first_kept[:, None]) & real).nonzero(as_tuple=True)
            counts = kept
        hidden = model.norm(x[row_of, col_of])  # [t, hidden]
        assert self._head is not None
        return list(self._head(hidden).split(counts))  # [n_i or logits_to_keep, vocab] each

    def cached_keys(self, slot: int) -> list[torch.Tensor]:
        """Per layer: the keys ``slot`` holds, [1, kv_heads, length, head_dim]."""
        length = self.lengths[slot]
        return [self._keys[i, slot : slot + 1, :, :length] for i in range(self.num_layers)]


class PooledSequence:
    """One sequence's view of a pool: the decoder.kv_cache.ModelSequence interface."""

    def __init__(self, pool: LlamaKVPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.lm = pool.lm

    @property
    def length(self) -> int:
        return self.pool.lengths[self.slot]

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``input_ids`` and return their next-token logits.

        # input_ids: [n] int64  ->  [n, vocab], or [logits_to_keep, vocab] when > 0
        """
        return self.pool.forward_many([(self, input_ids)], logits_to_keep)[0]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens; the rest is overwritten by later forwards."""
        assert 0 <= length <= self.length, f"cannot truncate a cache of {self.length} tokens to {length}"
        self.pool.lengths[self.slot] = length

    def cached_keys(self) -> list[torch.Tensor]:
        return self.pool.cached_keys(self.slot)


def open_llama_sequence(lm: LoadedModel) -> PooledSequence:
    """One sequence's cache for a Llama model: a pool of one slot that grows as the sequence does."""
    return LlamaKVPool(lm, num_slots=1).open()
