"""`specd demo`: arguments in, ``run_demo`` out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

# Sized so that the whole demo (start-up, 2 x 5 x N requests of up to 48 tokens, shutdown) takes about two and a
# half minutes on 2 CPU cores (measured: ~20 s start-up and shutdown, ~1.1 s per prompt for both workers).
DEFAULT_PROMPTS_PER_SEGMENT = 24
DEFAULT_MAX_TOKENS = 48


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(commands: Any) -> None:
    from specd.demo.configs import REFERENCE, ROOT

    p = commands.add_parser(
        "demo",
        help="run the controller and two workers (adaptive vs no speculation) on the segment workloads",
        description="Start the controller and two decode workers on the reference pair, send the segment "
        "workloads to both (the adaptive one asks the controller, the baseline one never speculates), show "
        "tokens/s, α and the controller's decisions live, then a summary, the traces and a plot.",
    )
    p.add_argument(
        "--prompts-per-segment",
        type=_positive,
        default=DEFAULT_PROMPTS_PER_SEGMENT,
        metavar="N",
        help=f"prompts of each segment, each sent to both workers (default {DEFAULT_PROMPTS_PER_SEGMENT})",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"cap on each prompt's max_new_tokens (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--concurrency",
        type=_positive,
        default=1,
        metavar="N",
        help="prompts in flight at once (default 1; more overlap and batch in the workers)",
    )
    p.add_argument("--seed", type=int, default=0, help="which prompts, and the requests' sampling seeds (default 0)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(".specd/demo"),
        metavar="DIR",
        help="run folder, wiped at the start (default .specd/demo)",
    )
    p.add_argument("--segments", metavar="A,B", help="only these segments (default: all workloads)")
    p.add_argument("--workloads", type=Path, metavar="DIR", help="folder of *.jsonl workloads (default: the shipped)")
    p.add_argument("--target", type=Path, default=REFERENCE / "target", metavar="PATH", help="target model folder")
    p.add_argument("--draft", type=Path, default=REFERENCE / "draft", metavar="PATH", help="draft model folder")
    p.add_argument(
        "--policy",
        type=Path,
        default=ROOT / "policies" / "default.yaml",
        metavar="FILE",
        help="the controller's policy (default policies/default.yaml)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="progress lines instead of the live table (the default when stdout is not a terminal)",
    )
    p.set_defaults(handler=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from specd.demo.run import DemoError, DemoOptions, default_workloads, run_demo

    for name in ("target", "draft"):
        folder: Path = getattr(args, name)
        if not (folder / "config.json").is_file():
            raise DemoError(f"--{name}: {folder} is not a model folder (no config.json)")
    if not args.policy.is_file():
        raise DemoError(f"--policy: {args.policy} does not exist")
    console = Console() if sys.stdout.isatty() else Console(width=120)
    segments = tuple(s for s in args.segments.split(",") if s) if args.segments else None
    options = DemoOptions(
        out=args.out,
        prompts_per_segment=args.prompts_per_segment,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
        workloads=args.workloads or default_workloads(),
        segments=segments,
        target=args.target,
        draft=args.draft,
        policy=args.policy,
        live=console.is_terminal and not args.plain,
    )
    return run_demo(options, console)
