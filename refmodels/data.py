"""The tokenizer and the tokenized corpus, built once into a data folder that target and draft runs share.

Layout of the data folder::

    tokenizer/             the PreTrainedTokenizerFast (save_pretrained)
    train.npy              uint16 token stream of the train split: <eos> doc <eos> doc ... (shuffled docs)
    val_<domain>.npy       uint16 token stream of each domain's validation documents
    meta.json              configs, corpus fingerprint, tokenizer hash, token counts (the cache key)
    corpus_manifest.json   corpus statistics and the doc ids of each split

Both roles must use the same folder so that their tokenizers are identical. A lock file serialises two
runs that start at once. ``python -m refmodels.data --data-dir DIR`` builds it ahead of training.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from refmodels.corpus import DOMAINS, CorpusConfig, Document, build_corpus, corpus_fingerprint, write_manifest
from refmodels.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

TOKEN_DTYPE = np.uint16  # the vocabulary is well under 65,536
CACHE_VERSION = 1


@dataclass(frozen=True)
class PreparedData:
    """What training needs: the tokenizer, the train stream and one validation stream per domain."""

    tokenizer: PreTrainedTokenizerFast
    train_tokens: np.ndarray
    val_tokens: dict[str, np.ndarray]


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder/.lock`` for the duration of the block."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def encode_stream(tokenizer: PreTrainedTokenizerFast, docs: Sequence[Document]) -> np.ndarray:
    """Documents packed into one stream, each preceded by EOS (so EOS also ends the one before)."""
    eos = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    pieces = [np.array([eos, *enc.ids], dtype=TOKEN_DTYPE) for enc in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=TOKEN_DTYPE)


def save_array(path: Path, array: np.ndarray) -> None:
    """``np.save`` through a temporary file, so a killed run never leaves half an array."""
    tmp = path.with_name(path.stem + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def expected_meta(corpus_cfg: CorpusConfig, tok_cfg: TokenizerConfig) -> dict[str, Any]:
    """The part of ``meta.json`` that must match for the cache to be reused."""
    return {
        "cache_version": CACHE_VERSION,
        "corpus_config": asdict(corpus_cfg),
        "tokenizer_config": asdict(tok_cfg),
        "corpus_fingerprint": corpus_fingerprint(corpus_cfg),
    }


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else {}


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def get_tokenizer(data_dir: Path, corpus_cfg: CorpusConfig, tok_cfg: TokenizerConfig) -> Any:
    """Load the folder's tokenizer, or train one when there is none; refuse one made from other data."""
    folder, meta_path = data_dir / "tokenizer", data_dir / "meta.json"
    key = expected_meta(corpus_cfg, tok_cfg)
    if (folder / "tokenizer.json").is_file():
        meta = read_json(meta_path)
        if {k: meta.get(k) for k in key} != key:
            raise RuntimeError(
                f"{folder} was trained on another corpus or config than the one asked for; "
                "use a fresh --data-dir (target and draft must share one tokenizer)"
            )
        return load_tokenizer(folder)
    started = time.perf_counter()
    tokenizer = train_tokenizer((d.text for d in build_corpus(corpus_cfg).train), tok_cfg)
    tokenizer.save_pretrained(folder)
    print(f"trained tokenizer: {len(tokenizer)} tokens in {time.perf_counter() - started:.1f}s", flush=True)
    tokenizer_hash = file_sha256(folder / "tokenizer.json")
    write_json(meta_path, {**key, "tokenizer_sha256": tokenizer_hash, "vocab_size": len(tokenizer)})
    return load_tokenizer(folder)


def build_streams(tokenizer: PreTrainedTokenizerFast, corpus_cfg: CorpusConfig, data_dir: Path) -> dict:
    """Tokenize both splits into ``.npy`` files; return the token counts."""
    corpus = build_corpus(corpus_cfg)
    train_docs = list(corpus.train)
    random.Random(f"{corpus_cfg.seed}/stream-order").shuffle(train_docs)
    counts = {"train": int(encode_stream_to(data_dir / "train.npy", tokenizer, train_docs))}
    for domain in DOMAINS:
        docs = [d for d in corpus.validation if d.domain == domain]
        counts[f"val_{domain}"] = int(encode_stream_to(data_dir / f"val_{domain}.npy", tokenizer, docs))
    return counts


def encode_stream_to(path: Path, tokenizer: PreTrainedTokenizerFast, docs: Sequence[Document]) -> int:
    """Encode ``docs`` into ``path``; return the number of tokens."""
    stream = encode_stream(tokenizer, docs)
    save_array(path, stream)
    return len(stream)


def prepare_data(
    data_dir: Path, corpus_cfg: CorpusConfig | None = None, tok_cfg: TokenizerConfig | None = None
) -> PreparedData:
    """Build (or reuse) the tokenizer and token caches in ``data_dir`` and load them."""
    corpus_cfg, tok_cfg = corpus_cfg or CorpusConfig(), tok_cfg or TokenizerConfig()
    arrays = [data_dir / "train.npy", *(data_dir / f"val_{d}.npy" for d in DOMAINS)]
    with folder_lock(data_dir):
        tokenizer = get_tokenizer(data_dir, corpus_cfg, tok_cfg)
        meta = read_json(data_dir / "meta.json")
        tokenizer_hash = file_sha256(data_dir / "tokenizer" / "tokenizer.json")
        fresh = "tokens" in meta and meta.get("tokenizer_sha256") == tokenizer_hash and all(p.is_file() for p in arrays)
        if not fresh:
            started = time.perf_counter()
            counts = build_streams(tokenizer, corpus_cfg, data_dir)
            print(f"tokenized corpus: {counts} in {time.perf_counter() - started:.1f}s", flush=True)
            write_manifest(data_dir / "corpus_manifest.json", corpus_cfg)
            write_json(data_dir / "meta.json", {**meta, "tokenizer_sha256": tokenizer_hash, "tokens": counts})
    return PreparedData(
        tokenizer=tokenizer,
        train_tokens=np.load(data_dir / "train.npy"),
        val_tokens={d: np.load(data_dir / f"val_{d}.npy") for d in DOMAINS},
    )


def main(argv: list[str] | None = None) -> int:
    """Build the data folder and print its ``meta.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=CorpusConfig.seed, help="corpus seed")
    parser.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size)
    args = parser.parse_args(argv)
    prepare_data(args.data_dir, CorpusConfig(seed=args.seed), TokenizerConfig(vocab_size=args.vocab_size))
    print((args.data_dir / "meta.json").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
