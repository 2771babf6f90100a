"""A/A: what being controlled costs the data plane. The same prompts through two workers on the same models: the
controlled one (it asks the controller, which answers ``none`` for every request of the ``aa/`` segments, reports its
rounds, scores the counterfactual drafters and watches the decision tables) and an uncontrolled one (no controller at
all). Both decode every token plainly, so any difference is the control plane's.

Per prompt, the controlled worker's decode rate over the uncontrolled one's (the two requests sent back to back, the
order alternating per prompt), and the same for the wall time of the whole HTTP request (Decide, scoring and the
answer included). The figure is the median of the per-prompt ratios with its bootstrap interval (specd.bench.measure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specd.bench.measure import NONE, Figure, PromptRatio, figure
from specd.demo.configs import AA_PREFIX
from workloads import Prompt

CONTROLLED, UNCONTROLLED = "controlled", "uncontrolled"


@dataclass(frozen=True)
class Pair:
    """One prompt through both workers: their decode and wall seconds, and the tokens each emitted."""

    prompt_id: str
    segment: str
    tokens: dict[str, int]
    decode_seconds: dict[str, float]
    wall_seconds: dict[str, float]
    drafter: str  # what the controlled worker ran (the A/A holds only if it is none)

    def ratio(self, kind: str) -> float:
        """Controlled rate over uncontrolled rate, by decode (``decode``) or whole-request (``wall``) seconds."""
        seconds = self.decode_seconds if kind == "decode" else self.wall_seconds
        rates = {w: self.tokens[w] / seconds[w] if seconds[w] > 0 else 0.0 for w in (CONTROLLED, UNCONTROLLED)}
        return rates[CONTROLLED] / rates[UNCONTROLLED] if rates[UNCONTROLLED] > 0 else 0.0


def request_body(prompt: Prompt, max_new_tokens: int, segment: str) -> dict[str, Any]:
    return {
        "prompt": prompt.prompt,
        "max_tokens": min(prompt.max_new_tokens, max_new_tokens),
        "temperature": prompt.temperature,
        "seed": 1234,
        "segment": segment,
        "share_outputs": False,
        "stream": False,
    }


def run_pairs(
    client: httpx.Client,
    urls: dict[str, str],
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    clock: Callable[[], float],
    done: Callable[[], None] = lambda: None,
) -> list[Pair]:
    """Every prompt through both workers back to back, the first alternating; the controlled worker's requests are
    sent under aa/<segment>. Raises RuntimeError naming a request that failed."""
    pairs = []
    for i, prompt in enumerate(prompts):
        order = (CONTROLLED, UNCONTROLLED) if i % 2 == 0 else (UNCONTROLLED, CONTROLLED)
        tokens: dict[str, int] = {}
        decode: dict[str, float] = {}
        wall: dict[str, float] = {}
        drafter = NONE
        for worker in order:
            segment = f"{AA_PREFIX}{prompt.segment}" if worker == CONTROLLED else prompt.segment
            started = clock()
            response = client.post(f"{urls[worker]}/v1/completions", json=request_body(prompt, max_new_tokens, segment))
            wall[worker] = clock() - started
            if response.status_code != 200:
                raise RuntimeError(f"A/A: {worker} worker on {prompt.id}: HTTP {response.status_code}: "
                                   f"{response.text[:200]}")  # fmt: skip
            answer = response.json()
            tokens[worker] = int(answer["usage"]["completion_tokens"])
            decode[worker] = float(answer["specd"].get("decode_seconds", 0.0))
            if worker == CONTROLLED:
                drafter = str(answer["specd"].get("drafter", NONE))
            done()
        pairs.append(Pair(prompt.id, prompt.segment, tokens, decode, wall, drafter))
    return pairs


def aa_figures(pairs: Sequence[Pair], run: int = 0) -> dict[str, Figure]:
    """The paired figures: ``decode`` (decode rates) and ``wall`` (whole requests as the client timed them)."""
    out = {}
    for kind in ("decode", "wall"):
        ratios = [PromptRatio((run, p.segment, p.prompt_id), p.ratio(kind), p.tokens[UNCONTROLLED]) for p in pairs]
        out[kind] = figure([r for r in ratios if r.ratio > 0])
    return out


def summary(pairs: Sequence[Pair], figures: dict[str, Figure]) -> dict[str, Any]:
    """The A/A's entries for a report: the paired medians, their intervals, and whether every controlled request
    ran without speculation (else the A/A is not one)."""
    return {
        "controlled_none_vs_uncontrolled": figures["decode"].median,
        "controlled_none_vs_uncontrolled_interval": list(figures["decode"].interval),
        "controlled_none_vs_uncontrolled_wall": figures["wall"].median,
        "controlled_none_vs_uncontrolled_wall_interval": list(figures["wall"].interval),
        "pairs": len(pairs),
        "all_none": all(p.drafter == NONE for p in pairs),
    }


def write_pairs(path: Path, pairs: Sequence[Pair]) -> None:
    import json

    path.write_text(json.dumps([p.__dict__ for p in pairs], indent=1) + "\n")
