"""The per-segment cache of recent outputs that suffix decoding proposes from: one per worker process.

Each segment has a suffix trie over the outputs the worker served it (``add``, when a request finishes and its
output may be shared). Memory is bounded in bytes, counted as the tries' nodes times a fixed per-node cost plus the
outputs' tokens (kept so an output can be taken out again); the bound holds after every ``add``:

* a segment holds at most ``max_segment_share`` of the bytes: past it, its own oldest outputs go first, so one busy
  segment cannot push every other segment's outputs out;
* the cache holds at most ``cache_bytes``: past it, the oldest output of the segment holding the most bytes goes,
  so segments that flood the cache lose their own outputs, and a segment holding less than any other keeps its own
  (two segments at their share cannot push a third out);
* an output longer than a segment's share could ever hold is cut to what it can hold.

Thread safety: ``add`` runs where requests finish (the worker's event loop), ``continuation`` on the decode thread.
Reads and writes share one lock, and ``add`` takes it per chunk of the output, so a round never waits for a whole
output's insertion (8 ms for 512 novel tokens here), only for one chunk's (0.5 ms).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from decoder.drafters.suffix_trie import NO_CONTINUATION, Continuation, SuffixTrie

# Bytes charged per trie node: measured ~120 (flat arrays and one dict entry with its int key and value); the bound
# is checked with tracemalloc in tests/decoder/test_suffix.py.
NODE_BYTES = 160
TOKEN_BYTES = 4  # an output's tokens, kept (array 'i') to remove it again
TRIE_BYTES = 2048  # a segment's trie before any node (its arrays, dict and bookkeeping)
CHUNK_STARTS = 32  # suffixes inserted or removed per hold of the lock


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding's settings, parsed once (decoder/worker/config.py ``suffix``) and passed in."""

    depth: int = 16  # tokens per trie path: the longest match, and the span a proposal re-anchors at
    min_probability: float = 0.1  # a proposal ends where its path's observed frequency falls under this
    max_tokens_per_match_token: float = 1.0  # at most this many proposed tokens per matched token
    own_window: int = 2048  # tokens of the request's own text it indexes: the prompt's tail, then the whole output
    cache_bytes: int = 64 << 20  # the per-worker cache of outputs (0: none, proposals from the request alone)
    max_segment_share: float = 0.5  # of cache_bytes, the most one segment's outputs may hold

    def __post_init__(self) -> None:
        if self.depth < 2:
            raise ValueError(f"suffix depth must be >= 2, got {self.depth}")
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"suffix min_probability must be in [0, 1], got {self.min_probability}")
        if self.max_tokens_per_match_token <= 0:
            raise ValueError(f"suffix max_tokens_per_match_token must be > 0, got {self.max_tokens_per_match_token}")
        if self.own_window < 1 or self.cache_bytes < 0:
            raise ValueError("suffix own_window must be >= 1 and cache_bytes >= 0")
        if not 0.0 < self.max_segment_share <= 1.0:
            raise ValueError(f"suffix max_segment_share must be in (0, 1], got {self.max_segment_share}")


@dataclass(frozen=True)
class CachedOutput:
    segment: str
    tokens: array  # array('i')


@dataclass(frozen=True)
class CacheStats:
    outputs: int
    bytes: int
    segments: int


class SuffixCache:
    """Per-segment suffix tries over recent outputs, within ``config.cache_bytes``."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._tries: dict[str, SuffixTrie] = {}
        self._tokens: dict[str, int] = {}  # per segment: tokens of the outputs it holds
        self._outputs: OrderedDict[int, CachedOutput] = OrderedDict()  # oldest first
        self._by_segment: dict[str, deque[int]] = {}  # per segment: its outputs' ids, oldest first
        self._next_id = 0
        self._bytes = 0  # the sum of ``segment_bytes`` over the segments
        self._lock = threading.Lock()  # the tries and the byte count: readers and each chunk of a writer
        self._writing = threading.Lock()  # one writer at a time (an add and its evictions)

    @property
    def segment_cap(self) -> int:
        return int(self.config.cache_bytes * self.config.max_segment_share)

    @property
    def max_output_tokens(self) -> int:
        """The longest output a segment's share can hold whatever its text (each token adds at most depth nodes)."""
        per_token = self.config.depth * NODE_BYTES + TOKEN_BYTES
        return max(self.segment_cap - TRIE_BYTES, 0) // per_token

    @property
    def bytes(self) -> int:
        return self._bytes

    def segment_bytes(self, segment: str) -> int:
        trie = self._tries.get(segment)
        if trie is None:
            return 0
        return TRIE_BYTES + trie.nodes * NODE_BYTES + self._tokens[segment] * TOKEN_BYTES

    def stats(self) -> CacheStats:
        return CacheStats(len(self._outputs), self._bytes, len(self._tries))

    def outputs(self) -> list[CachedOutput]:
        """The outputs held, oldest first."""
        with self._lock:
            return list(self._outputs.values())

    def add(self, segment: str, tokens: Sequence[int]) -> None:
        """Remember ``tokens``, an output served to ``segment``, evicting outputs past the bounds."""
        kept = array("i", tokens[: self.max_output_tokens])
        if not kept:
            return
        with self._writing:
            self._insert(segment, kept)
            while self.segment_bytes(segment) > self.segment_cap:
                self._evict(self._by_segment[segment][0])
            while self._bytes > self.config.cache_bytes:
                largest = max(self._by_segment, key=self.segment_bytes)
                self._evict(self._by_segment[largest][0])

    def continuation(self, segment: str, text: Sequence[int], k: int) -> Continuation:
        """What ``segment``'s outputs most often continued the longest match of ``text``'s suffix with."""
        c = self.config
        with self._lock:
            trie = self._tries.get(segment)
            if trie is None:
                return NO_CONTINUATION
            return trie.continuation(text, k, c.min_probability, c.max_tokens_per_match_token)

    def _insert(self, segment: str, tokens: array) -> None:
        with self._lock:
            trie = self._tries.get(segment)
            if trie is None:
                trie = self._tries[segment] = SuffixTrie(self.config.depth)
                self._tokens[segment] = 0
                self._by_segment[segment] = deque()
                self._bytes += TRIE_BYTES
            self._outputs[self._next_id] = CachedOutput(segment, tokens)
            self._by_segment[segment].append(self._next_id)
            self._next_id += 1
            self._tokens[segment] += len(tokens)
            self._bytes += len(tokens) * TOKEN_BYTES
        for first in range(0, len(tokens), CHUNK_STARTS):
            with self._lock:
                before = trie.nodes
                trie.insert(tokens, range(first, min(first + CHUNK_STARTS, len(tokens))))
                self._bytes += (trie.nodes - before) * NODE_BYTES

    def _evict(self, output_id: int) -> None:
        output = self._outputs[output_id]
        segment, tokens = output.segment, output.tokens
        trie = self._tries[segment]
        for first in range(0, len(tokens), CHUNK_STARTS):
            with self._lock:
                before = trie.nodes
                trie.remove(tokens, range(first, min(first + CHUNK_STARTS, len(tokens))))
                self._bytes -= (before - trie.nodes) * NODE_BYTES
        with self._lock:
            del self._outputs[output_id]
            self._by_segment[segment].remove(output_id)  # the oldest of its segment: the deque's head
            self._tokens[segment] -= len(tokens)
            self._bytes -= len(tokens) * TOKEN_BYTES
            if not self._by_segment[segment]:
                assert trie.nodes == 0, "a segment without outputs kept trie nodes"
                del self._tries[segment], self._tokens[segment], self._by_segment[segment]
                self._bytes -= TRIE_BYTES
