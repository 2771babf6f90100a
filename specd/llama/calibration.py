"""The adapter's cost calibration at start-up: llama-server's own timings of a plain step, of a pass that verifies n
drafts (n = 1..the largest K of its endpoints) and of a step of the draft model, reported as ``start_up_timings``
rounds. A request's totals carry no costs (``specd_client.RequestTotals``), so without these the controller would
price K with the policy's defaults, not llama.cpp's on this machine.

**A verification pass of n drafts** is timed as the server's processing of n + 1 new tokens after a cached prefix
(``timings.prompt_ms`` where ``prompt_n`` is n + 1): the same batched forward pass, which computes the output layer for
the last position only, so it prices verification a little low where the output layer is a large part of a step. A
sample whose ``prompt_n`` is not n + 1 (the cache did not hold the prefix) is left out. **The draft model's step** is
timed the same way (one new token) on a server of the draft model, started for the calibration and stopped.

Each n is timed in SEQUENCES sequences of ROUNDS_PER_SEQUENCE passes, each sequence reported on its own: one
observation of the controller's medians (a stalled sample is one rank among them), and together the rounds a cost
needs before it counts as measured (``controller/decision/cost_model.py``: 20 rounds of an n, 50 drafted tokens). The
rounds are greedy: sampled requests' costs are learned from traffic (the totals teach none) or the defaults.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import httpx

from specd.llama.server import running, tokens
from specd_api.rounds import RoundRecord

log = logging.getLogger("specd.llama.adapter")
SEQUENCES = 4
ROUNDS_PER_SEQUENCE = 5  # a pass of n drafts: 20 rounds of each n
DRAFT_ROUNDS_PER_SEQUENCE = 13  # a draft-model step: 52 drafted tokens
PROBE_TEXT = (
    "The controller learns, per segment, how often a draft agrees with the target, and what a round costs on the "
    "machine that runs it; a worker asks it how to speculate before each request and reports what happened after."
)


def probe_prefix(url: str) -> list[int]:
    """PROBE_TEXT as the server tokenizes it: the cached prefix every timed pass follows."""
    return tokens(url, PROBE_TEXT)


def timed_passes(url: str, prefix: Sequence[int], widths: Sequence[int], samples: int) -> dict[int, list[float]]:
    """Seconds of the server's pass over ``w`` new tokens after the cached ``prefix``, ``samples`` times per width."""
    out: dict[int, list[float]] = {w: [] for w in widths}
    with httpx.Client(timeout=120) as http:

        def run(prompt: list[int]) -> dict[str, float]:
            body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True}
            answer = http.post(f"{url}/completion", json=body)
            answer.raise_for_status()
            return dict(answer.json().get("timings") or {})

        run(list(prefix))  # the prefix in the slot's cache
        turn = 0
        for _ in range(samples):
            for w in widths:
                turn += 1  # new tokens that differ from the last call's at their first: only they are processed
                new = [prefix[(turn * 7 + i * 3) % len(prefix)] for i in range(w)]
                if len(prefix) > 1 and new[0] == prefix[0]:
                    new[0] = prefix[1]
                timings = run([*prefix, *new])
                if int(timings.get("prompt_n", -1)) == w and float(timings.get("prompt_ms", 0.0)) > 0:
                    out[w].append(float(timings["prompt_ms"]) / 1000.0)
    return out


def calibration_sequences(
    verify: dict[int, list[float]], draft_step: Sequence[float], max_k: int, lookup: bool
) -> list[list[RoundRecord]]:
    """The measured passes as SEQUENCES sequences of rounds: plain steps (n = 0), prompt lookup's rounds of n drafts
    (n = 1..max_k; its drafting costs nothing measurable) where ``lookup``, and draft-model rounds of one draft (its
    step, then a pass of one draft) for each ``draft_step`` sample."""
    rounds: list[list[RoundRecord]] = [[] for _ in range(SEQUENCES)]

    def deal(made: list[RoundRecord]) -> None:
        for i, r in enumerate(made):
            rounds[i % SEQUENCES].append(r)

    deal([RoundRecord("none", 0, 0, 0, 1, 0.0, s) for s in verify.get(1, [])])
    for n in range(1, max_k + 1 if lookup else 1):
        deal([RoundRecord("prompt_lookup", n, n, 0, 1, 0.0, s) for s in verify.get(n + 1, [])])
    one = verify.get(2, [])
    deal([RoundRecord("draft", 1, 1, 0, 1, d, one[i % len(one)]) for i, d in enumerate(draft_step) if one])
    return [sequence for sequence in rounds if sequence]


def measure(
    plain_url: str, prefix: Sequence[int], max_k: int, lookup: bool, draft: tuple[Path, Path, Sequence[str]] | None,
    log_dir: Path,
) -> list[list[RoundRecord]]:  # fmt: skip
    """The calibration's sequences: the plain server's passes of 1..max_k + 1 new tokens, and with ``draft`` (the
    server binary, the draft model and the servers' arguments) the draft model's step."""
    verify = timed_passes(plain_url, prefix, range(1, max_k + 2), SEQUENCES * ROUNDS_PER_SEQUENCE)
    draft_step: list[float] = []
    if draft is not None:
        binary, model, args = draft
        with running(binary, model, args, log=log_dir / "llama-server-calibration-draft.log") as url:
            draft_step = timed_passes(url, prefix, (1,), SEQUENCES * DRAFT_ROUNDS_PER_SEQUENCE)[1]
    summary = {w: round(1000 * sorted(s)[len(s) // 2], 2) for w, s in verify.items() if s}
    log.info("calibration: pass of n + 1 tokens (ms, median) %s; draft step %s ms", summary,
             round(1000 * sorted(draft_step)[len(draft_step) // 2], 2) if draft_step else "-")  # fmt: skip
    return calibration_sequences(verify, draft_step, max_k, lookup)
