"""The batch-invariant pass (runner ``invariant``): a token's logits are the same bits whatever else is in
the pass, in any dtype and on any device, using PyTorch's own kernels.

Why it is needed: a GEMM's kernel (and with it the order in which a dot product is summed) is chosen by the shape
of the call. A token decoded alone is a 1-row matrix product; the same token verified among K drafts is one row of a
(K+1)-row product; in a batched worker it is one row of whatever the batch holds. In bfloat16 the different orders
round differently, a near-tie's argmax flips, and greedy speculative output drifts from target-only output (8 of 12
prompts equal on the shipped pair in bf16). SGLang's deterministic inference and vLLM's batch-invariant mode fix
the reduction order with their own kernels; this pass gets there with fixed shapes instead:

- every row-wise step (embedding, norms, rotary embedding, the projections, the MLP, the LM head) runs on tiles of
  exactly ``TILE`` rows, padded with zeros, so each call has one shape whatever the number of tokens; the rows of a
  matrix product do not mix, so a row's result depends on its own values and the (fixed) kernel only;
- attention runs one query at a time over exactly the positions it sees (``0..position``), so its shape depends on
  the position alone, as it does when the token is decoded on its own. A draft tree's token (``RaggedRows.trees``)
  sees the cache up to its root and its ancestors' entries: they are gathered in depth order, the keys and values
  its chain's token would see, in the same places.

What it costs: a pass of up to ``TILE`` tokens reads the weights once (as a 1-token step does: verifying K <= 7
drafts costs about one step where the weights dominate), one attention call per token and layer, and more tiles for
longer passes (a prefill). The figures are in docs/BENCHMARKS.md.

Shapes in the notation of ``decoder/__init__.py``: ``r`` real tokens in the pass, ``p`` padded to whole tiles,
``tile`` one tile's ``TILE`` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from decoder.runners.base import KVStore, RaggedRows
from decoder.runners.kv import LlamaTensorPass, SlotTensors
from decoder.tree import ROOT

TILE = 8  # rows per call of every row-wise step


class InvariantPass(LlamaTensorPass):
    """The lean pass's model, run in fixed shapes over ``SlotTensors`` (``forward_invariant``)."""

    name = "invariant"
    trees = True
    features = True

    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        assert isinstance(store, SlotTensors)
        return forward_invariant(self, store, rows, logits_to_keep)


def padded_rows(rows: int) -> int:
    return -(-rows // TILE) * TILE


def by_tiles(step: Callable[[slice], torch.Tensor], rows: int, tile: int = TILE) -> torch.Tensor:
    """``step`` on each ``tile``-row slice of ``rows`` (a multiple of ``tile``), concatenated. # -> [rows, ...]"""
    assert rows % tile == 0, rows
    return torch.cat([step(slice(first, first + tile)) for first in range(0, rows, tile)])


def _module(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _modules(modules: Sequence[Any], x: torch.Tensor) -> list[torch.Tensor]:
    return [module(x) for module in modules]


def _onto(module: Any, x: torch.Tensor, residual: torch.Tensor, ops: RowOps) -> torch.Tensor:
    return residual + ops.linear(module, x)


def _gated(mlp: Any, x: torch.Tensor, ops: RowOps) -> torch.Tensor:
    gate, up = ops.linears((mlp.gate_proj, mlp.up_proj), x)
    return mlp.act_fn(gate) * up


@dataclass(frozen=True)
class RowOps:
    """How a layer's row-wise reductions run, given the model's module and its input rows: the module itself (the
    default), or another kernel of the same arithmetic (the graphs pass's Triton kernels, decoder/runners/
    row_kernels.py). Everything else in a layer is elementwise."""

    norm: Callable[[Any, torch.Tensor], torch.Tensor] = _module  # an RMSNorm module
    linear: Callable[[Any, torch.Tensor], torch.Tensor] = _module  # an nn.Linear
    linears: Callable[[Sequence[Any], torch.Tensor], list[torch.Tensor]] = _modules  # nn.Linears reading the same rows
    onto: Callable[[Any, torch.Tensor, torch.Tensor, RowOps], torch.Tensor] = _onto  # residual + a Linear's output
    gated: Callable[[Any, torch.Tensor, RowOps], torch.Tensor] = _gated  # a LlamaMLP's act(gate(x)) * up(x)


MODULES = RowOps()


def project_qkv(
    pass_: InvariantPass,
    layer: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ops: RowOps = MODULES,
) -> torch.Tensor:
    """Norm, q/k/v projections and rotary embedding of some rows. # x: [n, hidden] -> [n, heads + 2 kv, d]"""
    attn, shape = layer.self_attn, pass_.shape
    heads, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    h = ops.norm(layer.input_layernorm, x)  # [n, hidden]
    q, k, v = ops.linears((attn.q_proj, attn.k_proj, attn.v_proj), h)  # [n, heads * d | kv * d | kv * d]
    q = q.view(1, -1, heads, d).transpose(1, 2)  # [1, heads, n, d]
    k = k.view(1, -1, kv, d).transpose(1, 2)  # [1, kv, n, d]
    v = v.view(1, -1, kv, d).transpose(1, 2)
    q, k = pass_.rope(q, k, cos, sin)  # cos, sin: [1, n, d]
    return torch.cat([q, k, v], dim=1)[0].transpose(0, 1)


def output_and_mlp(layer: Any, x: torch.Tensor, attended: torch.Tensor, ops: RowOps = MODULES) -> torch.Tensor:
    """The attention's output projection and the MLP (transformers' LlamaMLP: down(act(gate(h)) * up(h))), residuals
    included. # x: [n, hidden] -> [n, hidden]"""
    h = ops.onto(layer.self_attn.o_proj, attended, x, ops)
    mlp = layer.mlp
    return ops.onto(mlp.down_proj, ops.gated(mlp, ops.norm(layer.post_attention_layernorm, h), ops), h, ops)


@dataclass(frozen=True)
class Seen:
    """The cache entries one query attends to: ``0..prefix - 1``, then ``path`` (a tree's token: its ancestors'
    entries below the root and its own, in depth order)."""

    slot: int
    prefix: int
    path: tuple[int, ...] = ()

    def of(self, cache: torch.Tensor) -> torch.Tensor:
        """Those entries of one layer's ``cache`` ([slots, kv, capacity, d]), in order. # -> [1, kv, seen, d]"""
        rows = cache[self.slot : self.slot + 1, :, : self.prefix]
        if not self.path:
            return rows
        return torch.cat([rows, cache[self.slot : self.slot + 1, :, list(self.path)]], dim=2)


def seen_by(rows: RaggedRows) -> list[Seen]:
    """What each token of ``rows`` attends to: a chain's token everything up to its own entry; a tree's token the
    cache up to its root's and its ancestors' entries."""
    seen: list[Seen] = []
    for row, (slot, start, n) in enumerate(zip(rows.slots, rows.starts, rows.counts, strict=True)):
        tree = rows.tree(row)
        if tree is None:
            seen += [Seen(slot, start + j + 1) for j in range(n)]
            continue
        seen += [
            Seen(slot, start + 1, tuple(start + 1 + m for m in tree.path_to(node))) for node in (ROOT, *range(n - 1))
        ]
    return seen


def attend_one_by_one(
    pass_: InvariantPass, store: SlotTensors, i: int, q: torch.Tensor, seen: list[Seen], padded: int
) -> torch.Tensor:
    """Each query over exactly the cached entries it sees, as when decoded alone.
    # q: [r, heads, d] -> [p, heads * d] (padding rows zero)"""
    scaling, shape = pass_.model.model.layers[i].self_attn.scaling, pass_.shape
    out = q.new_zeros(padded, shape.heads * shape.head_dim)
    for row, entries in enumerate(seen):
        out[row] = F.scaled_dot_product_attention(
            q[row][None, :, None],  # [1, heads, 1, d]
            entries.of(store.keys[i]),  # [1, kv, seen, d]
            entries.of(store.values[i]),
            scale=scaling,
            enable_gqa=shape.kv_heads != shape.heads,
        ).reshape(-1)
    return out


@torch.inference_mode()
def forward_invariant(
    pass_: InvariantPass, store: SlotTensors, rows: RaggedRows, logits_to_keep: int
) -> list[torch.Tensor]:
    """Append each row's tokens to its slot's cache; each row's logits (all, or its last ``logits_to_keep``)."""
    model = pass_.model.model
    device = pass_.device
    slots, inputs, starts, counts = rows.slots, rows.inputs, rows.starts, rows.counts
    real = sum(counts)
    padded = padded_rows(real)
    slot_of = [slot for slot, n in zip(slots, counts, strict=True) for _ in range(n)]
    entry_of = [start + j for start, n in zip(starts, counts, strict=True) for j in range(n)]
    position_of = [position for row in range(len(slots)) for position in rows.positions(row)]
    seen = seen_by(rows)
    ids = torch.zeros(padded, dtype=torch.long)
    ids[:real] = torch.cat(inputs).to("cpu")
    ids = ids.to(device)  # [p]
    positions = torch.zeros(padded, dtype=torch.long)
    positions[:real] = torch.tensor(position_of)
    positions = positions.to(device)[None]  # [1, p]
    slot_index = torch.tensor(slot_of, device=device)  # [r]
    entry_index = torch.tensor(entry_of, device=device)  # [r]

    x = by_tiles(lambda t: model.embed_tokens(ids[t]), padded)  # [p, hidden]
    cos, sin = model.rotary_emb(x[None], positions)  # [1, p, d] each: elementwise in the position, row by row
    heads, kv = pass_.shape.heads, pass_.shape.kv_heads
    tapped: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        tapped[i] = x[:real]  # [r, hidden] the states entering layer i
        # (each lambda runs inside by_tiles, within its iteration: B023's late binding cannot bite)
        projected = by_tiles(lambda t: project_qkv(pass_, layer, x[t], cos[:, t], sin[:, t]), padded)  # noqa: B023
        q, k, v = projected[:real].split([heads, kv, kv], dim=1)  # [r, heads | kv | kv, d]
        store.keys[i][slot_index, :, entry_index] = k
        store.values[i][slot_index, :, entry_index] = v
        attended = attend_one_by_one(pass_, store, i, q, seen, padded)  # [p, heads * d]
        x = by_tiles(lambda t: output_and_mlp(layer, x[t], attended[t]), padded)  # noqa: B023  [p, hidden]

    if rows.tap is not None:
        states = torch.cat([tapped[layer] for layer in rows.tap.layers], dim=-1)  # [r, layers * hidden]
        rows.tap.fill(list(states.split(counts)))
    kept = rows.kept(logits_to_keep)
    ends = torch.tensor(counts).cumsum(0).tolist()
    wanted = [row for end, k in zip(ends, kept, strict=True) for row in range(end - k, end)]
    hidden = x.new_zeros(padded_rows(len(wanted)), x.shape[1])  # [kept padded, hidden]
    hidden[: len(wanted)] = x[torch.tensor(wanted, device=device)]
    head = pass_.model.lm_head
    logits = by_tiles(lambda t: head(model.norm(hidden[t])), hidden.shape[0])[: len(wanted)]  # [sum(kept), vocab]
    return list(logits.split(kept))
