"""Prompts tokenized with a cap: the tokenizer stops once a prompt is known to hold more than ``cap`` tokens, so the
work a prompt costs is bounded by the cap, not by the prompt's length.

**Exact.** The ids equal ``tokenizer(text, add_special_tokens=True)["input_ids"]`` whenever the prompt has at most
``cap`` tokens. A fast (Rust) tokenizer encodes in four steps: its added tokens are split out of the text (those
matched before normalizing first, then the others); each remaining part is normalized and pre-tokenized into pieces;
the model tokenizes each piece on its own; the post-processor adds its special tokens. This runs the same steps with
the tokenizer's own normalizer, pre-tokenizer and model, in order, and cuts a long BPE piece further at *hard
boundaries*: between two characters that no vocabulary entry holds side by side. A BPE merge only makes vocabulary
entries, so no merge crosses a hard boundary, and a piece's tokens are its parts' tokens in turn.

**Bound.** The pre-tokenizer reads the text in windows (``WINDOW_CHARS``; a window's last ``SETTLE`` pieces are read
again with the next), and the model runs on ``BATCH_CHARS`` of parts a call, off the GIL. A part of n characters is at
least ceil(n / L) tokens, L the longest vocabulary entry, and a part that would take the count past the cap by that
bound is not run. So the model runs over the characters of the first cap + 1 tokens and at most one batch more, the
pre-tokenizer over those and a window or two more; a single piece longer than a window (a run of letters without a
space) is read whole by the pre-tokenizer, then cut. Measured on an EPYC core, the reference tokenizer, a cap of
32,768: 199,000 random CJK characters (597,000 tokens) 0.39 s whole, 0.08 s capped; 200,000 characters of prose
(69,000 tokens) 0.09 s whole, 0.05 s capped.

**Which tokenizers.** ``CappedEncoder.of`` builds one for a fast tokenizer whose model is BPE without dropout, whose
unknown characters are never fused into one token (none are unknown with a byte fallback for all 256 bytes), and
whose added tokens neither strip spaces nor match whole words. It checks the result against the tokenizer itself on
probe texts, every cut taken and none, in windows of 1, 2 and ``WINDOW_CHARS`` characters; a pre-tokenizer that marks
the start of what it reads (a prefix space) reads each part whole instead. For any other tokenizer it returns None,
and the caller tokenizes whole prompts, bounded by their characters.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from tokenizers import Tokenizer

log = logging.getLogger("specd.decoder.tokenizing")

PART_CHARS = 2_048  # a piece longer than this is cut at its first hard boundary past each multiple of it
WINDOW_CHARS = 8_192  # the text is tokenized in windows of this many characters (or more: see _parts)
BATCH_CHARS = 16_384  # parts handed to the model in one call, in characters (it runs them without the GIL)
SETTLE = 2  # a window's last pieces, read again at the start of the next
GROWTH = 8  # a window with too few pieces grows this many times over (the text is read at most 8/7 times)
PROBES = (
    "",
    "a",
    " Hello, world!  How are you?\n\n\tFine.   ",
    "def f(x):\n    return x ** 2  # squared\n",
    "数据库系统的设计与实现，第二版。日本語のテキストも。",
    "emoji 🙂🚀 and accents: café naïve Zürich 1234567890 3.14159",
    "   leading and trailing spaces   ",
    "----------+----------  ==========  ##########",
    "mixed\u00a0non-breaking\u2028separators\r\nand CRLF",
)


class PromptTooLong(ValueError):
    """A prompt of more tokens than its cap (at least ``at_least``)."""

    def __init__(self, at_least: int, cap: int) -> None:
        super().__init__(f"at least {at_least} tokens, above the cap of {cap}")
        self.at_least, self.cap = at_least, cap


@dataclass(frozen=True)
class TooLong:
    """The prompt holds more than the cap: at least ``at_least`` tokens."""

    at_least: int


class CappedEncoder:
    """One tokenizer's capped encoding (see the module); built by ``of``."""

    def __init__(self, tokenizer: Any, part_chars: int = PART_CHARS, window: int | None = WINDOW_CHARS) -> None:
        backend = tokenizer.backend_tokenizer
        self._tokenizer = tokenizer
        self._normalizer = backend.normalizer
        self._pre_tokenizer = backend.pre_tokenizer
        self._model = backend.model
        self._model_only = Tokenizer(backend.model)  # the model alone: each input string is one piece
        self._pipeline = Tokenizer(backend.model)  # the pre-tokenizer and the model, for normalized text
        if backend.pre_tokenizer is not None:
            self._pipeline.pre_tokenizer = backend.pre_tokenizer
        self._part_chars = part_chars
        self.window = window  # None: each normalized part pre-tokenized whole
        vocab = backend.get_vocab(with_added_tokens=False)
        self._longest = max(len(entry) for entry in vocab)
        self._pairs: frozenset[str] | None = (
            frozenset(entry[i : i + 2] for entry in vocab for i in range(len(entry) - 1)) if _cuts_exact(self._model)
            else None
        )  # fmt: skip
        added = backend.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        self._raw_added = _alternation(t.content for t in added.values() if not t.normalized)
        self._normalized_added = _alternation(t.content for t in added.values() if t.normalized)
        self._prefix: list[int] = []
        self._suffix: list[int] = []

    @classmethod
    def of(cls, tokenizer: Any, part_chars: int = PART_CHARS, window: int = WINDOW_CHARS) -> CappedEncoder | None:
        """The capped encoding of ``tokenizer``, or None (with the reason logged) when this module cannot reproduce
        its encoding."""
        reason = _unsupported(tokenizer)
        if reason is None:
            encoder = cls(tokenizer, part_chars, window)
            reason = encoder._learn_specials()
            if reason is None and encoder._check((1, 3, 8, 24, window)) is not None:
                encoder.window = None  # a pre-tokenizer that reads a window's start as the text's (a prefix mark)
                reason = encoder._check((None,))
        if reason is not None:
            log.info("prompts are tokenized whole, not capped: %s", reason)
            return None
        return encoder

    def encode(self, text: str, cap: int) -> list[int] | TooLong:
        """``text``'s ids with the special tokens, or ``TooLong`` once it is known to hold more than ``cap``."""
        segments = list(self._segments(text))
        if self._at_most(segments) <= cap:  # the whole fits: one call
            ids = list(self._tokenizer(text, add_special_tokens=True)["input_ids"])
            return ids if len(ids) <= cap else TooLong(len(ids))
        return self._piecewise(segments, cap, self._part_chars, self.window)

    def _piecewise(
        self, segments: list[str | int], cap: int, part_chars: int, window: int | None
    ) -> list[int] | TooLong:
        """The segments' ids, the model run on up to ``BATCH_CHARS`` characters of parts a call, and on no part
        that would pass ``cap`` by its least count."""
        ids, after = list(self._prefix), len(self._suffix)
        batch: list[str] = []
        least = chars = 0  # the batch's tokens at least, and its characters

        def run_batch() -> None:
            nonlocal least, chars
            if batch:
                (done,) = self._model_only.encode_batch([batch], is_pretokenized=True, add_special_tokens=False)
                ids.extend(done.ids)
                batch.clear()
                least = chars = 0

        for segment in segments:
            if isinstance(segment, int):
                run_batch()
                ids.append(segment)
                continue
            for part in self._parts(segment, part_chars, window):
                if isinstance(part, list):  # a window's settled pieces, tokenized
                    run_batch()
                    ids.extend(part)
                    if len(ids) + after > cap:
                        return TooLong(len(ids) + after)
                    continue
                part_least = -(-len(part) // self._longest)
                if len(ids) + after + least + part_least > cap or chars + len(part) > BATCH_CHARS:
                    run_batch()
                    if len(ids) + after + part_least > cap:
                        return TooLong(len(ids) + after + part_least)
                batch.append(part)
                least, chars = least + part_least, chars + len(part)
        run_batch()
        ids.extend(self._suffix)
        return ids if len(ids) <= cap else TooLong(len(ids))

    def _at_most(self, segments: list[str | int]) -> int:
        """A bound on the tokens of a text split into ``segments``: a model token covers at least one character of
        a piece, or with byte fallback one byte of it; a piece's characters are at most its normalized bytes, one more
        where the pre-tokenizer prepends a mark, and a byte-fallback mark (3 bytes) stands for one byte."""
        per_byte = 3 if self._model.byte_fallback else 1
        text = sum(per_byte * (len(s.encode("utf-8")) + 1) for s in segments if isinstance(s, str))
        return len(self._prefix) + len(self._suffix) + text + sum(isinstance(s, int) for s in segments)

    def _segments(self, text: str) -> Iterator[str | int]:
        """The text in encoding order: an added token's id, or a normalized part between added tokens."""
        for raw in _split(text, self._raw_added, self._added_ids):
            if isinstance(raw, int):
                yield raw
                continue
            normalized = self._normalizer.normalize_str(raw) if self._normalizer is not None else raw
            yield from _split(normalized, self._normalized_added, self._added_ids)

    def _parts(self, normalized: str, part_chars: int, window: int | None) -> Iterator[str | list[int]]:
        """One normalized part for the model, in order: a window's settled pieces already tokenized (ids), or a
        piece (cut at hard boundaries when long) for the model to tokenize."""
        if self._pre_tokenizer is None:
            yield from self._cut(normalized, part_chars)
            return
        if window is None:
            for piece, _ in self._pre_tokenizer.pre_tokenize_str(normalized):
                yield from self._cut(piece, part_chars)
            return
        at, n = 0, len(normalized)
        while at < n:
            (done,) = self._pipeline.encode_batch([normalized[at : at + window]], add_special_tokens=False)
            words = cast(list[int], done.word_ids)  # a piece's index for each token (no special token here)
            if at + window >= n:
                yield done.ids
                return
            count = words[-1] + 1 if words else 0
            if count > SETTLE:
                first = len(words)
                while words[first - 1] >= count - SETTLE:
                    first -= 1
                yield done.ids[:first]
                span = done.word_to_chars(count - SETTLE)
                assert span is not None
                at += span[0]
                continue
            # a piece about as long as the window: found by the pre-tokenizer alone, then cut for the model
            size = window * GROWTH
            while True:
                pieces = self._pre_tokenizer.pre_tokenize_str(normalized[at : at + size])
                if at + size >= n or len(pieces) > SETTLE:
                    break
                size *= GROWTH
            settled = pieces if at + size >= n else pieces[:-SETTLE]
            for piece, _ in settled:
                yield from self._cut(piece, part_chars)
            if at + size >= n:
                return
            at += pieces[-SETTLE][1][0]

    def _cut(self, piece: str, part_chars: int) -> Iterator[str]:
        if not piece:
            return
        if self._pairs is None or len(piece) <= part_chars:
            yield piece
        else:
            yield from cut_at_hard_boundaries(piece, self._pairs, part_chars)

    def _learn_specials(self) -> str | None:
        """The post-processor's special tokens before and after a text's own, read from the tokenizer on probes."""
        shapes = set()
        for probe in ("a", "Hello world"):
            with_specials = list(self._tokenizer(probe, add_special_tokens=True)["input_ids"])
            plain = list(self._tokenizer(probe, add_special_tokens=False)["input_ids"])
            start = _find(with_specials, plain)
            if start < 0:
                return f"its special tokens do not wrap the text ({probe!r})"
            shapes.add((tuple(with_specials[:start]), tuple(with_specials[start + len(plain) :])))
        if len(shapes) != 1:
            return "its special tokens depend on the text"
        prefix, suffix = shapes.pop()
        self._prefix, self._suffix = list(prefix), list(suffix)
        return None

    def _check(self, windows: tuple[int | None, ...]) -> str | None:
        """None when this encoding equals the tokenizer's on every probe, with every hard boundary cut and none, in
        each of ``windows`` (None: the window this encoder reads in)."""
        contents = list(self._added_ids)
        probes = [*PROBES, *(f"x{c}y {c}{c} z{c}" for c in contents[:8])]
        for probe in probes:
            expected = list(self._tokenizer(probe, add_special_tokens=True)["input_ids"])
            for part_chars, window in itertools.product((1, 1 << 62), windows):
                got = self._uncapped(probe, part_chars, self.window if window is None else window)
                if got != expected:
                    return f"its encoding of {probe!r} is not reproduced ({got} against {expected})"
        return None

    def _uncapped(self, text: str, part_chars: int, window: int | None) -> list[int]:
        """The piecewise encoding, uncapped (never the whole-text shortcut)."""
        ids = self._piecewise(list(self._segments(text)), 1 << 62, part_chars, window)
        assert not isinstance(ids, TooLong)
        return ids


def cut_at_hard_boundaries(piece: str, pairs: frozenset[str], part_chars: int) -> Iterator[str]:
    """``piece`` in parts of at least ``part_chars`` characters (the last may be shorter), each cut at the first hard
    boundary (two characters no entry of ``pairs`` holds) at or past its length; a piece without one stays whole."""
    start, n = 0, len(piece)
    while n - start > part_chars:
        cut = start + part_chars
        while cut < n and piece[cut - 1 : cut + 1] in pairs:
            cut += 1
        if cut >= n:
            break
        yield piece[start:cut]
        start = cut
    yield piece[start:]


def _unsupported(tokenizer: Any) -> str | None:
    """Why this module cannot reproduce ``tokenizer``'s encoding, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "not a fast tokenizer"
    model = backend.model
    if type(model).__name__ != "BPE":
        return f"its model is {type(model).__name__}, not BPE"
    if model.dropout:
        return "its BPE drops merges at random (dropout)"
    vocab = backend.get_vocab(with_added_tokens=False)
    every_byte = model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if model.fuse_unk and model.unk_token and not every_byte:
        return "it fuses unknown characters into one token of any length"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"its added token {token.content!r} strips spaces or matches whole words"
    if not vocab:
        return "its vocabulary is empty"
    return None


def _cuts_exact(model: Any) -> bool:
    """Whether a piece may be cut at hard boundaries: no merge-free shortcut for a whole word in the vocabulary
    (``ignore_merges``), no prefix or suffix the model adds to a word's parts."""
    return not model.ignore_merges and not model.continuing_subword_prefix and not model.end_of_word_suffix


def _alternation(contents: Iterator[str] | Any) -> re.Pattern[str] | None:
    """A pattern matching the leftmost, then longest, of ``contents`` (the order added tokens are split out in)."""
    ordered = sorted({c for c in contents if c}, key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in ordered)) if ordered else None


def _split(text: str, pattern: re.Pattern[str] | None, ids: dict[str, int]) -> Iterator[str | int]:
    """``text`` with the matches of ``pattern`` given as their ids (empty text between them left out)."""
    if pattern is None:
        if text:
            yield text
        return
    at = 0
    for match in pattern.finditer(text):
        if match.start() > at:
            yield text[at : match.start()]
        yield ids[match.group()]
        at = match.end()
    if at < len(text):
        yield text[at:]


def _find(haystack: list[int], needle: list[int]) -> int:
    """Where ``needle`` starts in ``haystack`` (the first place), or -1."""
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return -1
