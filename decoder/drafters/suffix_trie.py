"""Suffix tries of bounded depth over token ids, with occurrence counts: the structures suffix decoding reads.

Every substring of at most ``depth`` tokens of the text put in is a path from the root, and each node counts the
occurrences of its string. Two questions are answered (``continuation``):

* the longest match: the longest suffix of the text so far that occurred before *and was followed by a token*;
* its most frequent continuation: from the match, the child seen most often, then its most often seen child, and so
  on, with the observed frequency of each step, ``count(child) / sum(count(children))``, multiplied along the way.

A suffix of a string that was followed by a token was followed by it too, so "has a continuation" is monotone in the
match length and the longest match is found by binary search. Where a walk reaches the depth bound (a node there has
no children by construction, not because the text ended) it re-anchors on the longest suffix of the walked path that
has a continuation, so a proposal can be longer than ``depth`` allows a single path to be.

Two tries share the node store (``TrieNodes``: flat arrays, a node is an index, its children a doubly linked list,
one dict maps (node, token) to the child; about 120 bytes a node, where a node object with a dict of children takes
300):

* ``SuffixTrie``, of many sequences that come and go (the worker's cache of outputs): every substring is a node
  (``depth`` nodes a novel token); ``remove`` takes a sequence out again (a node whose count reaches 0 is freed with
  the rest of that path, its only descendants);
* ``TextSuffixTrie``, of one text that only grows (a request's own): a string seen once is a leaf that points into
  the text, so novel text costs one or two nodes a token, on the decode thread's time.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
NIL = -1
TOKEN_SPAN = 1 << 24  # token ids are below this (the largest vocabularies hold ~2**18): edge key = node * span + token


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a trie proposes after a text: ``tokens`` and, per token, the observed frequency of the path up to it."""

    tokens: tuple[int, ...] = ()
    probabilities: tuple[float, ...] = ()  # non-increasing: products of per-step frequencies
    match_length: int = 0  # tokens of the text's suffix that matched (0: none)

    @property
    def score(self) -> float:
        """Expected accepted tokens if each step's frequency were its acceptance: the sum of the path probabilities."""
        return sum(self.probabilities)


NO_CONTINUATION = Continuation()


@dataclass(frozen=True, slots=True)
class Limits:
    """When a proposal stops: ``k`` tokens; the path's frequency under ``min_probability``; more than
    ``per_match_token`` tokens per matched token."""

    k: int
    min_probability: float
    per_match_token: float


class TrieNodes:
    """The node store of a trie of bounded ``depth``: counts, tokens, children lists, the edge map."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2 (a match and a token after it), got {depth}")
        self.depth = depth
        self._edges: dict[int, int] = {}  # node * TOKEN_SPAN + token -> child
        self._count = array("i", [0])  # occurrences of the node's string
        self._token = array("i", [NIL])  # the token on the edge into the node
        self._parent = array("i", [NIL])
        self._first = array("i", [NIL])  # first child (the newest)
        self._next = array("i", [NIL])  # next sibling (older)
        self._prev = array("i", [NIL])  # previous sibling (newer)
        self._free: list[int] = []  # freed node ids, reused first
        self.nodes = 0  # live nodes, the root not counted

    def _new_child(self, node: int, token: int) -> int:
        """A new node for ``token`` under ``node`` (count 0), first among its siblings: among equal counts the newest
        wins."""
        assert 0 <= token < TOKEN_SPAN, f"token id {token} outside 0..{TOKEN_SPAN - 1}"
        head = self._first[node]
        if self._free:
            child = self._free.pop()
            self._count[child], self._token[child], self._parent[child] = 0, token, node
            self._first[child], self._next[child], self._prev[child] = NIL, head, NIL
        else:
            child = len(self._count)
            self._count.append(0)
            self._token.append(token)
            self._parent.append(node)
            self._first.append(NIL)
            self._next.append(head)
            self._prev.append(NIL)
        if head != NIL:
            self._prev[head] = child
        self._first[node] = child
        self._edges[node * TOKEN_SPAN + token] = child
        self.nodes += 1
        return child

    def _most_frequent_child(self, node: int) -> tuple[int, float]:
        """The child with the highest count (ties: the newest), and its share of the children's counts."""
        best, best_count, total = NIL, 0, 0
        child = self._first[node]
        while child != NIL:
            count = self._count[child]
            total += count
            if count > best_count:
                best, best_count = child, count
            child = self._next[child]
        return best, (best_count / total if total else 0.0)


class SuffixTrie(TrieNodes):
    """Substrings of at most ``depth`` tokens of the sequences put in, with occurrence counts."""

    def insert(self, tokens: Sequence[int], starts: range | None = None) -> None:
        """Count every substring of ``tokens`` of at most ``depth`` tokens (a whole sequence, e.g. one output); with
        ``starts``, only those that start there (an insertion in parts)."""
        edges, count, depth = self._edges, self._count, self.depth
        for start in range(len(tokens)) if starts is None else starts:
            node = ROOT
            for token in tokens[start : start + depth]:
                child = edges.get(node * TOKEN_SPAN + token, NIL)
                if child == NIL:
                    child = self._new_child(node, token)
                count[child] += 1
                node = child

    def remove(self, tokens: Sequence[int], starts: range | None = None) -> None:
        """Undo ``insert(tokens, starts)`` (the same tokens must have been inserted): counts go down, nodes at 0 are
        freed."""
        for start in range(len(tokens)) if starts is None else starts:
            node = ROOT
            path = tokens[start : start + self.depth]
            for i, token in enumerate(path):
                child = self._edges[node * TOKEN_SPAN + token]
                self._count[child] -= 1
                if self._count[child] == 0:
                    self._free_path(child, path[i + 1 :])
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> int:
        """The node of the string ``tokens``, or NIL when it never occurred (or is longer than ``depth``)."""
        node = ROOT
        for token in tokens:
            node = self._edges.get(node * TOKEN_SPAN + token, NIL)
            if node == NIL:
                return NIL
        return node

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of the string ``tokens`` (0 when it never occurred)."""
        node = self.find(tokens)
        return self._count[node] if node != NIL else 0

    def match(self, text: Sequence[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of ``text`` that occurred followed by a token; (ROOT, 0) if none."""
        low, high = 0, min(len(text), self.depth - 1)  # a suffix of length ``low`` continues; longer ones: unknown
        best = self.find(text[len(text) - high :]) if high else NIL
        if best != NIL and self._first[best] != NIL:  # the longest possible: most rounds of a repeated text
            return best, high
        best, high = ROOT, high - 1
        while low < high:
            length = (low + high + 1) // 2
            node = self.find(text[len(text) - length :])
            if node != NIL and self._first[node] != NIL:
                low, best = length, node
            else:
                high = length - 1
        return best, low

    def continuation(
        self, text: Sequence[int], k: int, min_probability: float, max_tokens_per_match_token: float
    ) -> Continuation:
        """Up to ``k`` tokens that most often followed the longest match of ``text``'s suffix, while the path's
        frequency stays at least ``min_probability`` and the number of tokens at most ``max_tokens_per_match_token``
        times the match length."""
        node, length = self.match(text)
        k = min(k, int(length * max_tokens_per_match_token))
        if length == 0 or k <= 0:
            return NO_CONTINUATION
        tokens: list[int] = []
        probabilities: list[float] = []
        probability, depth = 1.0, length
        count, first, next_sibling = self._count, self._first, self._next  # (locals: this loop is the hot path)
        while len(tokens) < k:
            if depth == self.depth:  # the bound, not the end of the text: go on from the longest suffix that continues
                path = [*text[len(text) - length :], *tokens][-(self.depth // 2) :]  # (half: re-anchor less often)
                node, depth = self.match(path)
                if depth == 0:
                    break
            # The most frequent child (ties: the newest, listed first), and its share of the children's counts.
            best, best_count, total = NIL, 0, 0
            child = first[node]
            while child != NIL:
                total += count[child]
                if count[child] > best_count:
                    best, best_count = child, count[child]
                child = next_sibling[child]
            if best == NIL:
                break
            probability *= best_count / total
            if probability < min_probability:
                break
            tokens.append(self._token[best])
            probabilities.append(probability)
            node, depth = best, depth + 1
        return Continuation(tuple(tokens), tuple(probabilities), length)

    def _free_path(self, node: int, below: Sequence[int]) -> None:
        """Free ``node``, whose count reached 0, and the path ``below`` it. Its count was 1, so was every descendant's
        (a string occurs at least as often as any longer one), and that one occurrence is the path being removed: it
        has no other descendants, and each one below it is its parent's only child."""
        parent, prev, nxt = self._parent[node], self._prev[node], self._next[node]
        if prev != NIL:
            self._next[prev] = nxt
        else:
            self._first[parent] = nxt
        if nxt != NIL:
            self._prev[nxt] = prev
        doomed = [node]
        for token in below:
            doomed.append(self._edges[doomed[-1] * TOKEN_SPAN + token])
        for gone in doomed:
            del self._edges[self._parent[gone] * TOKEN_SPAN + self._token[gone]]
            self._count[gone], self._first[gone] = 0, NIL
            self._free.append(gone)
        self.nodes -= len(doomed)


Position = tuple[int, int]  # (node, extra): ``extra`` tokens of the text below a leaf; (node, 0) is the node itself


class TextSuffixTrie(TrieNodes):
    """The suffix trie of one text that only grows (a request's own), built as it grows, with what occurred once left
    in the text: a string seen once is a leaf that remembers where it ended, and what follows it is read from the
    text. A string gets its node the moment it occurs a second time; then its earlier occurrence's continuation
    becomes its child. Novel text costs one or two nodes a token instead of ``depth`` (the eager trie's 15 us a token
    here is most of a round's drafting time). Counts and proposals are ``SuffixTrie``'s with the whole text inserted
    (tests/decoder/test_suffix.py compares them)."""

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.text: list[int] = []
        self._end = array("i", [0])  # per node: where its latest occurrence ended in the text (the index after it)
        self._suffixes: list[int] = []  # nodes of the text's suffixes (lengths 1.., each seen twice, or just made)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the text."""
        edges, count, end, text = self._edges, self._count, self._end, self.text
        for token in tokens:
            i = len(text)
            text.append(token)
            grown: list[int] = []
            suffixes = (ROOT, *self._suffixes[: self.depth - 1])
            # Longest first: a suffix's count is read before this token's shorter suffixes raise it (where the text
            # overlaps itself, as in "a a", a shorter suffix's earlier occurrence is this longer one).
            for length in range(len(suffixes) - 1, -1, -1):
                node = suffixes[length]
                if node != ROOT and count[node] < 2:
                    continue  # seen once, here: this token extends it into the text alone
                child = edges.get(node * TOKEN_SPAN + token, NIL)
                if child == NIL:
                    child = self._new_child(node, token)
                    count[child] = 1
                elif count[child] == 1:  # a second time: its earlier occurrence's continuation becomes a child
                    count[child] = 2
                    if length + 1 < self.depth:
                        earlier = self._new_child(child, text[end[child]])
                        count[earlier], end[earlier] = 1, end[child] + 1
                else:
                    count[child] += 1
                end[child] = i + 1
                grown.append(child)
            grown.reverse()
            self._suffixes = grown

    def _new_child(self, node: int, token: int) -> int:
        child = super()._new_child(node, token)
        if child == len(self._end):
            self._end.append(0)
        return child

    def locate(self, tokens: Sequence[int]) -> Position | None:
        """The position of the string ``tokens``, or None when it never occurred."""
        node, extra = ROOT, 0
        for token in tokens:
            if self._branches(node, extra):
                node = self._edges.get(node * TOKEN_SPAN + token, NIL)
                if node == NIL:
                    return None
            else:
                at = self._end[node] + extra
                if at >= len(self.text) or self.text[at] != token:
                    return None
                extra += 1
        return node, extra

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of the string ``tokens`` (0 when it never occurred)."""
        position = self.locate(tokens) if len(tokens) <= self.depth else None
        if position is None:
            return 0
        return self._count[position[0]] if position[1] == 0 else 1

    def continuation(
        self, text: Sequence[int] | None, k: int, min_probability: float, max_tokens_per_match_token: float
    ) -> Continuation:
        """``SuffixTrie.continuation``; ``text`` None: the trie's own text, whose suffixes it already holds."""
        if text is None:
            text = self.text
            length = next((n for n in range(len(self._suffixes), 0, -1) if self._continues(self._suffixes[n - 1], 0)),
                          0)  # fmt: skip
            position = (self._suffixes[length - 1], 0) if length else (ROOT, 0)
        else:
            position, length = self._match(text)
        k = min(k, int(length * max_tokens_per_match_token))
        if length == 0 or k <= 0:
            return NO_CONTINUATION
        tokens: list[int] = []
        probabilities: list[float] = []
        (node, extra), probability, depth = position, 1.0, length
        while len(tokens) < k:
            if depth == self.depth:  # the bound: go on from the longest suffix of the path that continues
                path = [*text[len(text) - length :], *tokens][-(self.depth // 2) :]
                (node, extra), depth = self._match(path)
                if depth == 0:
                    break
            if self._branches(node, extra):
                child, frequency = self._most_frequent_child(node)
                token, step = (self._token[child], (child, 0)) if child != NIL else (NIL, (NIL, 0))
            else:  # a string seen once: what followed it in the text
                at = self._end[node] + extra
                frequency = 1.0 if at < len(self.text) else 0.0
                token, step = (self.text[at], (node, extra + 1)) if frequency else (NIL, (NIL, 0))
            probability *= frequency
            if step[0] == NIL or probability < min_probability:
                break
            tokens.append(token)
            probabilities.append(probability)
            (node, extra), depth = step, depth + 1
        return Continuation(tuple(tokens), tuple(probabilities), length)

    def _branches(self, node: int, extra: int) -> bool:
        """Are the continuations of this position nodes (seen twice or more), or the text (seen once)?"""
        return node == ROOT or (extra == 0 and self._count[node] >= 2)

    def _continues(self, node: int, extra: int) -> bool:
        if self._branches(node, extra):
            return self._first[node] != NIL
        return self._end[node] + extra < len(self.text)

    def _match(self, text: Sequence[int]) -> tuple[Position, int]:
        """``SuffixTrie.match`` over positions: the longest suffix of ``text`` that occurred followed by a token."""
        low, high = 0, min(len(text), self.depth - 1)
        best: Position = (ROOT, 0)
        while low < high:
            length = (low + high + 1) // 2
            position = self.locate(text[len(text) - length :])
            if position is not None and self._continues(*position):
                low, best = length, position
            else:
                high = length - 1
        return best, low
