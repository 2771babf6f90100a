"""The text a draft is distilled on: documents read from files, split into train and held-out, packed to tokens.

Plain text files hold one document per paragraph (blank-line separated); ``.jsonl`` files hold one JSON
object per line with a "text" (or else "prompt") string field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd_api.errors import SpecdError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_FIELDS = ("text", "prompt")


class DataError(SpecdError):
    """A data file is missing, unreadable, or holds nothing to train on."""


@dataclass(frozen=True)
class Documents:
    train: list[str]
    heldout: list[str]


def read_documents(paths: Sequence[Path]) -> list[str]:
    """All documents in ``paths``, in order, exact duplicates dropped."""
    documents: list[str] = []
    for path in paths:
        if not path.is_file():
            raise DataError(f"data file {str(path)!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read data file {str(path)!r}: {e}") from None
        documents += read_jsonl(text, path) if path.suffix in JSONL_SUFFIXES else split_paragraphs(text)
    documents = list(dict.fromkeys(documents))
    if not documents:
        raise DataError(f"no text in the data files ({', '.join(map(str, paths))})")
    return documents


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def read_jsonl(text: str, path: Path) -> list[str]:
    """The "text" (or else "prompt") field of each JSON line."""
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON line ({e.msg})") from None
        value = next((record[f] for f in TEXT_FIELDS if isinstance(record, dict) and f in record), None)
        if not isinstance(value, str):
            raise DataError(f'{path}:{number}: expected an object with a "text" or "prompt" string field')
        if value.strip():
            documents.append(value)
    return documents


def split_documents(documents: Sequence[str], seed: int, heldout_fraction: float) -> Documents:
    """Hold out the last ``heldout_fraction`` of the documents ranked by a seeded hash (at least one).

    The split depends only on the documents and the seed, not on file order, so it is the same in every run.
    """
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents (one to train on, one held out), found {len(documents)}")

    def rank(i: int) -> bytes:
        return hashlib.sha256(f"{seed}\0{documents[i]}".encode()).digest()

    ranked = sorted(range(len(documents)), key=rank)
    num_heldout = min(len(documents) - 1, max(1, round(heldout_fraction * len(documents))))
    heldout = set(ranked[-num_heldout:])
    return Documents(
        train=[d for i, d in enumerate(documents) if i not in heldout],
        heldout=[d for i, d in enumerate(documents) if i in heldout],
    )


def pack(documents: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """One token stream, each document followed by the end-of-text token when the tokenizer has one.

    # returns [num_tokens] int64
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for document_ids in tokenizer(list(documents), add_special_tokens=False)["input_ids"]:
        ids += [*document_ids, *eos]
    return torch.tensor(ids, dtype=torch.long)
