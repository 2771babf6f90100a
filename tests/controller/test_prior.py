"""The scikit-learn prior: learns how α depends on request features, and is stored as plain JSON."""

from __future__ import annotations

import json
import random

import pytest

from controller.decision.prior import PriorModel, train_prior


def rows(n: int = 400, seed: int = 0) -> list[dict[str, float | str]]:
    """Telemetry rows where the draft's α falls with temperature and lookup's rises with self-repetition."""
    rng = random.Random(seed)
    out: list[dict[str, float | str]] = []
    for _ in range(n):
        temperature, repetition = rng.uniform(0, 1.5), rng.uniform(0, 1)
        for drafter, alpha in (("draft", 0.9 - 0.5 * temperature), ("prompt_lookup", 0.1 + 0.8 * repetition)):
            verified = 40
            accepted = sum(rng.random() < alpha for _ in range(verified))
            out.append({"drafter": drafter, "temperature": temperature, "prompt_tokens": rng.randint(10, 2000),
                        "self_repetition": repetition, "verified": verified, "accepted": accepted})  # fmt: skip
    return out


def test_learns_the_direction_and_size_of_each_effect():
    model = train_prior(rows())
    assert model is not None
    cold, hot = model.predict("draft", 0.0, 200, 0.5), model.predict("draft", 1.4, 200, 0.5)
    assert cold == pytest.approx(0.9, abs=0.06) and hot == pytest.approx(0.2, abs=0.08)
    low, high = model.predict("prompt_lookup", 0.0, 200, 0.05), model.predict("prompt_lookup", 0.0, 200, 0.95)
    assert low is not None and high is not None and low < 0.25 < 0.75 < high


def test_too_little_data_trains_nothing():
    assert train_prior(rows(n=2)) is None


def test_unknown_drafter_predicts_nothing():
    model = train_prior(rows())
    assert model is not None and model.predict("medusa", 0.0, 10, 0.0) is None


def test_round_trips_through_plain_json():
    model = train_prior(rows())
    assert model is not None
    text = json.dumps(model.to_json())  # nothing but numbers and strings: no pickle, no code
    again = PriorModel.from_json(json.loads(text))
    assert again.predict("draft", 0.7, 100, 0.3) == pytest.approx(model.predict("draft", 0.7, 100, 0.3))


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d.update(format="pickle"), "another format"),
        (lambda d: d.update(features=["x"]), "different features"),
        (lambda d: d["by_drafter"]["draft"].update(coef=[1.0]), "wrong number of coefficients"),
        (lambda d: d["by_drafter"]["draft"].update(intercept=float("nan")), "not finite"),
    ],
)
def test_refuses_documents_it_did_not_write(mutate, why):
    model = train_prior(rows())
    assert model is not None
    document = json.loads(json.dumps(model.to_json()))
    mutate(document)
    with pytest.raises(ValueError):
        PriorModel.from_json(document)
