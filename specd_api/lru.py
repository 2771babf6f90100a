"""A bounded map that forgets the least recently used entry first: the per-segment memories of the controller
(the last learned plan, for hysteresis) and of the client library (the last plan, for fallbacks)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class LruMemory(Generic[V]):
    """The last value per key, at most ``max_entries`` keys. Thread-safe."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._last: OrderedDict[str, V] = OrderedDict()

    def remember(self, key: str, value: V) -> None:
        with self._lock:
            self._last[key] = value
            self._last.move_to_end(key)
            while len(self._last) > self.max_entries:
                self._last.popitem(last=False)

    def recall(self, key: str) -> V | None:
        with self._lock:
            value = self._last.get(key)
            if value is not None:
                self._last.move_to_end(key)
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._last)
