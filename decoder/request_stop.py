"""When a request is finished: EOS, stop strings, max_new_tokens. Nothing past them is ever emitted.

This is the request's stop (``StopConditions``), not the glossary's stop rule, which ends one round's draft early
(``decoder/drafters/draft_model.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopConditions:
    """What ends a request: its token budget, its EOS ids and its stop strings."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")


def draft_budget(context_length: int, num_generated: int, rules: StopConditions, max_context: int | None) -> int:
    """The most tokens the next round may draft: it emits up to K + 1 tokens, which may neither overshoot
    max_new_tokens nor the model's context (prompt + output must fit, as transformers' own generate() requires),
    so K <= remaining budget - 1 and L + K + 1 <= max_context."""
    k = rules.max_new_tokens - num_generated - 1
    if max_context is not None:
        k = min(k, max_context - context_length - 1)
    return max(k, 0)


@dataclass(frozen=True, slots=True)
class Cut:
    """How many of a round's new tokens to keep, and why generation ends (None: it goes on)."""

    keep: int
    finish_reason: str | None  # "stop" (EOS or stop string) | "length" | None


def cut_round(
    generated: Sequence[int],
    new_tokens: Sequence[int],
    rules: StopConditions,
    decode: Callable[[Sequence[int]], str],
) -> Cut:
    """Decide how many of ``new_tokens`` (appended after ``generated``) to keep.

    EOS is kept (as transformers does) and ends the request; a stop string ends it at the token that
    completes it; the budget ends it at max_new_tokens.
    """
    keep = len(new_tokens)
    reason: str | None = None
    for i, token in enumerate(new_tokens):
        if token in rules.eos_token_ids:
            keep, reason = i + 1, "stop"
            break
    budget = rules.max_new_tokens - len(generated)
    if keep > budget:  # the budget runs out first (an EOS beyond it is never emitted)
        keep, reason = budget, "length"
    elif keep == budget and reason is None:
        reason = "length"
    if rules.stop_strings:
        stop_at = _first_stop_string_end(generated, new_tokens[:keep], rules.stop_strings, decode)
        if stop_at is not None:
            keep, reason = stop_at, "stop"
    return Cut(keep, reason)


def _first_stop_string_end(
    generated: Sequence[int],
    new_tokens: Sequence[int],
    stop_strings: tuple[str, ...],
    decode: Callable[[Sequence[int]], str],
) -> int | None:
    """The number of new tokens up to and including the one that completes a stop string, if any."""
    head = _lookback(generated, max(len(s) for s in stop_strings), decode)
    if not any(s in decode(head + list(new_tokens)) for s in stop_strings):
        return None
    for i in range(1, len(new_tokens) + 1):
        if any(s in decode(head + list(new_tokens[:i])) for s in stop_strings):
            return i
    return None  # pragma: no cover - the full text matched, so some prefix does


def _lookback(generated: Sequence[int], chars: int, decode: Callable[[Sequence[int]], str]) -> list[int]:
    """The fewest trailing tokens of ``generated`` whose text has ``chars`` characters, plus one for a character
    cut at the window's start: enough to catch a stop string that began before the new tokens. Counted in
    decoded characters, not tokens, since a token may carry part of a character (byte-level BPE) or none
    (a skipped special token)."""
    n = chars + 1
    while n < len(generated) and len(decode(generated[-n:])) < chars + 1:
        n *= 2
    return list(generated[-n:])


def trim_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    """The text before the first stop string (stop strings are not part of the returned text)."""
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[: min(cuts)] if cuts else text
