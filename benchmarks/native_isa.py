"""The native pass's builds side by side: v(K), target-only and speculative decode rates per instruction set,
measured interleaved in one run (each round runs every build, the order rotated), with their spread.

For each build this CPU runs (decoder/native/build.py: avx2, avx512bf16):
  - the target step and v(K) = time of a (K + 1)-token pass / time of a 1-token pass, K = 1..8, on a 200-token
    context (the median of 20 passes per size, per round);
  - decode rates at batch 1 on decode_loop's prompts (code, prose, JSON, SQL), greedy: target-only, the draft model
    at K = 2, 3, 4, 6, prompt lookup at K = 4; every output compared token for token with the same build's
    target-only output;
  - at batch 4 (the engine's continuous batching, as worker_throughput.py), the draft at K = 4 over target-only.
And, for the choice between a library and the kernel: the target's matrix products alone through PyTorch's
bfloat16 ``linear`` (oneDNN, which dispatches to AVX512-BF16 or AMX itself) for 1, 5 and 9 rows.

A stall of the machine must not move a figure: decode times are kept per (build, arm, prompt) and each prompt's
median over rounds is used; a speedup is the geometric mean over prompts of the per-prompt ratio of medians, shown
with the [min, max] of those ratios. Pass times (v(K), the step) and batch-4 ratios: the median over rounds with
[min, max].

    python benchmarks/native_isa.py                                   # the reference pair, 5 rounds
    python benchmarks/native_isa.py --rounds 9 --json figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from decode_loop import PROMPTS, cpu_model, time_forward  # this folder (the script's own path)
from worker_throughput import decode_batch

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.models import load_model
from decoder.native import build
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.sampling import SamplingParams

ARMS = [("none", 0), *(("draft", k) for k in (2, 3, 4, 6)), ("prompt_lookup", 4)]
V_SIZES = range(1, 10)  # tokens per pass: v(0) .. v(8)


def use(isa: str) -> None:
    """Run what is created or called next with build ``isa`` (pools made earlier keep theirs)."""
    os.environ[build.ISA_ENV] = isa
    build.reselect()


def arm_name(drafter: str, k: int) -> str:
    return f"{drafter}:{k}" if k else "none"


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def shown(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def library_products(model: torch.nn.Module, rows: int, repeats: int = 30) -> float:
    """Median seconds of every matrix product of one pass of ``model`` (its linear layers, the LM head included)
    through PyTorch's bfloat16 ``linear``, for ``rows`` tokens."""
    weights = [m.weight.detach().to(torch.bfloat16) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights]
    samples = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        for x, w in zip(inputs, weights, strict=True):
            torch.nn.functional.linear(x, w)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/reference/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/reference/draft"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = build.available_isas()
    if not isas:
        raise SystemExit(f"no native build runs here: {build.why_not()}")
    device = torch.device("cpu")
    target = load_model(args.target, device, torch.float32, "native")
    draft = load_model(args.draft, device, torch.float32, "native")
    decoder = SpeculativeDecoder(target, draft)
    prompts = [decoder.encode(p) for p in PROMPTS]
    batch_prompts = prompts[:4]
    rules = StopConditions(max_new_tokens=args.max_new_tokens)
    engines, kernels, references = {}, {}, {}
    for isa in isas:
        use(isa)
        engines[isa] = BatchEngine(target, draft, max_batch=4)
        kernels[isa] = KVPool(target, 1).forward_pass.kernel  # float32 weights run avx2 products in every build
        decoder.generate(prompts[0], "draft", 4, SamplingParams(), rules)  # warm-up: pack, build, caches
        references[isa] = [decoder.generate(p, "none", 0, SamplingParams(), rules).token_ids for p in prompts]
    context = (prompts[0] * 40)[:200]

    steps: dict[str, list[float]] = defaultdict(list)
    v: dict[str, list[list[float]]] = defaultdict(list)  # per round: v(1..8)
    seconds: dict[tuple[str, str, int], list[float]] = defaultdict(list)  # (isa, arm, prompt) -> per round
    batch4: dict[str, list[float]] = defaultdict(list)
    equal: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in range(args.rounds):
        for isa in isas[r % len(isas) :] + isas[: r % len(isas)]:
            use(isa)
            times = [time_forward(target, context, n, 20) for n in V_SIZES]
            steps[isa].append(times[0])
            v[isa].append([t / times[0] for t in times[1:]])
            for i, prompt in enumerate(prompts):
                shift = (r + i) % len(ARMS)
                for drafter, k in ARMS[shift:] + ARMS[:shift]:
                    started = time.perf_counter()
                    out = decoder.generate(prompt, drafter, k, SamplingParams(), rules).token_ids
                    seconds[isa, arm_name(drafter, k), i].append(time.perf_counter() - started)
                    equal[isa][0] += out == references[isa][i]
                    equal[isa][1] += 1
            engine = engines[isa]
            none_rate = decode_batch(engine, batch_prompts, "none", 0, args.max_new_tokens)[0]
            draft_rate = decode_batch(engine, batch_prompts, "draft", 4, args.max_new_tokens)[0]
            batch4[isa].append(draft_rate / none_rate)

    figures: dict[str, object] = {"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "builds": {}}
    print(f"CPU {cpu_model()}, {args.threads} threads, {args.rounds} rounds interleaved, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens; medians [min, max] over rounds")  # fmt: skip
    medians = {key: statistics.median(times) for key, times in seconds.items()}

    def rate(isa: str, arm: str) -> float:
        new_tokens = sum(len(out) for out in references[isa])  # every arm's output is the reference (counted)
        return new_tokens / sum(medians[isa, arm, i] for i in range(len(prompts)))

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> dict[str, float]:
        """b's median time over a's, per prompt: geometric mean, min and max over prompts"""
        each = [medians[(*b, i)] / medians[(*a, i)] for i in range(len(prompts))]
        return {"median": statistics.geometric_mean(each), "min": min(each), "max": max(each)}

    for isa in isas:
        arms = {arm_name(d, k): ratio((isa, arm_name(d, k)), (isa, "none")) for d, k in ARMS if k}
        best = max(arms, key=lambda name: arms[name]["median"])
        per_k = [summary([row[k] for row in v[isa]]) for k in range(8)]
        entry = {
            "kernel": kernels[isa],
            "target_step_ms": summary([s * 1e3 for s in steps[isa]]),
            "v": [s["median"] for s in per_k],
            "v_spread": per_k,
            "none_tokens_per_second": rate(isa, "none"),
            "speedups": arms,
            "best_arm": best,
            "best_arm_speedup": arms[best],
            "batch4_draft_speedup": summary(batch4[isa]),
            "greedy_equal": equal[isa],
        }
        figures["builds"][isa] = entry  # type: ignore[index]
        print(f"\n{isa} (the target's products: {kernels[isa]})")
        print(f"  target step {shown(entry['target_step_ms'], 3)} ms")  # type: ignore[arg-type]
        print("  v(1..8)     " + "  ".join(f"{s['median']:.2f}" for s in per_k))
        print(f"  target-only {rate(isa, 'none'):.0f} tokens/s (per-prompt medians)")
        for name, s in arms.items():
            print(f"  {name:<16} {shown(s)}x target-only (geomean [min, max] over prompts)")
        print(f"  best arm {best} {shown(arms[best])}x; batch 4, draft:4 {shown(summary(batch4[isa]))}x target-only")
        print(f"  greedy output equal to target-only: {equal[isa][0]}/{equal[isa][1]}")
    if "avx2" in isas:
        for isa in isas[1:]:
            faster = ratio((isa, "none"), ("avx2", "none"))
            figures[f"target_only_{isa}_vs_avx2"] = faster
            print(f"\ntarget-only, {isa} over avx2: {shown(faster)}x (geomean [min, max] over prompts)")
    onednn = {rows: library_products(target.model, rows) * 1e3 for rows in (1, 5, 9)}
    figures["onednn_products_ms"] = onednn
    print("\nthe same products through PyTorch's bfloat16 linear (oneDNN): "
          + ", ".join(f"{rows} rows {ms:.3f} ms" for rows, ms in onednn.items()))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
