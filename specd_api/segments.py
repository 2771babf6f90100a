"""Segment names: validated so that no input can address another Redis key or blow up the keyspace."""

from __future__ import annotations

import re

MAX_SEGMENT_LENGTH = 128
OVERFLOW_SEGMENT = "_overflow"  # where traffic of segments beyond the cap is counted
SEGMENT_PATTERN = r"^[A-Za-z0-9_.:/-]{1,128}$"  # the same rule as a regular expression (for pydantic fields)
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.:/-]+")


def validate_segment(name: str) -> str:
    """Return ``name`` if it is a usable segment label; raise ValueError naming the problem."""
    if not name:
        raise ValueError("segment must not be empty")
    if len(name) > MAX_SEGMENT_LENGTH:
        raise ValueError(f"segment is {len(name)} characters long; at most {MAX_SEGMENT_LENGTH} are allowed")
    if not _SEGMENT_RE.fullmatch(name):
        raise ValueError(f"segment {name[:64]!r} has characters outside [A-Za-z0-9_.:/-]")
    return name


def valid_segment(name: str) -> bool:
    """Is ``name`` a usable segment label (``validate_segment`` without the message)?"""
    return 0 < len(name) <= MAX_SEGMENT_LENGTH and _SEGMENT_RE.fullmatch(name) is not None
