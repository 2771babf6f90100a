"""The controller's state as protobuf messages (GetSegmentStats, ListSegments, GetCosts): the servicer's views, so
that ``Controller`` itself stays independent of gRPC."""

from __future__ import annotations

from controller.decision.core import SegmentView
from controller.decision.cost_model import CostModel
from controller.decision.counts import PositionCounts
from controller.decision.policy import DRAFTERS
from controller.decision.timing_histogram import median, total
from specd_api.speedup import ratio, speedup_curve, wilson_interval
from specd_api.v1 import controller_pb2 as pb


def segment_stats(view: SegmentView) -> pb.SegmentStats:
    counts, estimates, costs = view.counts, view.estimates, view.costs
    msg = pb.SegmentStats(segment=view.segment, rounds=counts.rounds, last_update_unix=counts.last_update,
                          stale=view.stale)  # fmt: skip
    for d in sorted(set(counts.drafters()) | set(DRAFTERS)):
        drafter = msg.drafters.add(drafter=d)
        curve: list[float] = []
        if d in estimates:
            drafter.cost_ratio = estimates[d].cost_ratio
            conditional, proposal = estimates[d].means()
            drafter.acceptance.extend(conditional)
            drafter.proposal.extend(proposal)
            curve = speedup_curve(
                conditional, proposal, len(conditional), estimates[d].cost_ratio, costs.verify_table(len(conditional))
            )
        calibration = counts.calibration.get(d, {})
        drafter.calibration, drafter.calibration_requests = median(calibration), total(calibration)
        realised = estimates[d].realised if d in estimates else None
        if realised is not None:
            drafter.realised_speedup, drafter.realised_requests = realised.speedup, realised.requests
        arm = view.arms.get(d)
        if arm is not None:
            drafter.best_k, drafter.model_speedup = arm.k, arm.model
            drafter.expected_speedup, drafter.lower_bound = arm.speedup, arm.rank
        for i, pos in enumerate(counts.position_list(d)):
            drafter.positions.append(position_stats(i, pos))
        for i, pos in enumerate(counts.position_list(d, counterfactual=True)):
            drafter.counterfactual_positions.append(position_stats(i, pos))
        for (name, k), kc in sorted(counts.by_k.items()):
            if name != d:
                continue
            low, high = wilson_interval(kc.accepted, kc.proposed)
            drafter.by_k.add(
                drafter=d,
                k=k,
                rounds=kc.rounds,
                proposed=kc.proposed,
                accepted=kc.accepted,
                alpha=ratio(kc.accepted, kc.proposed),
                alpha_ci_low=low,
                alpha_ci_high=high,
                mean_accepted_length=ratio(kc.accepted + kc.rounds, kc.rounds),
                expected_speedup=curve[k - 1] if 0 < k <= len(curve) else 1.0,
            )
    msg.decision.CopyFrom(view.decision.to_proto())
    for alarm in view.drift:
        msg.drift.add(
            drafter=alarm.drafter, direction=alarm.direction, since_unix=alarm.since_unix,
            raised_unix=alarm.raised_unix, alpha_before=alarm.alpha_before, alpha_since=alarm.alpha_since,
        )  # fmt: skip
    return msg


def cost_model(model: CostModel, stale: bool) -> pb.CostModel:
    msg = pb.CostModel(stale=stale)
    for (mode, bucket), bc in sorted(model.buckets.items()):
        measured_n = len(bc.rounds)
        msg.buckets.add(
            mode=mode,
            batch_bucket=bucket,
            step_seconds=bc.step_seconds,
            cost_ratio=dict(bc.cost_ratio),
            verify_cost=bc.verify[: max(measured_n, 1)],
            verify_rounds=bc.rounds,
            measured=bc.measured,
            spread=bc.timings.spread() if bc.timings is not None else 0.0,
        )
    return msg


def position_stats(i: int, pos: PositionCounts) -> pb.PositionStats:
    return pb.PositionStats(
        position=i,
        offered=pos.offered,
        proposed=pos.proposed,
        verified=pos.verified,
        accepted=pos.accepted,
        conditional_alpha=ratio(pos.accepted, pos.verified),
        alpha=ratio(pos.accepted, pos.offered),
    )
