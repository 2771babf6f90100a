"""The plan's rules, each a table: why each row's answer is right is in its last column."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specd_api.plan import (
    BATCH_RULE_REASON,
    LOCAL_DEFAULT_REASON,
    REQUEST_REASON,
    Origin,
    Plan,
    batch_bucket,
    fallback_plan,
    local_plan,
    offers,
    requested,
    runnable,
    speculation_allowed,
    worth_remembering,
)
from specd_api.v1 import controller_pb2 as pb

CPU_V = (1.0, 1.39, 1.71, 1.58, 1.21, 1.9, 2.3, 2.7, 3.1)  # non-monotonic, as measured on a CPU in float32


@pytest.mark.parametrize(
    ("batch", "threshold", "allowed", "why"),
    [(8, 8, True, "at the threshold: on"), (9, 8, False, "above it: off"), (1, 0, False, "threshold 0: never"),
     (0, 0, True, "nothing decoding yet")],
)  # fmt: skip
def test_the_batch_rule(batch, threshold, allowed, why):
    assert speculation_allowed(batch, threshold) is allowed, why


@pytest.mark.parametrize(("batch", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (0, 1)])
def test_batch_buckets_are_named_by_their_top(batch, bucket):
    assert batch_bucket(batch) == bucket


LAST = Plan("draft", 6, "best_expected_speedup", "v1", acceptance=(0.9,) * 6, verify_cost=CPU_V[:7])
DEFAULT = Plan("prompt_lookup", 4, origin=Origin("local_default"))


@pytest.mark.parametrize(
    ("last", "offered", "batch", "expected", "why"),
    [
        (LAST, ["draft", "prompt_lookup"], 1, ("draft", 6, "best_expected_speedup", "last_decision"),
         "the segment's last plan, marked as a fallback"),
        (LAST, ["prompt_lookup"], 1, ("prompt_lookup", 4, LOCAL_DEFAULT_REASON, "local_default"),
         "the worker lost the draft model: the local default"),
        (LAST, ["draft", "prompt_lookup"], 9, ("none", 0, BATCH_RULE_REASON, "local_default"),
         "the batch rule comes first, even over the last plan"),
        (replace(LAST, max_batch_size=16), ["draft", "prompt_lookup"], 9,
         ("draft", 6, "best_expected_speedup", "last_decision"), "the last plan's own threshold, not the worker's"),
        (replace(LAST, max_batch_size=2), ["draft", "prompt_lookup"], 3,
         ("none", 0, BATCH_RULE_REASON, "local_default"), "... under the worker's too: the local default obeys it"),
        (None, ["draft"], 1, ("none", 0, LOCAL_DEFAULT_REASON, "local_default"),
         "the default's drafter is not offered: no speculation"),
        (None, ["draft", "prompt_lookup"], 1, ("prompt_lookup", 4, LOCAL_DEFAULT_REASON, "local_default"),
         "never seen: the local default"),
    ],
)  # fmt: skip
def test_fallbacks(last, offered, batch, expected, why):
    plan = fallback_plan(last, DEFAULT, offered, batch, 8, "timeout", 0.004)
    assert (plan.drafter, plan.k, plan.reason, plan.origin.source) == expected, why
    own = last.max_batch_size if last is not None else None
    assert plan.max_batch_size == (8 if own is None else own), "a fallback carries the threshold it was chosen under"
    assert plan.stale and plan.origin.fallback == "timeout" and plan.origin.latency_s == 0.004 and not plan.exploration


def test_a_fallback_keeps_the_last_plans_estimates():
    plan = fallback_plan(LAST, DEFAULT, ["draft"], 1, 8, "unavailable", 0.0)
    assert plan.acceptance == LAST.acceptance and plan.adaptive


def test_the_local_plan_without_a_controller():
    assert local_plan("draft", 4, ["draft"], 1, 8, None).max_batch_size == 8, "under the worker's threshold"
    assert local_plan("draft", 4, ["draft"], 1, 8, None).speculates
    assert local_plan("draft", 0, ["draft"], 1, 8, None).drafter == "none"
    assert local_plan("draft", 4, ["draft"], 16, 8, None).reason == BATCH_RULE_REASON


@pytest.mark.parametrize(
    ("plan", "worth", "why"),
    [(LAST, True, "the controller's learned plan"),
     (Plan("draft", 8, "exploration", exploration=True), False, "a probe"),
     (Plan("none", 0, BATCH_RULE_REASON), False, "about the batch, not the segment"),
     (Plan("draft", 4, origin=Origin("last_decision")), False, "a fallback is not news")],
)  # fmt: skip
def test_worth_remembering(plan, worth, why):
    assert worth_remembering(plan) is worth, why


@pytest.mark.parametrize(
    ("offered", "drafter", "runs", "why"),
    [(("draft", "prompt_lookup"), "draft", "draft", "offered: unchanged"),
     (("prompt_lookup",), "draft", "none", "a worker without a draft model: no speculation"),
     ((), "none", "none", "none is always offered"),
     (("draft",), "chain", "none", "offering the draft model's drafter is not offering the chain")],
)  # fmt: skip
def test_a_plan_runs_as_the_worker_can(offered, drafter, runs, why):
    plan = runnable(Plan(drafter, 4 if drafter != "none" else 0, "best_expected_speedup", max_batch_size=4), offered, 8)
    assert offers(offered, drafter) is (runs == drafter), why
    assert (plan.drafter, plan.speculates) == (runs, runs != "none"), why
    assert plan.reason == "best_expected_speedup" and plan.max_batch_size == 4, "the rest of the plan is kept"


@pytest.mark.parametrize(
    ("carried", "worker", "in_force", "why"),
    [(2, 8, 2, "the plan's threshold under the worker's: the plan's"),
     (16, 8, 16, "the plan's over the worker's: still the plan's (one threshold, the policy's)"),
     (0, 8, 0, "a policy that never speculates"),
     (None, 8, 8, "a plan without one (a caller's own): the worker's"),
     (None, None, None, "neither: no batch rule (an engine used on its own)")],
)  # fmt: skip
def test_the_batch_threshold_is_resolved_once_when_the_worker_takes_the_plan(carried, worker, in_force, why):
    assert runnable(Plan("draft", 4, max_batch_size=carried), ["draft"], worker).max_batch_size == in_force, why


def test_a_callers_own_plan():
    assert requested("draft", 4) == Plan("draft", 4, REQUEST_REASON, origin=Origin("request"))
    assert requested("none", 3).k == 0, "no speculation has no K"
    assert requested("draft", 8, [1, 8]).k_schedule == (1, 8)


@pytest.mark.parametrize("max_batch_size", [8, 0, None], ids=["8", "0: never", "absent"])
def test_the_plan_survives_the_wire(max_batch_size):
    plan = Plan("draft", 6, "best_expected_speedup", "abc", False, 1.4, True, "code", 0.3, (0.9, 0.8), (1.0, 1.0),
                8.0, 0.12, (1.0, 1.2, 1.3), 4, (("prompt_lookup", 10), ("suffix", 16)),
                max_batch_size=max_batch_size)  # fmt: skip
    back = Plan.from_proto(plan.to_proto(), latency_s=0.002)
    assert back == Plan(**{**plan.__dict__, "origin": Origin(latency_s=0.002)})


def test_the_drafters_to_score_reach_the_worker():
    plan = Plan("draft", 4, counterfactual_ks=(("prompt_lookup", 10), ("suffix", 16)))
    wire = pb.Decision.FromString(plan.to_proto().SerializeToString())
    assert dict(wire.counterfactual_ks) == {"prompt_lookup": 10, "suffix": 16}
    assert Plan.from_proto(wire).counterfactual_ceiling("suffix") == 16
    no_lookup = Plan.from_proto(pb.Decision(drafter="draft", k=4, counterfactual_ks={"suffix": 16, "prompt_lookup": 0}))
    assert (no_lookup.counterfactual_ks, no_lookup.counterfactual_ceiling("prompt_lookup")) == ((("suffix", 16),), 0)


def test_a_decision_without_the_batch_threshold_carries_none():
    unset = pb.Decision(drafter="draft", k=4)  # field 18 unset: the plan does not say
    assert Plan.from_proto(pb.Decision.FromString(unset.SerializeToString())).max_batch_size is None
