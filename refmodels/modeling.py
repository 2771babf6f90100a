"""The two Llama-style architectures: a ~16M-parameter target and a ~10x smaller draft, same vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-style decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 1024
    rope_theta: float = 10_000.0


ROLE_SPECS: dict[str, ModelSpec] = {
    # 6 x 1.57M in the blocks + 2 x 3.15M untied embeddings: ~15.7M parameters.
    "target": ModelSpec(384, 6, 6, 2, 1024, tie_word_embeddings=False),
    # 2 x 0.25M in the blocks + 1.05M tied embeddings: ~1.5M parameters.
    "draft": ModelSpec(128, 2, 4, 2, 512, tie_word_embeddings=True),
}


def llama_config(spec: ModelSpec, vocab_size: int, eos_token_id: int) -> LlamaConfig:
    """The ``LlamaConfig`` for ``spec``; the one special token is BOS, EOS and PAD."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def build_model(config: LlamaConfig, seed: int) -> PreTrainedModel:
    """A freshly initialised float32 model; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def count_non_embedding_parameters(model: PreTrainedModel) -> int:
    """Parameters outside the input embedding and the LM head."""
    excluded = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)
