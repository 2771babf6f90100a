"""Stalls the worker puts into its own rounds on purpose (``fault_injection`` in its config; ``specd bench --noise``).

A stall is a pause that belongs to the machine, not to the work. To measure how the controller learns through them,
a seeded share of requests is picked as each is submitted, and the engine sleeps once inside the timed target pass
of that request's second round (``BatchEngine.inject_stall``): the round's verify seconds, the request's decode
seconds and the telemetry the controller learns from all carry it, as they would a real stall's. A batched pass is
shared by its sequences, so at batch size b each of them is charged 1/b of the stall, as with a real one.
"""

from __future__ import annotations

import random
import threading

from decoder.worker.config import FaultInjection

STALL_ROUND = 1  # 0-based: the second round (the first carries the one-off costs of a new sequence)


class StallPicker:
    """Which requests stall, and for how long: a share of them, drawn from a seeded generator in submission order."""

    def __init__(self, settings: FaultInjection) -> None:
        self.share = settings.stall_share
        self.seconds = settings.stall_ms / 1000.0
        self._rng = random.Random(settings.seed)
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.share > 0 and self.seconds > 0

    def draw(self) -> float:
        """The stall of the next request, in seconds: ``seconds`` for a share of requests, 0.0 for the rest."""
        if not self.active:
            return 0.0
        with self._lock:
            hit = self._rng.random() < self.share
        return self.seconds if hit else 0.0
