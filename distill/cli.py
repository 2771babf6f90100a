"""`specd distill`: train a draft to match its target's next-token distribution, and report α before and after.

Example::

    specd distill --target models/target --init-draft models/draft --data corpus.jsonl --steps 2000 --out d1
    specd distill ... --steps 3000 --out d1 --resume     # continue from d1/checkpoint (the cosine stretches)
    specd distill --target models/target --draft-config draft.yaml --data docs/*.txt --steps 500 --out d2
    specd distill --target models/target --head eagle --data corpus.jsonl --steps 400 --out head  # a draft head

Imports nothing heavy at module level: ``specd --help`` must not load torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decoder.choices import DTYPE_NAMES
from distill.config import HEADS, DistillConfig


def add_parser(commands: Any) -> None:
    p = commands.add_parser("distill", help="distill a draft model from its target (raises α)")
    p.add_argument("--target", required=True, type=Path, metavar="PATH", help="Hugging Face model folder of the target")
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--head", choices=HEADS, help="train a draft head on the target's own states instead")
    start.add_argument("--init-draft", type=Path, metavar="PATH", help="start from this draft (same tokenizer)")
    start.add_argument(
        "--draft-config", type=Path, metavar="FILE", help="start from a fresh draft of this HF config (JSON or YAML)"
    )
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        type=Path,
        metavar="FILE",
        help='text files (a document per paragraph) or .jsonl files (a "text" or "prompt" field per line)',
    )
    p.add_argument("--steps", required=True, type=int, metavar="N", help="optimizer steps in all")
    p.add_argument("--out", required=True, type=Path, metavar="PATH", help="folder for the draft, report, checkpoint")
    defaults = DistillConfig(target=Path(), data=(Path(),), steps=1, out=Path(), init_draft=Path())
    p.add_argument("--head-hidden", type=int, default=None, metavar="N",
                   help="--head: its width (default: the target's)")  # fmt: skip
    p.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab, metavar="N",
                   help="--head: the most frequent tokens it drafts (default 2048)")  # fmt: skip
    p.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps, metavar="N",
                   help="--head: drafting steps unrolled in training (default 3)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, metavar="N")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, metavar="N", help="tokens per training block")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=None, metavar="N", help="default: 5%% of --steps, at most 100")
    p.add_argument("--temperature", type=float, default=defaults.temperature, metavar="T", help="distillation T")
    p.add_argument(
        "--self-generated",
        type=float,
        default=defaults.self_generated,
        metavar="FRACTION",
        help="share of batches that are the target's own continuations of data prompts (default 0)",
    )
    p.add_argument(
        "--generation-temperature",
        type=float,
        default=defaults.generation_temperature,
        metavar="T",
        help="how the target writes those continuations; 0 is greedy (default 1)",
    )
    p.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts, metavar="N", help="held-out prompts")
    p.add_argument("--eval-tokens", type=int, default=defaults.eval_tokens, metavar="N", help="tokens per prompt")
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every, metavar="N")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--seed", type=int, default=defaults.seed, help="draft init, data split and batch order")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--device", default=defaults.device, help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", default=defaults.dtype, choices=DTYPE_NAMES, help="target dtype; bf16/fp16 also autocast the draft"
    )
    p.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(
        target=args.target,
        data=tuple(args.data),
        steps=args.steps,
        out=args.out,
        init_draft=args.init_draft,
        draft_config=args.draft_config,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        temperature=args.temperature,
        self_generated=args.self_generated,
        generation_temperature=args.generation_temperature,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        head=args.head,
        head_hidden=args.head_hidden,
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # validated before torch is imported
    if cfg.head is not None:
        from distill.head_pipeline import distill_head

        return 0 if distill_head(cfg) is not None else 130
    from distill.pipeline import distill

    return 0 if distill(cfg) is not None else 130
