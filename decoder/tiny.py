"""Tiny random-weight models built from a config, for tests and a first run with no trained models.

Their text is gibberish, but they are real transformers models saved and loaded through the same
``from_pretrained`` path as any other, with a real byte-level BPE tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TINY_VOCAB = 384  # 256 bytes + merges


def build_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained in a fraction of a second on text every Python install has."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [topics[key] for key in sorted(topics)][:40]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def build_model(arch: str, vocab_size: int, seed: int, hidden: int = 64, layers: int = 2) -> Any:
    """A randomly initialised causal LM of architecture "llama" or "gpt2"."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    config: Any
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
        )
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=512,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose llama or gpt2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Spread the logits so the models have clear preferences (random init gives near-uniform ones).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def save_tiny_pair(out: Path, arch: str = "llama", seed: int = 0) -> tuple[Path, Path]:
    """Write a tiny target and a smaller draft (same tokenizer) under ``out``; return their folders."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    paths = (out / "target", out / "draft")
    for path, model in zip(
        paths,
        (
            build_model(arch, vocab, seed, hidden=64, layers=2),
            build_model(arch, vocab, seed + 1, hidden=32, layers=1),
        ),
        strict=True,
    ):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write target/ and draft/ into")
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    target, draft = save_tiny_pair(args.out, args.arch, args.seed)
    print(f"wrote {target} and {draft}")
    return 0
