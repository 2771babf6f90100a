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

# The values where a JSON double's meaning changes on its way to a tensor: float32 / bfloat16 / float16 subnormals and
# smallest normals (1e-46 is 0 in float32), the last value under 1 each dtype holds, and each dtype's largest finite
# value (sampling parameters at these limits must never kill the worker's decode loop)
DTYPE_LIMITS = (
    5e-324, 1e-46, 2.0**-149, 2.0**-150, 2.0**-126, 2.0**-133, 2.0**-24, 2.0**-14, 6e-8,
    1 - 2.0**-53, 1 - 2.0**-24, 1 - 2.0**-8, 1 - 2.0**-11,
    65504.0, 3.3895313892515355e38, 3.4028234663852886e38, 1.7976931348623157e308,
)  # fmt: skip
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
