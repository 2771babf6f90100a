"""Segment workloads: JSONL prompt sets, one prompt per line, and a typed loader that validates them.

Each line is ``{"id", "segment", "prompt", "max_new_tokens", "temperature"}``. A bad line is rejected with a
``ValueError`` that names the file, the line and the field: ``"code.jsonl:7: temperature: must be >= 0"``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "Prompt", "load_all", "load_workload", "parse_prompt"]


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: what to send and how to decode it."""

    id: str
    segment: str
    prompt: str
    max_new_tokens: int
    temperature: float


FIELDS: tuple[str, ...] = ("id", "segment", "prompt", "max_new_tokens", "temperature")
_TEXT_FIELDS: tuple[str, ...] = ("id", "segment", "prompt")


def _fail(where: str, field: str, reason: str) -> ValueError:
    return ValueError(f"{where}: {field}: {reason}")


def _is_number(value: Any) -> bool:
    """JSON numbers, but not booleans (``True`` is an ``int`` to Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_prompt(record: Any, where: str) -> Prompt:
    """Validate one decoded JSON value; ``where`` (``"file:line"``) prefixes every error."""
    if not isinstance(record, dict):
        raise _fail(where, "(line)", f"expected a JSON object, got {type(record).__name__}")
    for field in FIELDS:
        if field not in record:
            raise _fail(where, field, "missing field")
    for field in sorted(set(record) - set(FIELDS)):
        raise _fail(where, field, f"unknown field (allowed: {', '.join(FIELDS)})")
    for field in _TEXT_FIELDS:
        if not isinstance(record[field], str):
            raise _fail(where, field, f"must be a string, got {type(record[field]).__name__}")
        if not record[field]:
            raise _fail(where, field, "must not be empty")
    max_new_tokens = record["max_new_tokens"]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise _fail(where, "max_new_tokens", f"must be an integer, got {type(max_new_tokens).__name__}")
    if max_new_tokens <= 0:
        raise _fail(where, "max_new_tokens", f"must be positive, got {max_new_tokens}")
    temperature = record["temperature"]
    if not _is_number(temperature):
        raise _fail(where, "temperature", f"must be a number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise _fail(where, "temperature", f"must be a finite number >= 0, got {temperature}")
    return Prompt(
        id=record["id"],
        segment=record["segment"],
        prompt=record["prompt"],
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
    )


def _read_lines(path: Path, seen: dict[str, str]) -> list[Prompt]:
    """Parse ``path``; ``seen`` maps ids to where they were first defined and is updated in place."""
    prompts = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(where, "(line)", f"invalid JSON: {exc.msg} at column {exc.colno}") from None
            prompt = parse_prompt(record, where)
            if prompt.id in seen:
                raise _fail(where, "id", f"duplicate id {prompt.id!r} (first at {seen[prompt.id]})")
            seen[prompt.id] = where
            prompts.append(prompt)
    return prompts


def load_workload(path: str | Path) -> list[Prompt]:
    """The prompts of one JSONL file, in file order (blank lines are skipped; ids must be unique)."""
    return _read_lines(Path(path), {})


def load_all(folder: str | Path) -> dict[str, list[Prompt]]:
    """Every ``*.jsonl`` file of ``folder``, keyed by file stem (``code.jsonl`` -> ``"code"``).

    Ids must be unique across all the files, so results from several workloads can be joined by id.
    """
    paths = sorted(Path(folder).glob("*.jsonl"))
    if not paths:
        raise ValueError(f"{folder}: no .jsonl workload files")
    seen: dict[str, str] = {}
    return {path.stem: _read_lines(path, seen) for path in paths}
