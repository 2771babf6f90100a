"""The graphs pass's buckets: which captured shape runs a pass, and how a pass outside them is split (pure).

A bucket is (batch, width): up to ``batch`` sequences (one of ``BATCH_BUCKETS``), each appending up to ``width``
tokens (1..K_max+1: a decode step is width 1, a verification of K drafts width K+1). Rows of a pass are padded up
to its bucket: a sequence with fewer tokens than the width, and the empty sequences up to the batch, run on the
pool's scratch slot (decoder/runners/graphed.py), so every step of a bucket has the same shapes and one captured
CUDA graph serves it.

A pass outside the buckets (a prefill longer than K_max+1 tokens, more than the largest batch) is split into
bucket-shaped steps (``plan_steps``): each row's tokens in pieces of at most K_max+1, piece j of every row in the
j-th group of steps, at most ``BATCH_BUCKETS[-1]`` rows a step. A token's logits do not depend on what shares its
step (the pass's fixed tiles), so the split changes no bit; it is counted by reason (``OUTSIDE_REASONS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_K_MAX = 8
WIDE_ROWS = "wide_rows"  # a row of more than K_max+1 tokens (a prefill): split into pieces
MANY_ROWS = "many_rows"  # more rows than the largest batch bucket: split into groups
OUTSIDE_REASONS = (WIDE_ROWS, MANY_ROWS)


@dataclass(frozen=True, order=True)
class Bucket:
    """One captured shape: ``batch`` sequences of ``width`` tokens each (padding included)."""

    batch: int
    width: int

    def rows(self, tile: int) -> int:
        """Token rows of a step, padded to whole tiles of ``tile`` rows."""
        return -(-self.batch * self.width // tile) * tile


@dataclass(frozen=True)
class Piece:
    """Tokens ``first .. first + count`` of row ``row`` of a pass."""

    row: int
    first: int
    count: int


@dataclass(frozen=True)
class Step:
    """One bucket-shaped step of a pass: its pieces (at most ``bucket.batch``, each at most ``bucket.width``)."""

    bucket: Bucket
    pieces: tuple[Piece, ...]


def batch_bucket(batch: int) -> int | None:
    """The smallest batch bucket holding ``batch`` sequences; None above the largest."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def bucket_for(batch: int, width: int, k_max: int) -> Bucket | None:
    """The bucket of a pass of ``batch`` sequences whose widest appends ``width`` tokens; None outside them."""
    assert batch >= 1 and width >= 1 and k_max >= 0, (batch, width, k_max)
    padded = batch_bucket(batch)
    if padded is None or width > k_max + 1:
        return None
    return Bucket(padded, width)


def all_buckets(k_max: int, max_batch: int = BATCH_BUCKETS[-1]) -> list[Bucket]:
    """Every bucket a pool of ``max_batch`` sequences can use (what ``capture_all`` captures)."""
    top = batch_bucket(min(max_batch, BATCH_BUCKETS[-1])) or BATCH_BUCKETS[-1]
    return [Bucket(b, w) for b in BATCH_BUCKETS if b <= top for w in range(1, k_max + 2)]


def outside_reasons(counts: Sequence[int], k_max: int) -> tuple[str, ...]:
    """Why a pass whose rows append ``counts`` tokens is outside the buckets (empty: inside)."""
    reasons = []
    if max(counts) > k_max + 1:
        reasons.append(WIDE_ROWS)
    if len(counts) > BATCH_BUCKETS[-1]:
        reasons.append(MANY_ROWS)
    return tuple(reasons)


def plan_steps(counts: Sequence[int], k_max: int) -> list[Step]:
    """The bucket-shaped steps that run a pass whose row i appends ``counts[i]`` tokens, in order: one step when
    the pass fits a bucket; else piece j (tokens j*(K_max+1)...) of every row that has one, in groups of at most
    the largest batch bucket, after every piece j-1 (a piece attends to the ones before it)."""
    assert counts and min(counts) >= 1, counts
    width = k_max + 1
    largest = BATCH_BUCKETS[-1]
    steps = []
    for first in range(0, max(counts), width):
        pieces = [Piece(row, first, min(width, n - first)) for row, n in enumerate(counts) if n > first]
        for group in range(0, len(pieces), largest):
            members = tuple(pieces[group : group + largest])
            bucket = bucket_for(len(members), max(p.count for p in members), k_max)
            assert bucket is not None, (len(members), k_max)
            steps.append(Step(bucket, members))
    return steps
