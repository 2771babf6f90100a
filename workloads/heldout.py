"""Held-out workloads (``workloads/heldout/*.jsonl``): segments the controller has never seen, from text sources the
shipped workloads do not use, to measure adaptation on new traffic (docs/BENCHMARKS.md).

``python -m workloads.heldout`` writes the files; ``--check`` exits 1 when the committed ones differ. Sources, both
in every Python 3.11 install and outside the reference models' training corpus (which skips ``idlelib``), checked
against its training split like the shipped workloads:

- ``ide-code``: IDLE's own Python sources (``idlelib/*.py``), cut inside a function as the ``code`` segment is (the
  shipped ``code`` prompts come from the corpus's validation files); greedy.
- ``release-notes``: IDLE's release notes and plain-text documents (``NEWS.txt``, ``NEWS2x.txt``, ``HISTORY.txt``,
  ``README.txt``, ``TODO.txt``), passages ending mid-sentence as the ``prose`` segment's are (the shipped ``prose``
  prompts come from IDLE's HTML help page); greedy and T 0.8 alternating, as ``prose``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from refmodels.corpus import Document
from workloads import Prompt
from workloads.build import (
    HELP_HTML,
    PROSE_TEMPERATURES,
    TrainingIndex,
    code_streams,
    interleave,
    passages,
    render,
    take,
    training_index,
    write_or_check,
)

HELD_OUT_FOLDER = Path(__file__).resolve().parent / "heldout"
IDLELIB = HELP_HTML.parent
PROMPTS_PER_SEGMENT = 24
MAX_NEW_TOKENS = 96
SEED = 2026
NOTES = ("NEWS.txt", "NEWS2x.txt", "HISTORY.txt", "README.txt", "TODO.txt")
SEGMENTS = ("ide-code", "release-notes")


def idle_sources() -> list[Document]:
    """IDLE's Python files (its tests aside), in name order."""
    files = sorted(p for p in IDLELIB.glob("*.py") if not p.name.startswith("test"))
    return [Document(f"idlelib/{p.name}", "code", p.read_text(encoding="utf-8")) for p in files]


def notes_stream(rng: random.Random) -> Iterator[str]:
    """Passages of IDLE's plain-text documents, document by document."""
    for name in NOTES:
        yield from passages((IDLELIB / name).read_text(encoding="utf-8"), rng)


def build_segment(segment: str, index: TrainingIndex) -> list[Prompt]:
    def accept(prompt: str) -> bool:
        return not index.overlaps(prompt)

    rng = random.Random(f"{SEED}/{segment}")
    if segment == "ide-code":
        texts = take(interleave(*code_streams(idle_sources(), rng, accept)), PROMPTS_PER_SEGMENT, segment)
    else:
        texts = take(filter(accept, notes_stream(rng)), PROMPTS_PER_SEGMENT, segment)
    return [
        Prompt(f"{segment}-{i:03d}", segment, text, MAX_NEW_TOKENS,
               PROSE_TEMPERATURES[i % len(PROSE_TEMPERATURES)] if segment == "release-notes" else 0.0)
        for i, text in enumerate(texts)
    ]  # fmt: skip


def build_files(index: TrainingIndex | None = None) -> dict[str, str]:
    index = index or training_index()
    return {f"{segment}.jsonl": render(build_segment(segment, index)) for segment in SEGMENTS}


def main(argv: list[str] | None = None) -> int:
    """Write the held-out workload files, or with ``--check`` report the ones that differ (exit 1)."""
    return write_or_check(argv, __doc__, HELD_OUT_FOLDER, build_files, "workloads.heldout")


if __name__ == "__main__":
    raise SystemExit(main())
