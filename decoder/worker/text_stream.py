"""Incremental detokenization for streaming: text deltas that concatenate to exactly the final text.

Byte-level BPE can split a character across tokens, and a stop string can arrive in pieces, so a delta
holds back a trailing replacement character and any tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from decoder.request_stop import trim_stop_string


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop_strings: tuple[str, ...]) -> None:
        self.decode = decode
        self.stop_strings = stop_strings
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, new_tokens: Sequence[int]) -> str:
        """Add a step's tokens; return the text that is now safe to send."""
        self.tokens.extend(new_tokens)
        if not new_tokens:
            return ""
        text = trim_stop_string(self.decode(self.tokens), self.stop_strings)
        safe = len(text.rstrip("\ufffd"))
        for stop in self.stop_strings:  # a tail that is a prefix of a stop string may yet be cut
            for size in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - size : safe] == stop[:size]:
                    safe -= size
                    break
        return self._advance(text[:safe])

    def finish(self, final_text: str) -> str:
        """The rest, once the request is done and its final text known."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
