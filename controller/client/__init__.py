"""A client library for the specd controller: decisions with a deadline and fallbacks, buffered reports.

Torch-free: any decode engine can use it (see docs/controller_client.md).
"""

from controller.client.client import ControllerClient
from controller.client.config import ClientConfig, ClientStats
from controller.client.reports import RoundLike, ScoredLike, rounds_to_aggregates, self_repetition
from specd_api.plan import Plan

__all__ = [
    "ClientConfig",
    "ClientStats",
    "ControllerClient",
    "Plan",
    "RoundLike",
    "ScoredLike",
    "rounds_to_aggregates",
    "self_repetition",
]
