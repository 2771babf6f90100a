"""Each client host's share of the handler pool: at most ``per_host`` of its unary calls run at once; its
others wait their turn on the event loop, holding no thread.

Without a share, one client calling Decide back to back from 4 threads has 4 calls running beside another client's one:
every handler wants the one interpreter, so the other client's Decide gets a fifth of it and takes 2-3x as long (10x
with a made-up segment per call). With a share per host, a flooding host has ``per_host`` calls running whatever its
concurrency, and a host with none running is let in at once: its call competes with ``per_host`` others, not with the
flood's whole depth. A host alone still has the whole controller (a GIL-bound server is as fast with 2 calls running as
with 16).

The host is the IP of the call's peer (``report_budget.peer_host``), as for the report budget: a client opens as many
connections as it likes, but not as many addresses. Peers without one (Unix sockets) share one turn.

Only coroutines on the server's one event loop touch it: no lock. Its memory is one entry per host with a call
running, and one future per call waiting its turn (each such call is already held by the server).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

DEFAULT_CALLS_PER_HOST = 2


class HostShares:
    def __init__(self, per_host: int = DEFAULT_CALLS_PER_HOST, on_wait: Callable[[], None] | None = None) -> None:
        if per_host < 1:
            raise ValueError(f"a host needs at least one call running, not {per_host}")
        self.per_host = per_host
        self._on_wait = on_wait  # told of each call that waits its turn (the daemon counts them in /metrics)
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    def running(self, host: str) -> int:
        return self._running.get(host, 0)

    def waiting(self, host: str) -> int:
        return len(self._waiting.get(host, ()))

    @asynccontextmanager
    async def turn(self, host: str) -> AsyncIterator[None]:
        """Around a call's run: enter once fewer than ``per_host`` of ``host``'s calls run (in the order they came).
        A call cancelled while it waits leaves the queue, and a turn it was just handed passes on."""
        if self._running.get(host, 0) < self.per_host:
            self._running[host] = self._running.get(host, 0) + 1
        else:
            if self._on_wait is not None:
                self._on_wait()
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(host, deque()).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release(host)  # handed the turn as it was cancelled: pass it on
                else:
                    self._forget(host, turn)
                raise
        try:
            yield
        finally:
            self._release(host)

    def _release(self, host: str) -> None:
        """A running call of ``host`` ends: its turn goes to the host's next waiting call, else the count drops."""
        waiting = self._waiting.get(host)
        while waiting:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the running count stays: the turn changed hands
                if not waiting:
                    del self._waiting[host]
                return
        self._waiting.pop(host, None)
        left = self._running[host] - 1
        if left:
            self._running[host] = left
        else:
            del self._running[host]

    def _forget(self, host: str, turn: asyncio.Future[None]) -> None:
        waiting = self._waiting.get(host)
        if waiting is None:
            return
        with suppress(ValueError):  # already handed out and skipped
            waiting.remove(turn)
        if not waiting:
            del self._waiting[host]
