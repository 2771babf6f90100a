"""α, τ and measured speedup per segment × drafter × K, greedy and sampled, on the segment workloads.

For each segment, each prompt is decoded with every arm (no speculation, the draft model, prompt lookup and suffix
decoding at each K; suffix decoding's cache holds the segment's earlier prompts' outputs) back to back, so the
speedups compare runs made under the same machine load. Writes a Markdown table and a JSON file, and prints the best
arm per segment.

    python benchmarks/alpha_table.py --target PATH --draft PATH [--ks 1,2,4,8] [--temperatures 0,0.8]
        [--prompts 12] [--out docs/alpha_table]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoder.engine import SpeculativeDecoder
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import Plan
from specd_api.position_tally import PositionTally
from workloads import Prompt, load_all

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Cell:
    """Totals of one (segment, temperature, drafter, K)."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    per_position: PositionTally = field(default_factory=PositionTally)

    def add(self, stats) -> None:  # type: ignore[no-untyped-def]
        self.proposed += stats.num_drafted
        self.accepted += stats.num_accepted
        self.rounds += stats.num_rounds
        self.tokens += stats.num_new_tokens
        self.seconds += stats.total_seconds
        self.per_position.merge(stats.position_tally())

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def arms(ks: list[int]) -> list[tuple[str, int]]:
    return [("none", 0)] + [(d, k) for d in ("draft", "prompt_lookup", "suffix") for k in ks]


def measure(
    decoder: SpeculativeDecoder, prompts: dict[str, list[Prompt]], ks: list[int], temperatures: list[float], seed: int
) -> dict[tuple[str, float, str, int], Cell]:
    cells: dict[tuple[str, float, str, int], Cell] = defaultdict(Cell)
    for segment, items in prompts.items():
        for temperature in temperatures:
            for n, prompt in enumerate(items):
                ids = decoder.encode(prompt.prompt)
                rules = StopConditions(prompt.max_new_tokens)  # no EOS: every arm decodes the same length
                served: list[int] = []
                for drafter, k in arms(ks):
                    params = SamplingParams(temperature=temperature, seed=seed + n if temperature else None)
                    plan = Plan(drafter, k, segment=f"{segment}@{temperature}")  # suffix reads this segment's outputs
                    result = decoder.decode(ids, params, rules, plan)
                    cells[(segment, temperature, drafter, k)].add(result.stats)
                    served = served or result.token_ids
                # Served only now: suffix decoding proposes from the segment's earlier prompts' outputs, as a worker
                # that served them would, never from this prompt's own (every arm decodes the same prompt).
                decoder.suffix_cache.add(f"{segment}@{temperature}", served)
            print(f"  {segment} at temperature {temperature}: {len(items)} prompts done", flush=True)
    return cells


def best_arms(cells: dict[tuple[str, float, str, int], Cell]) -> dict[tuple[str, float], tuple[str, int, float]]:
    best: dict[tuple[str, float], tuple[str, int, float]] = {}
    for (segment, temperature, drafter, k), cell in cells.items():
        base = cells[(segment, temperature, "none", 0)].tokens_per_second
        speedup = cell.tokens_per_second / base if base else 0.0
        current = best.get((segment, temperature))
        if current is None or speedup > current[2]:
            best[(segment, temperature)] = (drafter, k, speedup)
    return best


def markdown(cells: dict[tuple[str, float, str, int], Cell], ks: list[int], header: str) -> str:
    best = best_arms(cells)
    lines = [header, ""]
    for (segment, temperature), (drafter, k, speedup) in sorted(best.items()):
        arm = "no speculation" if drafter == "none" else f"{drafter} K={k}"
        lines.append(f"- **{segment}**, temperature {temperature}: best is {arm} ({speedup:.2f}x)")
    lines += [
        "",
        "| segment | temp | drafter | K | α | τ | tok/s | speedup vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (segment, temperature, drafter, k), cell in sorted(cells.items()):
        base = cells[(segment, temperature, "none", 0)].tokens_per_second
        alpha = f"{cell.alpha:.2f}" if cell.alpha is not None else "-"
        lines.append(
            f"| {segment} | {temperature} | {drafter} | {k} | {alpha} | {cell.tau:.2f} | "
            f"{cell.tokens_per_second:.0f} | {cell.tokens_per_second / base:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--workloads", type=Path, default=REPO / "workloads")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per segment (the first N)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "alpha_table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    device = resolve_device("auto")
    target = load_model(args.target, device, parse_dtype("float32"))
    draft = load_model(args.draft, device, parse_dtype("float32"))
    decoder = SpeculativeDecoder(target, draft)
    prompts = {segment: items[: args.prompts] for segment, items in load_all(args.workloads).items()}
    start = time.perf_counter()
    cells = measure(decoder, prompts, ks, temperatures, args.seed)
    header = (
        f"# α per segment × drafter × K\n\ntarget `{args.target}`, draft `{args.draft}`, {args.prompts} prompts per "
        f"segment, {torch.get_num_threads()} threads on {device}, {time.perf_counter() - start:.0f} s. "
        "Speedup = tokens/s of the arm / tokens/s without speculation on the same prompts, measured back to back."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(cells, ks, header))
    args.out.with_suffix(".json").write_text(
        json.dumps(
            [
                {"segment": s, "temperature": t, "drafter": d, "k": k, "alpha": c.alpha, "tau": c.tau,
                 "tokens_per_second": c.tokens_per_second, "per_position": c.per_position.proposed_and_accepted()}
                for (s, t, d, k), c in sorted(cells.items())
            ],
            indent=1,
        )
    )  # fmt: skip
    for (segment, temperature), (drafter, k, speedup) in sorted(best_arms(cells).items()):
        print(f"{segment:<12} T={temperature}: best {drafter} K={k} ({speedup:.2f}x)")
    print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
