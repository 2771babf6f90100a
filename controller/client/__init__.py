"""A client library for the specd controller: decisions with a deadline and fallbacks, buffered reports.

Torch-free: any decode engine can use it (see docs/controller_client.md).
"""

from controller.client.client import ControllerClient
from controller.client.config import ClientConfig, ClientStats
from controller.client.fallback import DecisionOutcome
from controller.client.reports import RoundLike, rounds_to_aggregates, self_repetition

__all__ = [
    "ClientConfig",
    "ClientStats",
    "ControllerClient",
    "DecisionOutcome",
    "RoundLike",
    "rounds_to_aggregates",
    "self_repetition",
]
