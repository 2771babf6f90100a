"""Measured costs from the workers' timings: c per drafter, and v(n) per batch-size bucket."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from controller.counts import CostCounts, batch_bucket
from controller.speedup import DEFAULT_VERIFY, VerifyCost, fit_verify_cost


@dataclass(frozen=True)
class CostModel:
    cost_ratio: Mapping[str, float] = field(default_factory=dict)  # measured c; absent until measured
    verify_by_bucket: Mapping[int, VerifyCost] = field(default_factory=dict)
    verify_overall: VerifyCost = DEFAULT_VERIFY

    def c(self, drafter: str, default: float) -> float:
        return self.cost_ratio.get(drafter, default)

    def verify(self, batch_size: int) -> VerifyCost:
        return self.verify_by_bucket.get(batch_bucket(batch_size), self.verify_overall)


def build_cost_model(costs: CostCounts) -> CostModel:
    points: dict[int, list[tuple[float, float, float]]] = {}
    for (n, bucket), rounds in costs.verify_rounds.items():
        if rounds > 0:
            points.setdefault(bucket, []).append((float(n), costs.verify_s[(n, bucket)], rounds))
    if not points:
        return CostModel()
    by_bucket = {b: fit_verify_cost(p) for b, p in points.items()}
    overall = fit_verify_cost([p for ps in points.values() for p in ps])
    step_seconds = (by_bucket.get(1) or overall).intercept_seconds  # one target step at batch 1
    ratios = {
        d: (costs.draft_s[d] / costs.drafted[d]) / step_seconds
        for d in costs.drafted
        if costs.drafted[d] > 0 and step_seconds > 0
    }
    return CostModel(ratios, by_bucket, overall)
