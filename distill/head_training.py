"""Training an EAGLE-3 head (decoder/heads) on its target's own states, with training-time test.

Every step runs the target over a batch of blocks ([b, n]) once, for its states at the head's layers and its
logits, then the head over ``ttt_steps`` unrolled drafting steps. Step 0 is what serving's first entries are:
entry p joins the target's states at token p with token p + 1. Step s feeds each entry the head's own output of
step s - 1 one entry earlier, as drafting past the target's states does, and its query at p sees the step-0 keys up
to p - s and, of each step j in 1..s, the one key on its own drafting chain (position p - s + j). Every step at
every position is trained towards the target's next-token distribution there (restricted to the draft vocabulary),
by forward KL, step s weighted ``DECAY ** s``.

Shapes in the notation of ``decoder/__init__.py``; ``m`` = n - 1 entries per row, ``g`` the head's key-value heads.
"""

from __future__ import annotations

from typing import Any

import torch

from decoder.heads import EagleHead, HeadShape
from decoder.heads.model import rotate

DECAY = 0.8  # the weight of drafting step s is DECAY ** s
MASKED = -1e9  # a score no key of a row's softmax may win with (finite: rows with no valid key stay finite)


def draft_vocabulary(stream: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` target ids most frequent in ``stream``, ascending (ties to the lower id).
    # stream: [num_tokens] int64 -> [size] int64"""
    counts = torch.bincount(stream, minlength=vocab).double()
    order = torch.argsort(counts - torch.arange(vocab) * 1e-9, descending=True, stable=True)
    return order[:size].sort().values


def new_head(target_model: Any, shape: HeadShape, draft_ids: torch.Tensor, seed: int) -> EagleHead:
    """A head for ``target_model`` over the draft vocabulary ``draft_ids`` ([draft_vocab] ascending target ids):
    random, but where its width is the target's, its embeddings (frozen), final norm and output rows start as the
    target's own."""
    torch.manual_seed(seed)
    head = EagleHead(shape)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
        head.d2t.copy_(draft_ids - torch.arange(shape.draft_vocab))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
        if shape.hidden == shape.target_hidden:
            head.embed_tokens.weight.copy_(target_model.model.embed_tokens.weight.float())
            head.embed_tokens.weight.requires_grad_(False)
            head.norm.weight.copy_(target_model.model.norm.weight.float())
            head.lm_head.weight.copy_(target_model.lm_head.weight.float()[draft_ids])
    return head


@torch.no_grad()
def target_states(target_model: Any, batch: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's states entering ``layers`` (side by side) and its logits over ``batch``.
    # batch: [b, n] -> [b, n, f], [b, n, vocab]"""
    out = target_model(input_ids=batch, use_cache=False, output_hidden_states=True)
    states = torch.cat([out.hidden_states[j] for j in layers], dim=-1).float()
    return states, out.logits.float()


def unrolled_logits(head: EagleHead, states: torch.Tensor, batch: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's draft-vocabulary logits at every entry of each drafting step 0..``steps`` - 1 (entries p < s of
    step s have no chain and are left to the loss to drop).
    # states: [b, n, f], batch: [b, n] -> [b, m, draft_vocab] per step"""
    s = head.shape
    b, n = batch.shape
    m = n - 1
    tokens = batch[:, 1:]  # [b, m] entry p's token: p + 1
    layer = head.layer
    attn = layer.self_attn
    embeds = layer.input_layernorm(head.embed_tokens(tokens))  # [b, m, hidden]
    cos, sin = head.rotary(torch.arange(m, device=batch.device))  # [m, d]
    scale = s.head_dim**-0.5
    group = s.heads // s.kv_heads
    fused = head.fc(states[:, :m])  # [b, m, hidden]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    entry = torch.arange(m, device=batch.device)
    for step in range(steps):
        if s.norm_before_residual:
            fused = layer.hidden_norm(fused)
            residual, normed = fused, fused
        else:
            residual, normed = fused, layer.hidden_norm(fused)
        x = torch.cat([embeds, normed], dim=-1)  # [b, m, 2 * hidden]
        q = rotate(attn.q_proj(x).view(b, m, s.heads, s.head_dim).transpose(1, 2), cos, sin)  # [b, heads, m, d]
        k = rotate(attn.k_proj(x).view(b, m, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)  # [b, g, m, d]
        v = attn.v_proj(x).view(b, m, s.kv_heads, s.head_dim).transpose(1, 2)
        keys.append(k.repeat_interleave(group, dim=1))  # [b, heads, m, d]
        values.append(v.repeat_interleave(group, dim=1))
        visible = entry[None, :] <= entry[:, None] - step  # [m, m] step-0 keys up to p - step
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~visible, MASKED)]  # [b, heads, m, m]
        chain_values = []
        for j in range(1, step + 1):  # this step's chain: step j's entry at p - step + j
            shifted_k, shifted_v = shift(keys[j], step - j, dim=2), shift(values[j], step - j, dim=2)
            scores.append((q * shifted_k).sum(-1, keepdim=True) * scale)  # [b, heads, m, 1]
            chain_values.append(shifted_v)
        weights = torch.cat(scores, dim=-1).softmax(dim=-1)
        attended = weights[..., :m] @ values[0]  # [b, heads, m, d]
        for j, chain_v in enumerate(chain_values):
            attended = attended + weights[..., m + j : m + j + 1] * chain_v
        out = residual + attn.o_proj(attended.transpose(1, 2).reshape(b, m, -1))
        out = out + layer.mlp(layer.post_attention_layernorm(out))  # [b, m, hidden]
        logits.append(head.draft_logits(out))
        fused = shift(out, 1, dim=1)  # step s + 1's entry p reads this step's p - 1
    return logits


def shift(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """``x`` moved ``by`` entries later along ``dim``, zeros in front."""
    if by == 0:
        return x
    front = x.narrow(dim, 0, x.shape[dim] - by)
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, by)), front], dim=dim)


def head_loss(logits: list[torch.Tensor], target_logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """Forward KL from the target's next-token distribution over the draft vocabulary to each step's, at the
    entries each step has, step s weighted DECAY ** s.  # target_logits: [b, n, vocab] -> scalar"""
    p_log = torch.log_softmax(target_logits[:, 1:, draft_ids], dim=-1)  # [b, m, draft_vocab] entry p: token p + 2
    p = p_log.exp()
    total = target_logits.new_zeros(())
    weight_sum = 0.0
    for step, step_logits in enumerate(logits):
        q_log = torch.log_softmax(step_logits.float(), dim=-1)
        per_entry = (p * (p_log - q_log)).sum(-1)[:, step:]  # [b, m - step]
        total = total + DECAY**step * per_entry.mean()
        weight_sum += DECAY**step
    return total / weight_sum
