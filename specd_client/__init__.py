"""A client library for the specd controller: decisions with a deadline and fallbacks, buffered reports.

Torch-free: any decode engine can use it (see docs/controller_client.md).
"""

from specd_api.plan import Plan
from specd_api.request_features import RequestFeatures
from specd_api.rounds import RoundRecord, Scored
from specd_client.client import ControllerClient
from specd_client.config import ClientConfig, ClientStats
from specd_client.reports import RequestTotals, rounds_to_aggregates, self_repetition

__all__ = [
    "ClientConfig",
    "ClientStats",
    "ControllerClient",
    "Plan",
    "RequestFeatures",
    "RequestTotals",
    "RoundRecord",
    "Scored",
    "rounds_to_aggregates",
    "self_repetition",
]
