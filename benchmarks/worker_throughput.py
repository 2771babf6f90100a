"""Worker throughput: tokens/s of the continuous-batching engine at batch 1, 4, 8 and 16, with and without
speculation, measured side by side (variants interleaved per repetition) on the same prompts.

Each measurement opens B sequences (prompts cycled from the workloads of the chosen segments), decodes
``--tokens`` new tokens each with one drafter and K for all, and divides all new tokens by the wall time
(prefill included, as a serving system pays it). Greedy outputs are checked against the no-speculation
run of the same batch: every speculative variant must produce the same tokens.

    python benchmarks/worker_throughput.py --target models/reference/target --draft models/reference/draft

On a GPU, up to batch 64 (the first repetition then runs uncounted: every (batch, width, KV length) the counted
ones visit is seen once, so no first visit's kernel plans are timed):

    python -m benchmarks.worker_throughput --device cuda --dtype bfloat16 --batches 1,2,4,8,16,32,64 \
        --variants none,draft --json F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import synchronize
from decoder.batch_engine import BatchEngine
from decoder.choices import RUNNER_NAMES
from decoder.models import load_model, parse_dtype, resolve_device
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
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
    rules = StopConditions(max_new_tokens=tokens)  # no EOS: every sequence decodes the full budget
    synchronize(engine.target.device)
    started = time.perf_counter()
    sessions = [engine.open(p, GREEDY, rules, requested(drafter, k)) for p in prompts]  # no batch rule: every K
    live = list(sessions)
    while live:
        engine.step(live)
        for s in [s for s in live if s.finish_reason is not None]:
            engine.close(s)
        live = [s for s in live if s.finish_reason is None]
    synchronize(engine.target.device)
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
    parser.add_argument("--runner", choices=RUNNER_NAMES, default="auto", help="the models' forward pass")
    parser.add_argument("--variants", default="none,draft,prompt_lookup", help="drafters to run (none always)")
    parser.add_argument(
        "--warmup", choices=("auto", "short", "full"), default="auto",
        help="short: one small batch; full: a whole uncounted repetition first (every batch, width and KV length the "
        "counted ones visit); auto: full on a GPU, short on a CPU",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    target = load_model(args.target, device, dtype, args.runner)
    draft = load_model(args.draft, device, dtype, args.runner)
    batches = [int(b) for b in args.batches.split(",")]
    engine = BatchEngine(target, draft, max_batch=max(batches))
    started = time.perf_counter()
    captured = engine.capture_graphs()  # as the worker does before serving: no capture inside a measured batch
    if captured:
        print(f"CUDA graphs: {captured} captured in {time.perf_counter() - started:.1f} s (target and draft pools)")
    workloads = load_all("workloads")
    texts = [p.prompt for seg in args.segments.split(",") for p in workloads[seg]]
    # a prompt keeps its last tokens where the target's context could not hold it and the output (a small model)
    room = int(getattr(target.model.config, "max_position_embeddings", 0) or 1 << 30) - args.tokens - args.k - 2
    prompts = [engine.encode(t)[-room:] for t in texts]
    drafters = ["none", *(d for d in args.variants.split(",") if d and d != "none")]
    variants = [(d, 0 if d == "none" else args.k) for d in drafters]
    results: dict[tuple[int, str], Measurement] = {}
    full_warmup = args.warmup == "full" or (args.warmup == "auto" and device.type == "cuda")
    if not full_warmup:
        decode_batch(engine, prompts[:2], "draft", args.k, 8)  # warm-up
    for rep in range(-1 if full_warmup else 0, args.repeats):  # rep -1: the full warm-up, not counted
        for b in batches:
            offset = 0 if full_warmup else rep * 7  # after a full warm-up every repetition reruns what it saw
            chosen = [prompts[(offset + i) % len(prompts)] for i in range(b)]
            reference: list[list[int]] | None = None
            order = variants if rep % 2 == 0 else variants[::-1]
            runs = {}
            for drafter, k in order:
                runs[drafter] = decode_batch(engine, chosen, drafter, k, args.tokens)
            reference = runs["none"][1]
            if rep < 0:
                continue
            for drafter, _ in variants:
                rate, outputs, alpha = runs[drafter]
                m = results.setdefault((b, drafter), Measurement())
                m.tokens_per_second.append(rate)
                if alpha is not None:
                    m.alpha.append(alpha)
                m.mismatches += sum(o != r for o, r in zip(outputs, reference, strict=True))
                m.sequences += len(outputs)
    forward = engine.target_pool.forward_pass
    print(
        f"device {device}, dtype {dtype}, runner {target.runner} (the {forward.name} pass), {args.threads} threads, "
        f"K={args.k}, {args.tokens} new tokens/sequence, {args.repeats} repeats, prompts from {args.segments}"
    )
    print(f"{'batch':>5} {'drafter':<14} {'tok/s':>8} {'vs none':>8} {'alpha':>6} {'same output':>12}")
    for b in batches:
        base = statistics.median(results[(b, "none")].tokens_per_second)
        for drafter, _ in variants:
            m = results[(b, drafter)]
            rate = statistics.median(m.tokens_per_second)
            shown = f"{statistics.mean(m.alpha):.2f}" if m.alpha else "-"
            same = "yes" if m.mismatches == 0 else f"{m.mismatches} differ"
            print(f"{b:>5} {drafter:<14} {rate:>8.1f} {rate / base:>7.2f}x {shown:>6} {same:>12}")
    if args.json:
        from benchmarks.decode_loop import device_json, read_bandwidth_gbps

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
            "forward_pass": {"runner": forward.name, "dtype": forward.dtype_name, "kernel": forward.kernel},
            "device": device_json(device),
            "settings": {"k": args.k, "tokens": args.tokens, "repeats": args.repeats, "warmup": "full" if full_warmup
                         else "short", "segments": args.segments},
        }  # fmt: skip
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
