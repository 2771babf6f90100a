"""The speedup curve over α and K from real kernel costs: the set-acceptance drafter (benchmarks/set_acceptance.py)
at each (α, K) against target-only, every ratio measured side by side.

Per repeat and prompt, target-only and every (α, K) run back to back in an order rotated from one prompt to the
next, so each ratio (decode tokens/s over the target-only run's of the same prompt and repeat) compares runs
seconds apart; the curve gives each (α, K)'s median ratio with its quartiles and range, the α the engine measured
(accepted / verified), and the speedup the model predicts from the set α and the costs measured alone
(``specd_api.speedup.speedup_curve``).
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.kept_slots import KeptSlots, decode_with
from benchmarks.roofline import synchronize
from benchmarks.set_acceptance import SetAcceptanceDrafter, corrupted, verified_acceptance
from decoder.drafters.base import Drafter, NoDrafter
from decoder.engine import GenerationResult
from decoder.kv_cache import ModelSequence
from decoder.models import LoadedModel
from specd_api.speedup import speedup_curve

Variant = tuple[float, int]  # (α, K); (1.0, 0) is target-only
TARGET_ONLY: Variant = (1.0, 0)


@dataclass
class Point:
    """One (α, K)'s runs."""

    ratios: list[float] = field(default_factory=list)  # decode tokens/s over target-only's, per (repeat, prompt)
    accepted: int = 0
    verified: int = 0
    rounds: int = 0
    tokens: int = 0
    same_tokens: int = 0
    runs: int = 0


def proposal_seed(seed: int, prompt: int, alpha: float) -> int:
    """One corruption per (prompt, α): every K at that α meets the same wrong tokens."""
    return zlib.crc32(f"{seed}:{prompt}:{alpha!r}".encode())


def measure_curve(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: Sequence[list[int]],
    references: Sequence[list[int]],  # per prompt: the target's greedy continuation (the target-only pass)
    alphas: Sequence[float],
    ks: Sequence[int],
    repeats: int,
    warmup_prompts: int,
    seed: int = 0,
) -> dict[Variant, Point]:
    """Every (α, K) against target-only, ``repeats`` times over ``prompts``, after one uncounted pass over the first
    ``warmup_prompts`` of them (all of them: every KV length and width the counted passes visit, greedy decoding
    being deterministic)."""
    proposals = {
        (i, alpha): corrupted(torch.tensor(p + r), len(p), alpha, target.vocab_size, proposal_seed(seed, i, alpha))
        for i, (p, r) in enumerate(zip(prompts, references, strict=True))
        for alpha in alphas
    }
    variants = [TARGET_ONLY, *((alpha, k) for alpha in alphas for k in ks)]
    slots = KeptSlots(target, draft)

    def drafter(i: int, variant: Variant, draft_seq: ModelSequence | None) -> Drafter:
        if variant == TARGET_ONLY:
            return NoDrafter()
        return SetAcceptanceDrafter(draft, proposals[i, variant[0]], draft_seq)

    def decode(i: int, variant: Variant) -> GenerationResult:
        with slots.lend(variant != TARGET_ONLY) as (target_seq, draft_seq):
            made = drafter(i, variant, draft_seq)
            return decode_with(target, made, prompts[i], variant[1], len(references[i]), target_seq)

    for i in range(warmup_prompts):
        for variant in variants:
            decode(i, variant)
    points = {v: Point() for v in variants}
    for rep in range(repeats):
        for i in range(len(prompts)):
            shift = (rep * len(prompts) + i) % len(variants)
            rates = {}
            for variant in variants[shift:] + variants[:shift]:  # rotate: no variant always runs first
                synchronize(target.device)
                result = decode(i, variant)
                synchronize(target.device)
                stats = result.stats
                rates[variant] = len(result.token_ids) / stats.decode_seconds
                point = points[variant]
                a, v = verified_acceptance(stats.rounds)
                point.accepted, point.verified = point.accepted + a, point.verified + v
                point.rounds += stats.num_rounds
                point.tokens += len(result.token_ids)
                point.same_tokens += result.token_ids == references[i]
                point.runs += 1
            for variant in variants:
                points[variant].ratios.append(rates[variant] / rates[TARGET_ONLY])
    return points


def curve_json(points: dict[Variant, Point], c_draft: float, v: Sequence[float]) -> list[dict[str, Any]]:
    """One row per (α, K): measured ratio (median, quartiles, range), measured α and τ, predicted speedup."""
    rows = []
    for (alpha, k), point in points.items():
        if (alpha, k) == TARGET_ONLY:
            continue
        ratios = sorted(point.ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        rows.append(
            {
                "alpha": alpha,
                "k": k,
                "speedup": statistics.median(ratios),
                "speedup_quartiles": [quartiles[0], quartiles[2]],
                "speedup_range": [ratios[0], ratios[-1]],
                "samples": len(ratios),
                "measured_alpha": point.accepted / point.verified if point.verified else None,
                "verified_positions": point.verified,
                "tau": point.tokens / point.rounds if point.rounds else None,
                "predicted": speedup_curve([alpha] * k, [1.0] * k, k, c_draft, v)[-1],
                "same_tokens": [point.same_tokens, point.runs],
            }
        )
    return rows


def print_curve(rows: list[dict[str, Any]]) -> None:
    print("\nspeedup over target-only with the set-acceptance drafter (real draft and target passes; median of "
          "side-by-side ratios [quartiles], predicted from the set α and the costs alone)")  # fmt: skip
    print(f"  {'alpha':>5} {'K':>2} {'speedup':>8} {'quartiles':>13} {'predicted':>9} {'alpha meas.':>11} "
          f"{'tau':>5} {'same':>7}")  # fmt: skip
    for r in rows:
        q1, q3 = r["speedup_quartiles"]
        measured = f"{r['measured_alpha']:.3f}" if r["measured_alpha"] is not None else "-"
        same = f"{r['same_tokens'][0]}/{r['same_tokens'][1]}"
        print(f"  {r['alpha']:>5.2f} {r['k']:>2} {r['speedup']:>7.2f}x {q1:>6.2f}-{q3:<6.2f} {r['predicted']:>8.2f}x "
              f"{measured:>11} {r['tau']:>5.2f} {same:>7}")  # fmt: skip
    best: dict[float, dict[str, Any]] = {}
    for r in rows:
        if r["alpha"] not in best or r["speedup"] > best[r["alpha"]]["speedup"]:
            best[r["alpha"]] = r
    print("  best K: " + ", ".join(f"α {a:.2f}: K={r['k']} {r['speedup']:.2f}x" for a, r in best.items()))
