"""An EAGLE-3 draft head: one decoder layer that drafts from the target's own hidden states.

Entry p of the head's cache joins the target's states at token p (the states entering three of its layers, side by
side, projected by ``fc`` to the head's width) with the embedding of token p + 1, at rotary position p; its output
predicts token p + 2. Drafting past what the target has seen feeds the head's own output (before its final norm) in
place of the projected states, one entry per drafted token. The layer's attention reads ``2 * hidden`` inputs (the
normed embedding and the normed states, side by side); its logits cover a draft vocabulary, mapped onto the
target's by ``d2t`` (draft id i is target id i + d2t[i]); every other target token has logit -inf.

Weight names follow the speculators layout (decoder/heads/layout.py), so a head trained elsewhere loads as is.
Shapes in the notation of ``decoder/__init__.py``; ``f`` is the target's features per token (3 x its hidden).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from decoder.runners.kv import INITIAL_CAPACITY, grown_capacity


@dataclass(frozen=True)
class HeadShape:
    """The sizes of an EAGLE-3 head, and the target it reads."""

    hidden: int  # the head's width
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's vocabulary (the embedding's rows, the logits' width)
    draft_vocab: int  # the head's own output rows
    target_hidden: int
    aux_layers: tuple[int, ...]  # the target layers whose entering states it reads (vLLM's numbering)
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_before_residual: bool = False

    @property
    def features(self) -> int:
        """What the head reads per token: the target's states at each of ``aux_layers``, side by side."""
        return len(self.aux_layers) * self.target_hidden


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.hidden_norm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn: Attention = Attention(s)
        self.mlp: MLP = MLP(s)


class EagleHead(nn.Module):
    """The head's weights (speculators names) and its forward over any entries, given their keys' visibility."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.fc = nn.Linear(shape.features, shape.hidden, bias=True)
        self.layers = nn.ModuleList([Layer(shape)])
        self.norm = RMSNorm(shape.hidden, shape.rms_eps)
        self.lm_head = nn.Linear(shape.hidden, shape.draft_vocab, bias=False)
        self.d2t: torch.Tensor
        self.t2d: torch.Tensor
        self.inverse_frequency: torch.Tensor
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(shape.vocab, dtype=torch.bool))
        inverse = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
        self.register_buffer("inverse_frequency", inverse, persistent=False)

    @property
    def layer(self) -> Layer:
        """The head's one decoder layer (``layers.0`` in the speculators layout)."""
        return cast(Layer, self.layers[0])

    def target_ids(self) -> torch.Tensor:
        """The target id of each draft-vocabulary row.  # -> [draft_vocab] int64"""
        return torch.arange(self.shape.draft_vocab, device=self.d2t.device) + self.d2t

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` ([n]), transformers' Llama layout.  # -> [n, d] each"""
        angles = positions.float()[:, None] * self.inverse_frequency[None, :]  # [n, d / 2]
        both = torch.cat([angles, angles], dim=-1)
        return both.cos(), both.sin()

    def qkv(
        self, fused: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's queries, keys and values for new entries, and the residual they add onto.
        # fused: [n, hidden], tokens: [n], positions: [n] -> [heads, n, d], [kv, n, d], [kv, n, d], [n, hidden]"""
        s, layer = self.shape, self.layer
        embeds = layer.input_layernorm(self.embed_tokens(tokens))
        if s.norm_before_residual:
            fused = layer.hidden_norm(fused)
            residual, normed = fused, fused
        else:
            residual, normed = fused, layer.hidden_norm(fused)
        x = torch.cat([embeds, normed], dim=-1)  # [n, 2 * hidden]
        n, attn = x.shape[0], layer.self_attn
        q = attn.q_proj(x).view(n, s.heads, s.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(n, s.kv_heads, s.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(n, s.kv_heads, s.head_dim).transpose(0, 1)
        cos, sin = self.rotary(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output after its attention (what drafting feeds back).
        # attended: [heads, n, d], residual: [n, hidden] -> [n, hidden]"""
        layer = self.layer
        x = residual + layer.self_attn.o_proj(attended.transpose(0, 1).reshape(residual.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's logits over its draft vocabulary.  # out: [n, hidden] -> [n, draft_vocab]"""
        return self.lm_head(self.norm(out))

    def spread(self, small: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits over the target's vocabulary: -inf off the draft vocabulary.
        # [n, draft_vocab] -> [n, vocab]"""
        logits = small.new_full((small.shape[0], self.shape.vocab), float("-inf"))
        logits[:, self.target_ids()] = small
        return logits


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves rotated (transformers' Llama).  # x: [h, n, d], cos/sin: [n, d]"""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class HeadCache:
    """One sequence's keys and values of the head's layer, entry p at row p; a rollback is a length change."""

    def __init__(self, head: EagleHead, capacity: int = INITIAL_CAPACITY) -> None:
        s = head.shape
        weight = head.fc.weight
        self.head = head
        self.keys = torch.zeros(s.kv_heads, capacity, s.head_dim, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def forward(self, fused: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Append entries (at positions ``length``.. on) and return the layer's outputs; each entry sees the
        entries before it and itself.  # fused: [n, hidden], tokens: [n] -> [n, hidden]"""
        n, start = int(tokens.shape[0]), self.length
        end = start + n
        self.reserve(end)
        positions = torch.arange(start, end, device=fused.device)
        q, k, v, residual = self.head.qkv(fused, tokens.to(fused.device), positions)
        self.keys[:, start:end], self.values[:, start:end] = k, v
        mask = torch.ones(n, end, dtype=torch.bool, device=fused.device).tril(start) if n > 1 else None
        s = self.head.shape
        attended = F.scaled_dot_product_attention(
            q[None], self.keys[None, :, :end], self.values[None, :, :end], attn_mask=mask,
            enable_gqa=s.kv_heads != s.heads,
        )[0]  # fmt: skip
        self.length = end
        return self.head.finish(attended, residual)

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` entries; the ones held are copied when it grows."""
        if needed <= self.capacity:
            return
        capacity = grown_capacity(self.capacity, needed)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], capacity, old.shape[2])
            grown[:, : self.length] = old[:, : self.length]
            setattr(self, name, grown)
