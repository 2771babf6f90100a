"""The lean pass (runner ``lean``): a Llama forward over the pool's preallocated KV tensors (the gpt-fast approach).

It reuses the model's own modules (embeddings, rotary embedding, projections, norms, MLP, head) and
replaces only the per-call machinery around them: transformers' wrappers, mask construction and the
concatenating cache. Rollback is a length change: nothing is copied.

One pass runs several sequences at once, each appending its own number of tokens at its own position (ragged):
that is what continuous batching with ragged acceptance needs. A pass over one sequence computes what
transformers' sdpa forward computes (in float64, to its rounding, tested; a float32 model on a CPU computes its LM
head with oneDNN, ``OutputHead``, which differs from transformers' in the last bits).

Only plain ``LlamaForCausalLM`` models take this path (``decoder.runners.kv.why_not_plain_llama``); everything
else runs through transformers (decoder/runners/hf.py).

Shape comments use the one notation of ``decoder/__init__.py`` (``b`` rows, ``n_i`` a row's tokens, ``w`` the widest
row, ``r`` the real tokens, ``end`` the positions attended to).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from decoder.runners.base import FeatureTap, KVStore, RaggedRows
from decoder.runners.kv import LlamaTensorPass, SlotTensors
from decoder.tree import DraftTree


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


class LeanPass(LlamaTensorPass):
    """The lean PyTorch forward of a plain Llama model, over ``SlotTensors``."""

    name = "lean"
    trees = True
    features = True

    def __init__(self, model: Any, device: torch.device) -> None:
        super().__init__(model, device)
        self.num_heads, self.num_kv_heads, self.head_dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        self.head = OutputHead(model.lm_head)

    @torch.inference_mode()
    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        assert isinstance(store, SlotTensors)
        if len(rows.slots) == 1:
            slot, ids, start = rows.slots[0], rows.inputs[0], rows.starts[0]
            return [self._forward_one(store, slot, ids, start, logits_to_keep, rows.tree(0), rows.tap)]
        return self._forward_ragged(store, rows, logits_to_keep)

    def _forward_one(
        self,
        store: SlotTensors,
        slot: int,
        input_ids: torch.Tensor,
        start: int,
        logits_to_keep: int,
        tree: DraftTree | None = None,
        tap: FeatureTap | None = None,
    ) -> torch.Tensor:
        """One sequence: the masks transformers would use, so the logits are bit-identical to its forward."""
        model = self.model.model
        n = input_ids.shape[0]
        end = start + n
        x = model.embed_tokens(input_ids.to(self.device, non_blocking=True)).unsqueeze(0)  # [1, n, hidden]
        mask: torch.Tensor | None
        if tree is not None:  # each token at its depth, seeing the cache and its ancestors
            positions, mask, causal = tree.positions(start, x.device)[None], tree.visible(start, x.device), False
        else:
            positions = torch.arange(start, end, device=x.device).unsqueeze(0)  # [1, n]
            # New tokens see the whole cache and, among themselves, what precedes them. On an empty cache that is
            # plain causal attention (no O(n^2) mask for a long prompt); SDPA's is_causal aligns top-left, so it
            # is right only there.
            causal = n > 1 and start == 0
            mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(start) if n > 1 and not causal else None
        cos, sin = model.rotary_emb(x, positions)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.layers):
            tapped[i] = x[0]  # [n, hidden] the states entering layer i
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)  # [1, heads, n, d]
            k = attn.k_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, kv, n, d]
            v = attn.v_proj(h).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            store.keys[i, slot, :, start:end] = k[0]
            store.values[i, slot, :, start:end] = v[0]
            o = F.scaled_dot_product_attention(
                q,
                store.keys[i, slot : slot + 1, :, :end],
                store.values[i, slot : slot + 1, :, :end],
                attn_mask=mask,
                is_causal=causal,
                scale=attn.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # [1, heads, n, d]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if tap is not None:
            tap.fill([torch.cat([tapped[layer] for layer in tap.layers], dim=-1)])
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # the head only where logits are wanted (a prefill needs one row)
        return self.head(model.norm(x))[0]  # [n or logits_to_keep, vocab]

    def _forward_ragged(self, store: SlotTensors, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        """Several sequences, padded to the longest row; padding is neither cached nor returned."""
        model = self.model.model
        device = self.device
        slots, starts, counts = rows.slots, rows.starts, rows.counts
        b, width = len(slots), max(counts)
        ids = torch.zeros(b, width, dtype=torch.long)  # [b, w], padded with token 0
        for row, tokens in enumerate(rows.inputs):
            ids[row, : counts[row]] = tokens
        ids = ids.to(device)
        start = torch.tensor(starts, device=device)  # [b]
        offsets = torch.arange(width, device=device)  # [w]
        entries = start[:, None] + offsets[None, :]  # [b, w] each token's cache entry
        real = offsets[None, :] < torch.tensor(counts, device=device)[:, None]  # [b, w] not padding
        row_of, col_of = real.nonzero(as_tuple=True)  # [r] each: the real (row, column) pairs
        slot_of = torch.tensor(slots, device=device)[row_of]  # [r]
        entry_of = entries[row_of, col_of]  # [r]
        end = max(s + n for s, n in zip(starts, counts, strict=True))
        slot_index = torch.tensor(slots, device=device)  # [b]
        # Query j of row r sees cache entries <= start_r + j: its own prefix and the tokens before it.
        mask = (torch.arange(end, device=device)[None, None, :] <= entries[:, :, None]).unsqueeze(1)  # [b, 1, w, end]
        positions = entries.clone()  # [b, w] a chain's token sits at its entry
        for row in range(b):
            tree = rows.tree(row)
            if tree is not None:  # a tree's rows: positions by depth, the cache and their ancestors only
                n, first = counts[row], starts[row]
                positions[row, :n] = tree.positions(first, device)
                mask[row, 0, :n, first : first + n] = tree.attention_mask(device)
        x = model.embed_tokens(ids)  # [b, w, hidden]
        cos, sin = model.rotary_emb(x, positions)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.layers):
            tapped[i] = x  # [b, w, hidden] the states entering layer i
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, width, self.num_heads, self.head_dim).transpose(1, 2)  # [b, heads, w, d]
            k = attn.k_proj(h).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, kv, w, d]
            v = attn.v_proj(h).view(b, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            # Write only the real tokens: [r, kv, d] into (slot, :, position).
            store.keys[i][slot_of, :, entry_of] = k.transpose(1, 2)[row_of, col_of]
            store.values[i][slot_of, :, entry_of] = v.transpose(1, 2)[row_of, col_of]
            keys = store.keys[i, :, :, :end].index_select(0, slot_index)  # [b, kv, end, d]
            values = store.values[i, :, :, :end].index_select(0, slot_index)
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=self.num_kv_heads != self.num_heads
            )  # [b, heads, w, d]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, width, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if rows.tap is not None:
            states = torch.cat([tapped[layer] for layer in rows.tap.layers], dim=-1)  # [b, w, layers * hidden]
            rows.tap.fill([states[row, :n] for row, n in enumerate(counts)])
        if logits_to_keep:  # the head only on each row's last real tokens
            kept = [min(n, logits_to_keep) for n in counts]
            first_kept = torch.tensor([n - k for n, k in zip(counts, kept, strict=True)], device=device)  # [b]
            row_of, col_of = ((offsets[None, :] >= first_kept[:, None]) & real).nonzero(as_tuple=True)
            counts = kept
        hidden = model.norm(x[row_of, col_of])  # [r, hidden]
        return list(self.head(hidden).split(counts))  # [n_i or logits_to_keep, vocab] each
