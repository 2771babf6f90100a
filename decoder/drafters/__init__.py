"""Drafters: what proposes tokens for the target to verify."""

from decoder.choices import DRAFTER_NAMES
from decoder.drafters.base import Draft, Drafter, NoDrafter
from decoder.drafters.draft_model import DraftModelDrafter
from decoder.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter, find_continuation

__all__ = [
    "DRAFTER_NAMES",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "NoDrafter",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "find_continuation",
]
