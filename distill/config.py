"""What one distillation run is asked to do, validated once. Free of torch so the CLI stays light."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from decoder.choices import DTYPE_NAMES
from specd_api.errors import UsageError

EVAL_K = 4  # draft tokens per round when α is measured
EVAL_PROMPT_TOKENS = 32  # length of each held-out prompt α is measured on
HELDOUT_FRACTION = 0.1  # share of the documents kept out of training
MAX_EVAL_BLOCKS = 16  # held-out blocks the KL and top-1 agreement are averaged over
HEADS = ("eagle",)  # the draft heads ``--head`` trains (decoder/heads)

# Settings a resumed run must share with the checkpoint it continues: what is learned, and from which batches.
LOCKED_FIELDS = (
    "target",
    "data",
    "seed",
    "batch_size",
    "seq_len",
    "temperature",
    "self_generated",
    "generation_temperature",
    "head",
    "head_hidden",
    "draft_vocab",
    "ttt_steps",
)


@dataclass(frozen=True)
class DistillConfig:
    """One ``specd distill`` run. ``init_draft`` xor ``draft_config`` says where the draft starts; ``head`` ("eagle")
    trains a draft head instead (decoder/heads), ``head_hidden`` wide (None: the target's), over the ``draft_vocab``
    most frequent tokens, unrolled ``ttt_steps`` drafting steps deep."""

    target: Path
    data: tuple[Path, ...]
    steps: int
    out: Path
    init_draft: Path | None = None
    draft_config: Path | None = None
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int | None = None  # None: 5% of the steps, at most 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    temperature: float = 1.0  # distillation temperature: both distributions are softened by it
    self_generated: float = 0.0  # share of batches that are the target's own continuations of data prompts
    generation_temperature: float = 1.0  # how the target continues them; 0 is greedy
    eval_prompts: int = 16
    eval_tokens: int = 32
    checkpoint_every: int = 100
    resume: bool = False
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    dtype: str = "float32"
    head: str | None = None
    head_hidden: int | None = None
    draft_vocab: int = 2048
    ttt_steps: int = 3

    def __post_init__(self) -> None:
        if self.head is not None:
            if self.head not in HEADS:
                raise UsageError(f"unknown --head {self.head!r}; choose one of {', '.join(HEADS)}")
            if self.init_draft is not None or self.draft_config is not None:
                raise UsageError("--head trains a draft head: give neither --init-draft nor --draft-config")
            _at_least("--draft-vocab", self.draft_vocab, 2)
            _at_least("--ttt-steps", self.ttt_steps, 1)
            if self.head_hidden is not None:
                _at_least("--head-hidden", self.head_hidden, 1)
        elif (self.init_draft is None) == (self.draft_config is None):
            raise UsageError("give exactly one of --init-draft PATH or --draft-config FILE, or --head eagle")
        if not self.data:
            raise UsageError("--data needs at least one file")
        _at_least("--steps", self.steps, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--seq-len", self.seq_len, 2)
        _at_least("--eval-prompts", self.eval_prompts, 1)
        _at_least("--eval-tokens", self.eval_tokens, 1)
        _at_least("--checkpoint-every", self.checkpoint_every, 1)
        if self.warmup_steps is not None:
            _at_least("--warmup-steps", self.warmup_steps, 0)
        if self.threads is not None:
            _at_least("--threads", self.threads, 1)
        _positive("--lr", self.lr)
        _positive("--temperature", self.temperature)
        _positive("--grad-clip", self.grad_clip)
        _in_unit_interval("--self-generated", self.self_generated)
        _in_unit_interval("--min-lr-ratio", self.min_lr_ratio)
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not math.isfinite(self.generation_temperature) or self.generation_temperature < 0:
            raise UsageError(f"--generation-temperature must be >= 0 (0 is greedy), got {self.generation_temperature}")
        if self.dtype not in DTYPE_NAMES:
            raise UsageError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")

    @property
    def warmup(self) -> int:
        """Warmup steps actually used."""
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.steps // 20)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoint"

    @property
    def report_path(self) -> Path:
        return self.out / "distill_report.json"

    def locked(self) -> dict[str, object]:
        """The fields a resumed run must not change, in a form a checkpoint can store."""
        return {name: _plain(getattr(self, name)) for name in LOCKED_FIELDS}


def _plain(value: object) -> object:
    """Paths as absolute strings: a resumed run is compared by where files are, not how they were spelled."""
    if isinstance(value, Path):
        return str(value.resolve())
    if isinstance(value, tuple):
        return [str(Path(v).resolve()) for v in value]
    return value


def _at_least(flag: str, value: int, low: int) -> None:
    if value < low:
        raise UsageError(f"{flag} must be >= {low}, got {value}")


def _positive(flag: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag} must be a finite number > 0, got {value}")


def _in_unit_interval(flag: str, value: float) -> None:
    if not (0.0 <= value <= 1.0):  # also false for nan
        raise UsageError(f"{flag} must be in [0, 1], got {value}")
