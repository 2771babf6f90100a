"""A log line that a client can set off at will, written at most once per interval (one client's thousands of
refused calls, half-sent connections or made-up names must not write thousands of lines). Stdlib only: both halves
import it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LEFT_OUT = " ({n} more like it in the last {seconds:g} s)"


class SparseLog:
    """``note(message, *args)``: logs at ``level`` unless a line went out less than ``every_s`` ago; the next line
    that goes out says how many were left out in between (``left_out``, formatted with ``n`` and ``seconds``), and
    ``flush`` says it when no line is coming (at a stop). Thread-safe."""

    def __init__(
        self, logger: logging.Logger, level: int, every_s: float, left_out: str = LEFT_OUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.logger, self.level, self.every_s, self.left_out, self.clock = logger, level, every_s, left_out, clock
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._unlogged = 0

    def note(self, message: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now - self._last < self.every_s:
                self._unlogged += 1
                return
            self._last, before, self._unlogged = now, self._unlogged, 0
        more = self.left_out.format(n=before, seconds=self.every_s) if before else ""
        self.logger.log(self.level, message + "%s", *args, more)

    def flush(self) -> None:
        with self._lock:
            before, self._unlogged = self._unlogged, 0
        if before:
            self.logger.log(self.level, "and %d more like the last line", before)
