"""Drafters: what proposes tokens for the target to verify."""

from decoder.choices import DRAFTER_NAMES
from decoder.drafters.base import EMPTY_TOKENS, Draft, Drafter, NoDrafter
from decoder.drafters.chain import ChainDrafter
from decoder.drafters.draft_model import DraftModelDrafter, draft_model_of
from decoder.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter, find_continuation
from decoder.drafters.suffix import SuffixDrafter
from decoder.drafters.suffix_cache import SuffixCache, SuffixConfig

__all__ = [
    "DRAFTER_NAMES",
    "EMPTY_TOKENS",
    "ChainDrafter",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "NoDrafter",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "SuffixCache",
    "SuffixConfig",
    "SuffixDrafter",
    "draft_model_of",
    "find_continuation",
]
