"""The engine's costs measured alone (no worker, no controller): what the controller's learned costs should match.

The continuous-batching engine decodes a few prompts of each segment at batch 1 with no speculation and with the
draft model at every K from 1 to 8, all in one thread (models loaded there too, as the worker does). From its own
round records: one target step t0 (the median round that verified no draft), c = the median drafting seconds per
drafted token / t0, and v(n) = the median verification time of rounds that verified n drafts / t0. Medians, as the
controller's own costs: on a shared machine one stalled round among a few hundred can make the mean step 3.6x the
median and every v(n) read below 1.
"""

from __future__ import annotations

import statistics
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from decoder.batch_engine import BatchEngine
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from workloads import Prompt

KS = tuple(range(1, 9))


@dataclass(frozen=True)
class EngineCosts:
    step_seconds: float
    c_draft: float
    v: list[float]  # v(n), n = 0..8 (0.0 where no round drafted n)
    rounds: list[int]  # rounds behind each v(n)


def engine_costs(engine: BatchEngine, prompts: Sequence[list[int]], max_new_tokens: int) -> EngineCosts:
    verify: dict[int, list[float]] = defaultdict(list)
    per_token: list[float] = []  # drafting seconds per drafted token, per round
    for ids in prompts:
        for drafter, k in (("none", 0), *(("draft", k) for k in KS)):
            session = engine.open(ids, SamplingParams(), StopConditions(max_new_tokens), requested(drafter, k))
            while session.finish_reason is None:
                engine.step([session])
            engine.close(session)
            for r in session.stats.rounds:
                verify[r.num_drafted].append(r.verify_seconds)
                if r.drafter == "draft" and r.num_drafted:
                    per_token.append(r.draft_seconds / r.num_drafted)
    t0 = statistics.median(verify[0])
    v = [statistics.median(verify[n]) / t0 if verify.get(n) else 0.0 for n in range(max(KS) + 1)]
    c = statistics.median(per_token) / t0 if per_token else 0.0
    return EngineCosts(t0, c, v, [len(verify.get(n, [])) for n in range(max(KS) + 1)])


def measure_engine_costs(
    target: Path, draft: Path, dtype: str, prompts: Mapping[str, Sequence[Prompt]], per_segment: int = 2,
    max_new_tokens: int = 48,
) -> EngineCosts:  # fmt: skip
    """Load the pair and measure, all in one fresh thread (one OpenMP pool, as in the worker)."""
    result: list[EngineCosts] = []

    def run() -> None:
        device = resolve_device("cpu")
        chosen_dtype = parse_dtype(dtype, device)
        engine = BatchEngine(load_model(target, device, chosen_dtype), load_model(draft, device, chosen_dtype))
        chosen = [engine.encode(p.prompt) for ps in prompts.values() for p in list(ps)[:per_segment]]
        with torch.inference_mode():
            result.append(engine_costs(engine, chosen, max_new_tokens))

    thread = threading.Thread(target=run, name="specd-bench-costs")
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("the engine cost measurement failed (see the log above)")
    return result[0]
