"""`specd generate`: decode one prompt with a chosen drafter and K, print the text or a JSON record."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from decoder.choices import DRAFTER_NAMES, DTYPE_NAMES, MAX_BRANCHES, RUNNER_NAMES
from specd_api.errors import UsageError
from specd_api.speedup import runs_draft_model, runs_head


def add_parser(commands: Any) -> None:
    p = commands.add_parser("generate", help="decode one prompt with speculative decoding")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from standard input")
    p.add_argument("--target", required=True, metavar="PATH", help="Hugging Face model folder of the target")
    p.add_argument("--draft", metavar="PATH", help="Hugging Face model folder of the draft model")
    p.add_argument("--head", metavar="PATH", help="draft head folder, speculators layout (for --drafter eagle)")
    p.add_argument(
        "--drafter",
        choices=DRAFTER_NAMES,
        default=None,
        help="what proposes tokens (default: draft if --draft is given, eagle if --head is, else none)",
    )
    p.add_argument("--k", type=int, default=4, metavar="K", help="draft tokens per round (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="N")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram to match")
    p.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram to match")
    p.add_argument(
        "--branches", type=int, default=1, metavar="N",
        help=f"prompt lookup: matches verified together as one tree (1..{MAX_BRANCHES}; default 1, a chain)",
    )  # fmt: skip
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument(
        "--runner",
        default="auto",
        choices=RUNNER_NAMES,
        help="auto: native, else lean (Llama models), else transformers'; README, 'The native pass'",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from decoder.drafters import PromptLookupConfig
    from decoder.engine import SpeculativeDecoder
    from decoder.heads import load_head
    from decoder.models import load_model, parse_dtype, resolve_device
    from decoder.request_stop import StopConditions
    from decoder.sampling import SamplingParams

    drafter = args.drafter or ("draft" if args.draft else "eagle" if args.head else "none")
    if runs_draft_model(drafter) and not args.draft:
        raise UsageError(f"--drafter {drafter} needs --draft PATH")
    if runs_head(drafter) and not args.head:
        raise UsageError(f"--drafter {drafter} needs --head PATH")
    if args.k < 0:
        raise UsageError(f"--k must be >= 0, got {args.k}")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        lookup = PromptLookupConfig(min_ngram=args.min_ngram, max_ngram=args.max_ngram, branches=args.branches)
        max_new_tokens = StopConditions(max_new_tokens=args.max_new_tokens).max_new_tokens
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt

    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    target = load_model(args.target, device, dtype, args.runner)
    draft = load_model(args.draft, device, dtype, args.runner) if args.draft and runs_draft_model(drafter) else None
    head = load_head(args.head, target) if args.head and runs_head(drafter) else None
    decoder = SpeculativeDecoder(target, draft, lookup, head=head)
    prompt_ids = decoder.encode(prompt)
    if not prompt_ids:
        raise UsageError("the prompt is empty after tokenization")
    rules = StopConditions(
        max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset() if args.ignore_eos else target.eos_token_ids,
        stop_strings=tuple(args.stop),
    )
    try:
        result = decoder.generate(prompt_ids, drafter, args.k, params, rules)
    except ValueError as e:  # e.g. a prompt longer than the model's context
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(result.text)
    return 0
