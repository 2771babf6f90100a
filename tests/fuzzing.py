"""What the property-based fuzz tests (test_fuzz_*.py) share: how many examples, and how they are drawn.

By default a run is reproducible: derandomized (the examples are a function of the test), and no example database
is written into the tree, so CI sees the same inputs every time. ``SPECD_FUZZ_SCALE=10`` draws ten times as many;
``SPECD_FUZZ_RANDOM=1`` draws new ones each run (a failure prints the example and the seed to reproduce it).
``pytest --hypothesis-show-statistics`` prints how many examples each test ran and how long they took.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("SPECD_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("SPECD_FUZZ_RANDOM", "") not in ("", "0")


def fuzz_settings(max_examples: int, **overrides: Any) -> settings:
    """Settings for one fuzz test: ``max_examples`` scaled; no per-example deadline (the machine's cores are shared:
    the tests assert their own time bounds where a hang is what they look for)."""
    return settings(
        max_examples=max(1, round(max_examples * SCALE)),
        derandomize=not RANDOM,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **overrides,
    )
