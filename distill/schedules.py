"""Learning-rate schedules shared by the project's trainers (distillation here, and the reference models'
pretraining in ``refmodels/train.py``). Pure: no torch, so importing it costs nothing."""

from __future__ import annotations

import math


def warmup_cosine(step: int, peak: float, warmup: int, total: int, floor_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * floor_ratio`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * floor_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
