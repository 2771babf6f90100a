"""Which of a policy's segment rules can never apply. Pure.

A segment takes the first rule whose ``match`` equals its name, else the first whose glob matches it
(``Policy.for_segment``). So a rule is dead (``dead_rules``) when:

- an earlier rule has the same ``match``;
- its ``match`` is a glob and an earlier glob matches every name it matches (``covers``): a glob never equals a
  segment name, since a name has no ``*``, ``?`` or ``[``;
- no segment name can match it: a name is 1 to 128 of ``A-Z a-z 0-9 _ . : / -`` (``specd_api.segments``).

``covers`` decides for globs of literals, ``?`` and ``*``; a glob with a character class (``[...]``) is covered only by
one that is the same text or ``*``-only, so a dead rule behind a class may go unreported, never a live one reported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

from specd_api.segments import SEGMENT_PATTERN

NAME_CHARS = re.compile(r"[A-Za-z0-9_.:/-]")
MAX_NAME = 128
GLOB_CHARS = frozenset("*?[")


def is_glob(match: str) -> bool:
    return any(c in GLOB_CHARS for c in match)


class Budget:
    """Steps ``covers`` may take over a whole policy: a hostile file of many long globs is checked in bounded time
    (past the budget, no more rules are reported dead; none is reported wrongly)."""

    def __init__(self, steps: int = 2_000_000) -> None:
        self.steps = steps

    def spend(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Spent


class _Spent(Exception):
    pass


def _literal_ends(glob: str) -> tuple[str, str]:
    """The literal text before the first and after the last wildcard."""
    first = min((glob.index(c) for c in GLOB_CHARS if c in glob), default=len(glob))
    last = max((glob.rindex(c) for c in GLOB_CHARS if c in glob), default=-1)
    return glob[:first], glob[last + 1 :]


def covers(general: str, specific: str, budget: Budget | None = None) -> bool:
    """Does every name ``specific`` (a glob) matches also match ``general``? True only when it does."""
    if general == specific or set(general) == {"*"}:
        return True
    if "[" in general or "[" in specific:
        return False
    (head_g, tail_g), (head_s, tail_s) = _literal_ends(general), _literal_ends(specific)
    if not (head_s.startswith(head_g) and tail_s.endswith(tail_g)):
        return False
    spend = (budget or Budget()).spend

    @cache
    def from_(i: int, j: int) -> bool:
        spend()
        if i == len(general):
            return j == len(specific)
        if general[i] == "*":  # absorbs nothing, or the specific glob's next piece (whatever that piece matches)
            return from_(i + 1, j) or (j < len(specific) and from_(i, j + 1))
        if j == len(specific) or specific[j] == "*":  # the specific side may end, or match any text, here
            return False
        if general[i] == "?" or general[i] == specific[j]:  # one character against one (a literal or "?")
            return (general[i] == "?" or specific[j] != "?") and from_(i + 1, j + 1)
        return False

    return from_(0, 0)


def unmatchable(match: str) -> str | None:
    """Why no segment name can match ``match``, or None."""
    if not is_glob(match):
        return None if re.fullmatch(SEGMENT_PATTERN, match) else f"no segment name equals it ({SEGMENT_PATTERN})"
    if "[" in match:
        return None
    literals = [c for c in match if c not in GLOB_CHARS]
    bad = next((c for c in literals if not NAME_CHARS.fullmatch(c)), None)
    if bad is not None:
        return f"no segment name holds {bad!r} ({SEGMENT_PATTERN})"
    if len(match) - match.count("*") > MAX_NAME:
        return f"it matches only names longer than {MAX_NAME} characters"
    return None


def dead_rules(matches: Sequence[str]) -> dict[int, str]:
    """The rules (by index in ``matches``, in order) that can never apply, each with why."""
    dead: dict[int, str] = {}
    first: dict[str, int] = {}
    by_head: dict[str, list[int]] = {}  # earlier globs by their literal head: a cover's head begins the covered's
    budget = Budget()
    for index, match in enumerate(matches):
        why = unmatchable(match)
        if why is None and match in first:
            why = f"segments[{first[match]}] has the same match, and the first wins"
        if why is None and is_glob(match) and budget.steps > 0:
            head = _literal_ends(match)[0]
            candidates = sorted(g for n in range(len(head) + 1) for g in by_head.get(head[:n], ()))
            try:
                shadow = next((g for g in candidates if covers(matches[g], match, budget)), None)
            except _Spent:
                shadow = None
            if shadow is not None:
                why = f"segments[{shadow}] (match {matches[shadow]!r}) matches every name it does, and comes first"
        if why is not None:
            dead[index] = why
        first.setdefault(match, index)
        if is_glob(match):
            by_head.setdefault(_literal_ends(match)[0], []).append(index)
    return dead
