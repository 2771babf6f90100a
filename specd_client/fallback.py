"""Where a fallback comes from: the cause of a failed Decide, and the memory of each segment's last plan. The rules
(``fallback_plan``, ``local_plan``) live in ``specd_api.plan`` with the plan type (contract 2: the worker never
fails because of the controller)."""

from __future__ import annotations

import grpc

from specd_api.lru import LruMemory
from specd_api.plan import Fallback, Plan


def fallback_cause(code: grpc.StatusCode | None) -> Fallback:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return "error"


class DecisionMemory(LruMemory[Plan]):
    """The last plan worth remembering per segment (``specd_api.plan.worth_remembering``)."""
