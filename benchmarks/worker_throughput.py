"""Worker throughput: tokens/s of the continuous-batching engine at batch 1, 4, 8 and 16, with and without
speculation, measured side by side (variants interleaved per repetition) on the same prompts.

Each measurement opens B sequences (prompts cycled from the workloads of the chosen segments), decodes
``--tokens`` new tokens each with one drafter and K for all, and divides all new tokens by the wall time
(prefill included, as a serving system pays it). Greedy outputs are checked against the no-speculation
run of the same batch: every speculative variant must produce the same tokens.

    python benchmarks/worker_throughput.py --target models/reference/target --draft models/reference/draft
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoder.batch_engine import BatchEngine
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.sampling import SamplingParams
from decoder.stopping import StopRules
from specd_api.plan import requested
from workloads import load_all

GREEDY = SamplingParams()


@dataclass
class Measurement:
    tokens_per_second: list[float] = field(default_factory=list)
    alpha: list[float] = field(default_factory=list)
    mismatches: int = 0
    sequences: int = 0


def decode_batch(
    engine: BatchEngine, prompts: list[list[int]], drafter: str, k: int, tokens: int
) -> tuple[float, list[list[int]], float | None]:
    """Decode all prompts together; returns (tokens/s, outputs, α)."""
    rules = StopRules(max_new_tokens=tokens)  # no EOS: every sequence decodes the full budget
    started = time.perf_counter()
    sessions = [engine.open(p, GREEDY, rules, requested(drafter, k)) for p in prompts]  # no batch rule: every K
    live = list(sessions)
    while live:
        engine.step(live)
        for s in [s for s in live if s.finish_reason is not None]:
            engine.close(s)
        live = [s for s in live if s.finish_reason is None]
    seconds = time.perf_counter() - started
    outputs = [s.generated for s in sessions]
    proposed = sum(s.stats.num_drafted for s in sessions)
    accepted = sum(s.stats.num_accepted for s in sessions)
    return sum(map(len, outputs)) / seconds, outputs, (accepted / proposed if proposed else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/reference/target")
    parser.add_argument("--draft", default="models/reference/draft")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--segments", default="code,structured", help="workload segments to take prompts from")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    target = load_model(args.target, device, dtype)
    draft = load_model(args.draft, device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    engine = BatchEngine(target, draft, max_batch=max(batches))
    workloads = load_all("workloads")
    texts = [p.prompt for seg in args.segments.split(",") for p in workloads[seg]]
    prompts = [engine.encode(t) for t in texts]
    variants = [("none", 0), ("draft", args.k), ("prompt_lookup", args.k)]
    results: dict[tuple[int, str], Measurement] = {}
    decode_batch(engine, prompts[:2], "draft", args.k, 8)  # warm-up
    for rep in range(args.repeats):
        for b in batches:
            chosen = [prompts[(rep * 7 + i) % len(prompts)] for i in range(b)]
            reference: list[list[int]] | None = None
            order = variants if rep % 2 == 0 else variants[::-1]
            runs = {}
            for drafter, k in order:
                runs[drafter] = decode_batch(engine, chosen, drafter, k, args.tokens)
            reference = runs["none"][1]
            for drafter, _ in variants:
                rate, outputs, alpha = runs[drafter]
                m = results.setdefault((b, drafter), Measurement())
                m.tokens_per_second.append(rate)
                if alpha is not None:
                    m.alpha.append(alpha)
                m.mismatches += sum(o != r for o, r in zip(outputs, reference, strict=True))
                m.sequences += len(outputs)
    print(f"device {device}, dtype {dtype}, {args.threads} threads, K={args.k}, {args.tokens} new tokens/sequence, "
          f"{args.repeats} repeats, prompts from {args.segments}")  # fmt: skip
    print(f"{'batch':>5} {'drafter':<14} {'tok/s':>8} {'vs none':>8} {'alpha':>6} {'same output':>12}")
    for b in batches:
        base = statistics.median(results[(b, "none")].tokens_per_second)
        for drafter, _ in variants:
            m = results[(b, drafter)]
            rate = statistics.median(m.tokens_per_second)
            alpha = f"{statistics.mean(m.alpha):.2f}" if m.alpha else "-"
            same = "yes" if m.mismatches == 0 else f"{m.mismatches} differ"
            print(f"{b:>5} {drafter:<14} {rate:>8.1f} {rate / base:>7.2f}x {alpha:>6} {same:>12}")
    if args.json:
        from benchmarks.decode_loop import read_bandwidth_gbps

        def figures(m: Measurement, none: Measurement) -> dict[str, object]:
            rate = statistics.median(m.tokens_per_second)
            return {
                "tokens_per_second": rate,
                "vs_none": rate / statistics.median(none.tokens_per_second),
                "alpha": statistics.mean(m.alpha) if m.alpha else None,
                "same_tokens": [m.sequences - m.mismatches, m.sequences],
            }

        document = {
            "batches": {
                str(b): {drafter: figures(results[(b, drafter)], results[(b, "none")]) for drafter, _ in variants}
                for b in batches
            },
            "bandwidth_gbps": read_bandwidth_gbps(device),
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
