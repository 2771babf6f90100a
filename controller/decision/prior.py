"""The prior for segments with little data: a scikit-learn model that predicts α from request features.

Per drafter, a logistic regression maps (temperature, log prompt length, prompt self-repetition) to the
per-token acceptance probability, fitted on recent telemetry with each aggregate's accepted and rejected
token counts as sample weights. It is stored as plain coefficients in JSON, never pickled: a shared store
is not trusted code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES = ("temperature", "log_prompt_tokens", "self_repetition")
MIN_TOKENS_TO_TRAIN = 200  # verified tokens per drafter before a model is worth fitting


def features(temperature: float, prompt_tokens: int, self_repetition: float) -> np.ndarray:
    return np.array([temperature, math.log1p(max(prompt_tokens, 0)), self_repetition], dtype=np.float64)


@dataclass(frozen=True)
class LinearLogit:
    coef: tuple[float, ...]
    intercept: float

    def predict(self, x: np.ndarray) -> float:
        z = float(np.dot(self.coef, x) + self.intercept)
        return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))


@dataclass(frozen=True)
class PriorModel:
    by_drafter: Mapping[str, LinearLogit]
    trained_unix: float
    tokens: int  # verified tokens it was fitted on

    def predict(self, drafter: str, temperature: float, prompt_tokens: int, self_repetition: float) -> float | None:
        model = self.by_drafter.get(drafter)
        return model.predict(features(temperature, prompt_tokens, self_repetition)) if model else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "specd.prior.v1",
            "features": list(FEATURES),
            "trained_unix": self.trained_unix,
            "tokens": self.tokens,
            "by_drafter": {d: {"coef": list(m.coef), "intercept": m.intercept} for d, m in self.by_drafter.items()},
        }

    @staticmethod
    def from_json(document: Mapping[str, Any]) -> PriorModel:
        """Parse a stored model; raises ValueError on anything unexpected (it came from a shared store): a missing
        key, a value of another type, a number out of range ("tokens": Infinity raises OverflowError, which no caller
        expects: it is reported as ValueError, so the controller starts whatever the stored document holds)."""
        try:
            return PriorModel._parsed(document)
        except (KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ValueError(f"not a readable specd.prior.v1 document ({type(e).__name__}: {e})") from e

    @staticmethod
    def _parsed(document: Mapping[str, Any]) -> PriorModel:
        if document.get("format") != "specd.prior.v1" or list(document.get("features", [])) != list(FEATURES):
            raise ValueError("not a specd.prior.v1 document with the expected features")
        by_drafter = {}
        for drafter, m in dict(document["by_drafter"]).items():
            coef = tuple(float(c) for c in m["coef"])
            intercept = float(m["intercept"])
            if len(coef) != len(FEATURES) or not all(math.isfinite(v) for v in (*coef, intercept)):
                raise ValueError(f"bad coefficients for drafter {drafter!r}")
            by_drafter[str(drafter)] = LinearLogit(coef, intercept)
        return PriorModel(by_drafter, float(document["trained_unix"]), int(document["tokens"]))


def train_prior(rows: Sequence[Mapping[str, Any]]) -> PriorModel | None:
    """Fit one weighted logistic regression per drafter; None when there is too little data."""
    from sklearn.linear_model import LogisticRegression

    by_drafter: dict[str, LinearLogit] = {}
    total = 0
    for drafter in sorted({str(r["drafter"]) for r in rows}):
        mine = [r for r in rows if r["drafter"] == drafter and r["verified"] > 0]
        verified = sum(float(r["verified"]) for r in mine)
        accepted = sum(float(r["accepted"]) for r in mine)
        if verified < MIN_TOKENS_TO_TRAIN or accepted in (0, verified):
            continue  # too little, or only one outcome: nothing to separate
        x = np.array([features(r["temperature"], int(r["prompt_tokens"]), r["self_repetition"]) for r in mine])
        # Each row twice: accepted tokens as y = 1, rejected tokens as y = 0, weighted by their counts.
        xx = np.vstack([x, x])
        y = np.concatenate([np.ones(len(mine)), np.zeros(len(mine))])
        w = np.array([float(r["accepted"]) for r in mine] + [float(r["verified"] - r["accepted"]) for r in mine])
        keep = w > 0
        model = LogisticRegression(C=1.0, max_iter=200)
        model.fit(xx[keep], y[keep], sample_weight=w[keep])
        by_drafter[drafter] = LinearLogit(tuple(float(c) for c in model.coef_[0]), float(model.intercept_[0]))
        total += int(verified)
    return PriorModel(by_drafter, time.time(), total) if by_drafter else None
