"""material_change: a recomputed decision table is sent again only when a worker holding the old one would act
otherwise (at a decay step 1,000 tables move by decimals, and sending each to every stream is wasted work)."""

from __future__ import annotations

import pytest

from controller.serving.table_change import PROBABILITY_TOLERANCE, PROBE_SHARE_TOLERANCE, material_change
from specd_api.v1 import controller_pb2 as pb


def plan(**changes: object) -> pb.Decision:
    fields: dict[str, object] = dict(
        drafter="draft", k=4, reason="best_expected_speedup", policy_version="p1", expected_speedup=1.8,
        segment="chat", acceptance=[0.8, 0.7, 0.6, 0.5], proposal=[1.0, 1.0, 1.0, 1.0], prior_strength=20.0,
        cost_ratio=0.05, verify_cost=[1.0, 1.1, 1.2, 1.3, 1.4], probe_rounds=0,
        counterfactual_ks={"prompt_lookup": 4}, calibration=1.0, max_batch_size=8,
    )  # fmt: skip
    fields.update(changes)
    return pb.Decision(**fields)  # type: ignore[arg-type]


def table(bucket_plan: pb.Decision | None = None, probes: tuple[tuple[pb.Decision, float], ...] = (),
          **changes: object) -> pb.SegmentTable:  # fmt: skip
    t = pb.SegmentTable(segment="chat", max_batch_size=8, min_new_tokens=5, prefill_cost_per_token=0.001)
    for name, value in changes.items():
        setattr(t, name, value)
    for bucket in (1, 2, 4, 8):
        entry = t.buckets.add(batch_bucket=bucket, plan=bucket_plan if bucket == 1 and bucket_plan else plan())
        if bucket == 1:
            for p, share in probes:
                entry.probes.add(plan=p, probability=share)
    t.above_max_batch_size.CopyFrom(plan(drafter="none", k=0, reason="batch_size_above_threshold", acceptance=[]))
    return t


def test_the_same_table_and_decimals_below_the_tolerances_are_no_change() -> None:
    held = table()
    assert not material_change(held, table())
    nudged = plan(
        acceptance=[0.805, 0.695, 0.6, 0.5], expected_speedup=1.8 * 1.005, verify_cost=[1.0, 1.1, 1.2, 1.3, 1.405]
    )
    assert not material_change(held, table(nudged))


@pytest.mark.parametrize(
    "moved",
    [
        {"drafter": "prompt_lookup"},
        {"k": 3},
        {"reason": "exploration"},
        {"exploration": True},
        {"policy_version": "p2"},
        {"stop_threshold": 0.3},
        {"probe_rounds": 2},
        {"counterfactual_ks": {"prompt_lookup": 4, "suffix": 8}},
        {"max_batch_size": 4},
        {"acceptance": [0.8, 0.7, 0.6]},  # a position fewer
        {"acceptance": [0.8, 0.7, 0.6, 0.5 + 2 * PROBABILITY_TOLERANCE]},
        {"calibration": 1.0 + 2 * PROBABILITY_TOLERANCE},
        {"expected_speedup": 1.8 * 1.03},
        {"cost_ratio": 0.05 * 1.03},
        {"verify_cost": [1.0, 1.1, 1.2, 1.3, 1.5]},
    ],
)
def test_a_plan_moved_beyond_a_tolerance_or_in_anything_but_a_number_is_a_change(moved: dict[str, object]) -> None:
    assert material_change(table(), table(plan(**moved)))


def test_an_optional_field_set_or_not_is_a_change() -> None:
    unset = plan()
    unset.ClearField("max_batch_size")
    assert material_change(table(), table(unset)) and material_change(table(unset), table())


def test_the_tables_own_rules_are_exact() -> None:
    held = table()
    assert material_change(held, table(max_batch_size=4))
    assert material_change(held, table(min_new_tokens=6))
    assert material_change(held, table(prefill_cost_per_token=0.002))
    assert not material_change(held, table(prefill_cost_per_token=0.001 * 1.001))
    fewer = table()
    del fewer.buckets[-1]
    assert material_change(held, fewer)
    above = table()
    above.above_max_batch_size.reason = "other"
    assert material_change(held, above)


def test_probe_shares_within_the_draws_noise_are_no_change_beyond_it_are() -> None:
    probe = plan(drafter="prompt_lookup", exploration=True, reason="exploration")
    held = table(probes=((probe, 0.10),))
    assert not material_change(held, table(probes=((probe, 0.10 + PROBE_SHARE_TOLERANCE / 2),)))
    assert material_change(held, table(probes=((probe, 0.10 + 2 * PROBE_SHARE_TOLERANCE),)))
    assert material_change(table(), table(probes=((probe, PROBE_SHARE_TOLERANCE / 2),))), "a rare probe comes"
    assert material_change(table(probes=((probe, PROBE_SHARE_TOLERANCE / 2),)), table()), "a rare probe goes"
    assert material_change(held, table(probes=((probe, float("nan")),)))
    assert material_change(held, table(probes=((plan(drafter="prompt_lookup", k=2, exploration=True), 0.10),)))
