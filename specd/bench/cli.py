"""`specd bench`: arguments in, ``run_bench`` out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from specd.bench.noise import StallNoise, parse_noise


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of batch sizes, got {text!r}") from None
    if not sizes or any(b < 1 or b > 64 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be 1..64, got {text!r}")
    return sizes


def _noise(text: str) -> StallNoise:
    try:
        return parse_noise(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(commands: Any) -> None:
    from specd.demo.configs import REFERENCE, ROOT

    p = commands.add_parser(
        "bench",
        help="measure adaptive speculation against every static arm and the oracle, through the real services",
        description="Start the controller and a worker, send every prompt through no speculation, every static "
        "(drafter, K) and the adaptive arm (the controller starting cold), then again warm; write bench.json, "
        "BENCH.md and plots under --out.",
    )
    p.add_argument("--workload", type=Path, nargs="+", metavar="FILE",
                   help="workload JSONL files ({id, segment, prompt, max_new_tokens, temperature} per line); "
                   "default: the shipped workloads/*.jsonl")  # fmt: skip
    p.add_argument("--prompts-per-segment", type=_positive, default=12, metavar="N", help="default 12")
    p.add_argument("--max-new-tokens", type=_positive, default=128, metavar="N", help="cap per prompt (default 128)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    p.add_argument("--repeats", type=_positive, default=1, metavar="N",
                   help="N independent runs of the whole measurement, each with fresh services (a fresh "
                   "controller) in DIR/run-1 .. run-N; bench.json gives each run's headline figures and their "
                   "spread (default 1)")  # fmt: skip
    p.add_argument("--noise", type=_noise, default=None, metavar="stall:P:MS",
                   help="make the worker stall a share P (0..1) of requests for MS milliseconds, once each, inside "
                   "the timed target pass of their second round: robustness measured on purpose (default: "
                   "none)")  # fmt: skip
    p.add_argument("--batch", type=_batches, default=(1,), metavar="B,...",
                   help="also sweep these concurrent batch sizes, e.g. 1,2,4,8,16 (default 1: none)")  # fmt: skip
    p.add_argument("--drift", action="store_true", help="also run the drift scenario (high-α then low-α traffic)")
    p.add_argument("--target", type=Path, default=REFERENCE / "target")
    p.add_argument("--draft", type=Path, default=REFERENCE / "draft")
    p.add_argument("--head", type=Path, default=None, metavar="PATH",
                   help="a draft head for the target (e.g. models/reference/eagle): adds the eagle arms")  # fmt: skip
    p.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml")
    p.add_argument("--seed", type=int, default=0, help="which prompts (default 0)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from specd.bench.run import BenchError, BenchOptions, run_bench

    workloads = tuple(args.workload) if args.workload else default_workloads()
    for name in ("target", "draft", *(("head",) if args.head is not None else ())):
        if not (getattr(args, name) / "config.json").is_file():
            raise BenchError(f"--{name}: {getattr(args, name)} is not a model folder (no config.json)")
    if not args.policy.is_file():
        raise BenchError(f"--policy: {args.policy} does not exist")
    options = BenchOptions(
        workloads=workloads, out=args.out, prompts_per_segment=args.prompts_per_segment,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, repeats=args.repeats, batches=args.batch,
        drift=args.drift, target=args.target, draft=args.draft, policy=args.policy, seed=args.seed, noise=args.noise,
        head=args.head,
    )  # fmt: skip
    console = Console() if sys.stdout.isatty() else Console(width=120)
    return run_bench(options, console)


def default_workloads() -> tuple[Path, ...]:
    import workloads

    return tuple(sorted(Path(workloads.__file__).resolve().parent.glob("*.jsonl")))
