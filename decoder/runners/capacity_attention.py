"""The graphs pass's attention: each sequence's queries over its slot's whole capacity, masked by position, in one
fixed shape.

Chosen: an explicit matmul -> softmax -> matmul, all in float32 whatever the model's dtype (as fused kernels keep
their scores; transformers' eager attention rounds the scores to bfloat16 first, and is 0.23 off on bfloat16 logits
where its SDPA forward is 0.15), one call per sequence, its queries padded to ``Q`` = K_max+1 rows, over all ``C``
positions of the slot with the positions after each query's own masked out. Every call has the same shape whatever
the bucket, the batch or the sequence's length, so:

- it is capturable: no shape depends on a length, nothing synchronises with the host;
- it builds no plan per length: cuDNN's SDPA builds one per new KV length (+40-60 ms each on an H100),
  here there is one shape per model;
- it is batch-invariant: a query's scores, softmax and weighted sum are computed by the same kernels in the same
  order whatever else shares the pass. SDPA's fused kernels are not used: their backend and, on a GPU, their
  split of the KV positions across thread blocks (flash-decoding) are picked by batch size and length, which is
  exactly what makes a row's bits depend on its neighbours; and a batched matmul over all sequences at once would
  let cuBLAS pick its algorithm (split-K included) by the batch count. One call per sequence keeps the shape fixed.

What it costs: each step reads every position of the slot (the capacity, not the length) for each sequence, and
computes ``Q`` query rows where a decode step has one; a bfloat16 slot is read into float32 first. Attention is a
small share of a decode step's bytes at short capacities (the weights dominate); a long capacity with short
requests pays for the unused positions.

Shapes: ``B`` sequences of a bucket, ``W`` its width (tokens per sequence), ``Q`` the padded query rows per
sequence (>= W), ``C`` the capacity, ``R`` the step's token rows (``B * W`` padded to whole tiles), ``heads``/``kv``/
``d`` the query heads, key-value heads and head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible_positions(capacity_index: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Which cached positions each query attends to: those at or before its own.
    # capacity_index: [C]; query_positions: [B, Q] -> [B, Q, C] bool"""
    return capacity_index[None, None, :] <= query_positions[:, :, None]


def attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One sequence's queries over its whole slot. Query head h reads key-value head h // (heads / kv), as
    transformers' ``repeat_kv`` lays them out.
    # q: [Q, heads, d]; keys, values: [kv, C, d]; visible: [Q, C] -> [Q, heads * d]"""
    rows, heads, d = q.shape
    kv, capacity = keys.shape[0], keys.shape[1]
    group = heads // kv
    grouped = q.view(rows, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * rows, d).float()  # [kv, group*Q, d]
    scores = torch.matmul(grouped, keys.float().transpose(1, 2)) * scaling  # [kv, group * Q, C]
    scores = scores.view(kv, group, rows, capacity).masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [kv, group, Q, C]
    out = torch.matmul(weights.view(kv, group * rows, capacity), values.float())  # [kv, group * Q, d]
    return out.view(kv, group, rows, d).permute(2, 0, 1, 3).reshape(rows, heads * d).to(q.dtype)


def attend_sequences(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_slots: torch.Tensor,
    visible: torch.Tensor,
    width: int,
    scaling: float,
) -> torch.Tensor:
    """Every sequence of a step over its own slot, one fixed-shape call each (``attend_one``).
    # q: [R, heads, d], row b * W + j is sequence b's token j; keys, values: [slots, kv, C, d]; seq_slots: [B];
    # visible: [B, Q, C] -> [R, heads * d] (rows past B * W zero)"""
    batch, padded_width = visible.shape[0], visible.shape[1]
    rows, heads, d = q.shape
    real = batch * width
    queries = F.pad(q[:real].view(batch, width, heads, d), (0, 0, 0, 0, 0, padded_width - width))  # [B, Q, heads, d]
    out = [
        attend_one(
            queries[b],
            keys.index_select(0, seq_slots[b : b + 1])[0],  # [kv, C, d]
            values.index_select(0, seq_slots[b : b + 1])[0],
            visible[b],
            scaling,
        )
        for b in range(batch)
    ]
    attended = torch.stack(out)[:, :width].reshape(real, heads * d)  # [B * W, heads * d]
    return F.pad(attended, (0, 0, 0, rows - real))
