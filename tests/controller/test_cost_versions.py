"""The cost model's version (what every decision table's key reads) moves only when a cost decisions read moves past
COSTS_TOLERANCE since the version last moved: a decay step moves every weighted median a little, and a version that
moved with each of those rebuilt all 1,000 tables a minute (seconds of CPU, probe draws included). Small moves add
up until they count; ``Decide`` reads the model rebuilt every time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller.decision import learner as learner_module
from controller.decision.cost_model import COSTS_TOLERANCE, BucketCosts, CostModel, costs_moved
from controller.decision.learner import Learner
from controller.storage.journal import Journal
from controller.storage.store import StoreConfig
from specd_api.modes import GREEDY, SAMPLED

BASE = BucketCosts(bucket=1, step_seconds=0.02, cost_ratio={"draft": 0.2}, verify=(1.0, 1.1, 1.2, 1.3), measured=True)


def model(**changes: object) -> CostModel:
    return CostModel({(GREEDY, 1): replace(BASE, **changes)})  # type: ignore[arg-type]


SMALL, LARGE = 1 + COSTS_TOLERANCE / 2, 1 + 2 * COSTS_TOLERANCE


@pytest.mark.parametrize(
    ("after", "moved"),
    [
        (model(), False),
        (model(rounds=(5.0, 9.0)), False),  # the rounds behind each v(n): only GetCosts shows them
        (model(step_seconds=0.02 * SMALL), False),
        (model(step_seconds=0.02 * LARGE), True),
        (model(verify=(1.0, 1.1, 1.2 * LARGE, 1.3)), True),
        (model(verify=(1.0, 1.1, 1.2 * SMALL, 1.3)), False),
        (model(cost_ratio={"draft": 0.2 * LARGE}), True),
        (model(cost_ratio={"draft": 0.2, "eagle": 0.1}), True),
        (model(measured=False), True),
        (CostModel({(GREEDY, 1): BASE, (SAMPLED, 1): BASE}), True),
        (model(verify=(1.0, 1.1, 1.2)), True),
    ],
    ids=["same", "rounds", "step-small", "step-large", "v-large", "v-small", "c-large", "new-drafter", "measured",
         "new-bucket", "shorter-v"],
)  # fmt: skip
def test_a_cost_moves_only_past_the_tolerance(after: CostModel, moved: bool):
    assert costs_moved(model(), after) is moved


def test_small_moves_add_up_against_the_model_of_the_last_move(tmp_path: Path, monkeypatch):
    step = 1 + 0.6 * COSTS_TOLERANCE  # each move within the tolerance, two of them past it
    models = iter([model(step_seconds=0.02 * step**i) for i in range(1, 6)])
    monkeypatch.setattr(learner_module, "build_cost_model", lambda costs: next(models))
    store = SimpleNamespace(config=StoreConfig())  # what the learner reads of its store before a refresh
    learner = Learner(store=store, journal=Journal(tmp_path / "j", 10, 1 << 20))  # type: ignore[arg-type]
    learner._versioned_costs = learner.cost_model = model()
    versions = []
    for _ in range(5):
        learner._install_cost_model()
        versions.append(learner.costs_version)
        assert learner.cost_model.buckets[(GREEDY, 1)].step_seconds > 0.02  # Decide reads the latest, always
    assert versions == [0, 1, 1, 2, 2], versions  # past 1 % of the model at the last move: the 2nd and 4th moves
