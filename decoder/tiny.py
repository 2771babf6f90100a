"""Random-weight model pairs built from a config: a tiny one for tests and a first run with no trained models, and
one of a real model's shape for measuring costs.

Their text is gibberish, but they are real transformers models saved and loaded through the same
``from_pretrained`` path as any other, with a real byte-level BPE tokenizer. ``SHAPES`` names the pairs
``specd tiny-pair --shape`` writes: "tiny" (the default: a 2-layer, 64-wide target and a 1-layer, 32-wide draft, in
float32) and "1b" (a target of TinyLlama-1.1B's shape and a 2-layer, 512-wide draft of about 40M parameters, in
bfloat16: 2.2 GB written). Random weights agree with nobody, so a pair of the "1b" shape measures costs, never
acceptance (benchmarks/set_acceptance.py gives a set acceptance for that).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_VOCAB = 384  # 256 bytes + merges
TINY_TOPICS = 40  # pydoc topics the tiny tokenizer is trained on (the tests' pair depends on it)


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that set a Llama's cost per step."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int


@dataclass(frozen=True)
class PairShape:
    """A target and a draft sharing one tokenizer. ``vocab`` is the models' logit width; the tokenizer is trained up
    to it, and where the training text holds fewer merges the ids past its end decode to nothing."""

    target: LlamaShape
    draft: LlamaShape
    vocab: int
    dtype: str  # what the weights are saved in (decoder.choices.DTYPE_NAMES)
    corpus_topics: int | None  # pydoc topics the tokenizer is trained on; None: all of them
    arches: tuple[str, ...]  # the architectures this shape can be written in


def _tiny_llama(hidden: int, layers: int) -> LlamaShape:
    return LlamaShape(hidden, layers, heads=4, kv_heads=2, intermediate=hidden * 2, max_positions=512)


SHAPES: dict[str, PairShape] = {
    "tiny": PairShape(_tiny_llama(64, 2), _tiny_llama(32, 1), TINY_VOCAB, "float32", TINY_TOPICS, ("llama", "gpt2")),
    # TinyLlama-1.1B: hidden 2048, 22 layers, 32 heads (4 KV), MLP 5632, vocab 32000, context 2048 (2.2 GB in bf16)
    "1b": PairShape(
        LlamaShape(2048, 22, heads=32, kv_heads=4, intermediate=5632, max_positions=2048),
        LlamaShape(512, 2, heads=8, kv_heads=4, intermediate=1408, max_positions=2048),  # ~39M, mostly embeddings
        vocab=32000,
        dtype="bfloat16",
        corpus_topics=None,
        arches=("llama",),
    ),
}


def build_tokenizer(vocab_size: int = TINY_VOCAB, topics_used: int | None = TINY_TOPICS) -> Any:
    """A byte-level BPE tokenizer trained in a fraction of a second on text every Python install has."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [topics[key] for key in sorted(topics)][:topics_used]
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


def llama_config(shape: LlamaShape, vocab_size: int) -> Any:
    """The transformers config of a Llama of ``shape``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )


def count_parameters(shape: LlamaShape, vocab_size: int) -> int:
    """Parameters of a Llama of ``shape``, counted on the meta device (no weights are made)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(shape, vocab_size))
    return sum(p.numel() for p in model.parameters())


def build_llama(shape: LlamaShape, vocab_size: int, seed: int, dtype: str = "float32") -> Any:
    """A randomly initialised Llama of ``shape``, its weights made in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(shape, vocab_size), dtype=getattr(torch, dtype))
    return _spread_logits(model)


def build_model(arch: str, vocab_size: int, seed: int, hidden: int = 64, layers: int = 2) -> Any:
    """A tiny randomly initialised causal LM of architecture "llama" or "gpt2"."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    if arch == "llama":
        return build_llama(_tiny_llama(hidden, layers), vocab_size, seed)
    if arch != "gpt2":
        raise ValueError(f"unknown tiny architecture {arch!r}; choose llama or gpt2")
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
    torch.manual_seed(seed)
    return _spread_logits(AutoModelForCausalLM.from_config(config))


def _spread_logits(model: Any) -> Any:
    """Give the model clear preferences (random init gives near-uniform logits)."""
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def save_pair(out: Path, shape: str = "tiny", arch: str = "llama", seed: int = 0) -> tuple[Path, Path]:
    """Write a target and a smaller draft (same tokenizer) of the pair ``shape`` names under ``out``; return their
    folders. Raises ValueError for a shape or an architecture it does not have."""
    from transformers.utils import logging as hf_logging

    pair = SHAPES.get(shape)
    if pair is None:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if arch not in pair.arches:
        raise ValueError(f"shape {shape!r} comes in {', '.join(pair.arches)} only, not {arch!r}")
    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer(pair.vocab, pair.corpus_topics)
    vocab = len(tokenizer) if shape == "tiny" else pair.vocab  # the tiny pair's width is its tokenizer's
    paths = (out / "target", out / "draft")
    for path, model_shape, model_seed in zip(paths, (pair.target, pair.draft), (seed, seed + 1), strict=True):
        if arch == "llama":
            model = build_llama(model_shape, vocab, model_seed, pair.dtype)
        else:
            model = build_model(arch, vocab, model_seed, hidden=model_shape.hidden, layers=model_shape.layers)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model  # the 1b target is 2.2 GB: free it before the draft is made
    return paths


def save_tiny_pair(out: Path, arch: str = "llama", seed: int = 0) -> tuple[Path, Path]:
    """Write a tiny target and a smaller draft (same tokenizer) under ``out``; return their folders."""
    return save_pair(out, "tiny", arch, seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write target/ and draft/ into")
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="tiny",
        help="tiny: a 2-layer target for trying things; 1b: TinyLlama-1.1B's shape and a ~40M draft, bfloat16, "
        "2.2 GB, for measuring costs (llama only)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from specd_api.errors import UsageError

    pair = SHAPES[args.shape]
    if args.arch not in pair.arches:
        raise UsageError(f"--shape {args.shape} comes in {', '.join(pair.arches)} only, not --arch {args.arch}")
    target, draft = save_pair(args.out, args.shape, args.arch, args.seed)
    print(f"wrote {target} and {draft}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m decoder.tiny``: ``specd tiny-pair`` where the controller's packages are not installed (a GPU
    machine with torch and transformers alone)."""
    parser = argparse.ArgumentParser(prog="python -m decoder.tiny", description="write a random target/draft pair")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
