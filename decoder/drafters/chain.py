"""The chain: prompt lookup first, the draft model when lookup finds no match (llama.cpp's, exllamav3's and
Arctic's static chain), one drafter to the controller and a rival it must beat.

A round proposes lookup's tokens when it finds at least one, else the draft model's. Lookup's proposals are
one-hot (no q), the draft's carry its q: acceptance takes either, round by round. The draft model sees no token
in a round lookup serves; it catches up lazily, the next time it drafts (``propose_together`` feeds whatever its
cache has not seen), so a run of lookup rounds costs no draft pass. K per round is the plan's rule, as for every
drafter.
"""

from __future__ import annotations

import torch

from decoder.drafters.base import Draft, Drafter
from decoder.drafters.draft_model import DraftModelDrafter, RunsDraftModel
from decoder.drafters.prompt_lookup import PromptLookupDrafter


class ChainDrafter(Drafter, RunsDraftModel):
    name = "chain"

    def __init__(self, lookup: PromptLookupDrafter, model: DraftModelDrafter) -> None:
        self.lookup = lookup
        self.model = model

    @property
    def draft_model(self) -> DraftModelDrafter:
        return self.model

    def prefill(self, context: torch.Tensor) -> None:
        self.model.prefill(context)

    def drafts_with_model(self, context: torch.Tensor, k: int) -> bool:
        return k > 0 and self.lookup.propose(context, k).num_tokens == 0

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        found = self.lookup.propose(context, k)
        return found if found.num_tokens > 0 else self.model.propose(context, k)

    def rollback(self, context: torch.Tensor) -> None:
        self.lookup.rollback(context)
        self.model.rollback(context)
