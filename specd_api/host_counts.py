"""How many of something each client host holds (waiting calls, streams, connections), and all hosts together.

One home for the count behind every per-host share (issue 22: one host's flood may take its share, not every
host's place). Not thread-safe: each user touches it from one event loop. Stdlib only: both halves import it.
"""

from __future__ import annotations


class HostCounts:
    """``total`` and ``of(host)``; a host holding none has no entry, so the memory is the hosts holding some."""

    def __init__(self) -> None:
        self.total = 0
        self._by_host: dict[str, int] = {}

    def of(self, host: str) -> int:
        return self._by_host.get(host, 0)

    def hosts(self) -> dict[str, int]:
        """A copy: each host holding some, with its count."""
        return dict(self._by_host)

    def add(self, host: str) -> None:
        self.total += 1
        self._by_host[host] = self._by_host.get(host, 0) + 1

    def remove(self, host: str) -> None:
        """One of ``host``'s back (it must hold one)."""
        left = self._by_host[host] - 1
        if left:
            self._by_host[host] = left
        else:
            del self._by_host[host]
        self.total -= 1
