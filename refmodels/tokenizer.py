"""A byte-level BPE tokenizer trained on the corpus's train split, wrapped as a ``PreTrainedTokenizerFast``.

``<|endoftext|>`` is the only special token: it is BOS, EOS and PAD, and separates packed documents.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerConfig:
    """How the BPE vocabulary is learned."""

    vocab_size: int = 8192
    min_frequency: int = 2
    model_max_length: int = 1024  # the models' max_position_embeddings


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Learn byte-level BPE merges from ``texts`` (every byte is in the base alphabet: nothing is unknown)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer, cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """The ``transformers`` tokenizer around a trained ``tokenizers.Tokenizer``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=cfg.model_max_length,
        clean_up_tokenization_spaces=False,
    )


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig | None = None) -> PreTrainedTokenizerFast:
    """Train on ``texts`` and wrap the result."""
    cfg = cfg or TokenizerConfig()
    return wrap(train_bpe(texts, cfg), cfg)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """A tokenizer written by ``save_pretrained``, loaded offline."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    if tokenizer.eos_token != EOS_TOKEN:
        raise ValueError(f"{folder} holds a tokenizer whose EOS is {tokenizer.eos_token!r}, not {EOS_TOKEN!r}")
    return tokenizer
