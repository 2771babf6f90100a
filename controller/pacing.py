"""Work on a request thread that runs for tens of milliseconds gives the interpreter back every few milliseconds.

Python runs one thread at a time, and a thread that wants the interpreter waits for the running one to give it up:
up to one switch interval (5 ms). Decide crosses threads several times (the event loop, the pool, the loop again),
so beside a report being validated and summed it waited up to 5 ms at each crossing. A report's work now calls a
``Pacer`` between its units (an aggregate, a segment, a column of timings); every CHUNK_SECONDS the pacer sleeps
PAUSE_SECONDS. A real sleep: ``time.sleep(0)`` releases the interpreter too, but the sleeper takes it back before a
waiting thread has woken (measured: no change to another client's Decide p99). It also caps the share of the
interpreter one client's back-to-back reports can take at CHUNK / (CHUNK + PAUSE).
"""

from __future__ import annotations

import time

CHUNK_SECONDS = 0.002
PAUSE_SECONDS = 0.001


class Pacer:
    """Call it between units of work: it sleeps PAUSE_SECONDS once CHUNK_SECONDS have passed since it last did."""

    def __init__(self, chunk_seconds: float = CHUNK_SECONDS, pause_seconds: float = PAUSE_SECONDS) -> None:
        self.chunk_seconds, self.pause_seconds = chunk_seconds, pause_seconds
        self.pauses = 0
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.chunk_seconds:
            time.sleep(self.pause_seconds)
            self.pauses += 1
            self._since = time.perf_counter()


def no_pause() -> None:
    """A pacer that never pauses (pure callers, tests)."""
