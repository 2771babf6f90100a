"""llama.cpp's server takes its speculation settings at start, so an adapter steers it by routing: one server per
setting, each named by drafter and K (``none``, ``draft:4``, ``prompt_lookup:8``), and each request sent to the one
its plan names. Pure: the names, the servers' arguments, and the routing rule.

**Routing.** A plan's drafter and K go to the endpoint of that drafter with the largest K at most the plan's (the
plan's rounds stop there anyway), else that drafter's smallest; a plan of ``none``, of K 0, or of a drafter with no
endpoint goes to ``none``. The adapter offers the controller only the drafters it has endpoints for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specd.llama.ngram_simple import NGRAM_SIZE

_NAME = re.compile(r"(none)|(draft|prompt_lookup):([1-9][0-9]?)")


@dataclass(frozen=True)
class Setting:
    """One speculation setting of the server: a drafter and its K (``none`` and 0 for plain decoding)."""

    drafter: str
    k: int

    @property
    def name(self) -> str:
        return "none" if self.drafter == "none" else f"{self.drafter}:{self.k}"

    def server_args(self, draft_model: Path | None) -> tuple[str, ...]:
        """llama-server's arguments for this setting (beyond the target model): drafts of exactly K a round, no
        early stop by the draft's confidence (its default p-min is 0), as the controller's model of a round
        assumes."""
        if self.drafter == "draft":
            if draft_model is None:
                raise ValueError(f"endpoint {self.name}: a draft endpoint needs server.draft_model")
            return ("--spec-type", "draft-simple", "-md", str(draft_model), "--spec-draft-n-max", str(self.k),
                    "--spec-draft-p-min", "0")  # fmt: skip
        if self.drafter == "prompt_lookup":
            return ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_SIZE),
                    "--spec-ngram-simple-size-m", str(self.k))  # fmt: skip
        return ()


def setting(name: str) -> Setting:
    """The setting an endpoint's name names; ValueError naming the forms otherwise."""
    found = _NAME.fullmatch(name)
    if found is None:
        raise ValueError(f"{name[:40]!r} is not an endpoint name: none, draft:K or prompt_lookup:K (K in 1..99)")
    if found.group(1):
        return Setting("none", 0)
    return Setting(found.group(2), int(found.group(3)))


def route(drafter: str, k: int, settings: Sequence[Setting]) -> Setting:
    """The setting a plan of ``drafter`` at K ``k`` runs on, among ``settings`` (which hold ``none``)."""
    plain = Setting("none", 0)
    same = [s for s in settings if s.drafter == drafter and s.drafter != "none"]
    if k < 1 or not same:
        return plain
    below = [s for s in same if s.k <= k]
    return max(below, key=lambda s: s.k) if below else min(same, key=lambda s: s.k)


def offered(settings: Sequence[Setting]) -> tuple[str, ...]:
    """The drafters a set of endpoints can run, each once ("none" implied)."""
    return tuple(dict.fromkeys(s.drafter for s in settings if s.drafter != "none"))
