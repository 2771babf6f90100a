"""Span attributes: one table for both services (ops/README.md prints it), and the one builder of a plan's.

| attribute | span | meaning |
|---|---|---|
| specd.segment | all | the segment the request is judged by (the overflow segment past the cap) |
| specd.drafter, specd.k | all | the plan's drafter and K ceiling |
| specd.decision.reason, specd.decision.source | all | why, and where the plan came from (controller, fallback) |
| specd.policy_version, specd.exploration, specd.expected_speedup, specd.stale | all | the controller's plan |
| specd.fallback, specd.fallback_used | worker | the fallback's cause ("" when the controller answered) |
| specd.batch_size | Decide, decode | sequences decoded together |
| specd.prompt_tokens | request, prefill | the prompt's length |
| specd.rounds, specd.num_drafted, specd.num_accepted, specd.alpha | decode | what the rounds did |
| specd.tokens_per_second, specd.status | decode | how fast, and how it ended |
| specd.report_id, specd.rounds, specd.duplicate, specd.journaled | ReportRounds | the report |
| event specd.alpha_drift: specd.drafter, specd.drift.* | Decide | an α drift alarm, once |
"""

from __future__ import annotations

from typing import Any

from specd_api.plan import Plan


def plan_attributes(plan: Plan, segment: str | None = None) -> dict[str, Any]:
    """What every span that carries a plan says about it (controller Decide, client decide, worker request)."""
    return {
        "specd.segment": segment or plan.segment,
        "specd.drafter": plan.drafter,
        "specd.k": plan.k,
        "specd.decision.reason": plan.reason,
        "specd.decision.source": plan.origin.source,
        "specd.policy_version": plan.policy_version,
        "specd.exploration": plan.exploration,
        "specd.expected_speedup": plan.expected_speedup,
        "specd.stale": plan.stale,
        "specd.fallback": plan.origin.fallback or "",
    }
