"""Work on a request thread that runs for tens of milliseconds gives the interpreter back every few milliseconds, and
gives it over for as long as a latency-bound call (Decide) is being served.

Python runs one thread at a time, and a thread that wants the interpreter waits for the running one to give it up:
up to one switch interval (5 ms). Decide crosses threads several times (the event loop, the pool, the loop again),
so beside a report being validated and summed it would wait up to 5 ms at each crossing. A report's work (and the
refresh's reads, a decay step's table builds) calls a ``Pacer`` between its units (an aggregate, a segment, a
column of timings). Every CHUNK_SECONDS the pacer sleeps PAUSE_SECONDS. A real sleep: ``time.sleep(0)`` releases
the interpreter too, but the sleeper takes it back before a waiting thread has woken, so another client's Decide
waits as long as without it. That caps the share of the interpreter one client's back-to-back reports take at
CHUNK / (CHUNK + PAUSE); a cap alone still lets them double another client's Decide p50, hence ``URGENT``.

``URGENT`` counts the latency-bound calls in flight: while one is, a pacer waits at its next call (up to
MAX_YIELD_SECONDS at a time, so that bulk work always moves on) instead of taking the interpreter back. Bulk work
runs only between Decides, whoever sends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

CHUNK_SECONDS = 0.002
PAUSE_SECONDS = 0.001
MAX_YIELD_SECONDS = 0.02  # the longest one pacer call waits for urgent calls: bulk work moves on under any Decide load


class Urgency:
    """The latency-bound calls in flight, and a wait for there to be none."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._count = 0
        self._here = threading.local()  # ``serving``: this thread serves a latency-bound call (never waits on itself)

    @property
    def pending(self) -> bool:
        """Is a latency-bound call in flight on another thread? A plain read: a pacer that misses a call just begun
        waits at its next call."""
        return self._count > getattr(self._here, "serving", 0)

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around a latency-bound call: bulk work yields to it."""
        with self._cond:
            self._count += 1
        self._here.serving = getattr(self._here, "serving", 0) + 1
        try:
            yield
        finally:
            self._here.serving -= 1
            with self._cond:
                self._count -= 1
                if not self._count:
                    self._cond.notify_all()

    def wait_quiet(self, timeout: float) -> None:
        """Wait until no latency-bound call is in flight on another thread, at most ``timeout`` seconds."""
        own = getattr(self._here, "serving", 0)
        with self._cond:
            self._cond.wait_for(lambda: self._count <= own, timeout)


URGENT = Urgency()


class Pacer:
    """Call it between units of work: it waits while a latency-bound call is in flight (``URGENT``), and sleeps
    PAUSE_SECONDS once CHUNK_SECONDS have passed since it last gave the interpreter up."""

    def __init__(
        self, chunk_seconds: float = CHUNK_SECONDS, pause_seconds: float = PAUSE_SECONDS, urgency: Urgency = URGENT
    ) -> None:
        self.chunk_seconds, self.pause_seconds = chunk_seconds, pause_seconds
        self.urgency = urgency
        self.pauses = 0
        self.yields = 0
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if self.urgency.pending:
            self.urgency.wait_quiet(MAX_YIELD_SECONDS)
            self.yields += 1
            self._since = time.perf_counter()
        elif time.perf_counter() - self._since >= self.chunk_seconds:
            time.sleep(self.pause_seconds)
            self.pauses += 1
            self._since = time.perf_counter()


def no_pause() -> None:
    """A pacer that never pauses (pure callers, tests)."""
