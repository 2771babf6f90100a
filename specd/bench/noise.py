"""`specd bench --noise`: noise put into the worker on purpose, so that robustness is measured, not hoped for.

``stall:P:MS``: the worker stalls a share P (0..1) of its requests for MS milliseconds, once each, inside the timed
target pass of the request's second round (the worker's ``fault_injection`` setting). The round's timing, the
request's decode seconds and the telemetry the controller learns from all carry the stall, as a real one's would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FORMAT = "stall:P:MS (P the share of requests stalled, 0..1; MS the stall in milliseconds, >= 0)"


@dataclass(frozen=True)
class StallNoise:
    share: float  # of requests, 0..1
    ms: float  # each stall, in milliseconds

    def worker_setting(self, seed: int) -> dict[str, Any]:
        """The worker config's ``fault_injection`` section."""
        return {"stall_share": self.share, "stall_ms": self.ms, "seed": seed}

    def describe(self, seeds: list[int]) -> dict[str, Any]:
        """bench.json's ``noise``; ``seeds``: each run's worker seed (which requests it stalled)."""
        return {"kind": "stall", "share": self.share, "ms": self.ms, "seeds": seeds}


def worker_seed(seed: int, run: int) -> int:
    """The worker's fault-injection seed in run ``run`` of ``--repeats`` (each run stalls other requests)."""
    return seed + run


def parse_noise(text: str) -> StallNoise:
    """``stall:P:MS`` -> StallNoise; ValueError naming what is wrong otherwise."""
    parts = text.split(":")
    if parts[0] != "stall":
        raise ValueError(f"unknown noise {parts[0]!r} in {text!r}; the one kind is {FORMAT}")
    if len(parts) != 3:
        raise ValueError(f"{text!r} is not {FORMAT}")
    values = []
    for name, part in zip(("P", "MS"), parts[1:], strict=True):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{text!r}: {name} must be a number, got {part!r}; expected {FORMAT}") from None
        if not math.isfinite(value):
            raise ValueError(f"{text!r}: {name} must be finite, got {part!r}")
        values.append(value)
    share, ms = values
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{text!r}: P is a share of requests and must be in [0, 1], got {share:g}")
    if ms < 0:
        raise ValueError(f"{text!r}: MS must be >= 0, got {ms:g}")
    return StallNoise(share, ms)
