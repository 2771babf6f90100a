"""Train the reference target or draft model on CPU, resumably.

Example (from the repository root)::

    python -m refmodels.train --out refmodels/runs/target --role target --steps 3000 --threads 1
    python -m refmodels.train --out refmodels/runs/target --role target --steps 3000 --threads 1 --resume
    # continue a finished model (fresh optimizer and schedule), e.g. the shipped target:
    python -m refmodels.train --out refmodels/runs/target2 --role target --steps 1500 --lr 6e-4 \\
        --init-from models/reference/target

The run folder gets ``run_config.json``, ``loss_curve.jsonl`` (one JSON line per evaluation:
step, train_loss, val_loss, val_loss_by_domain, tokens_seen, wall_seconds), ``checkpoint/state.pt``
(model, optimizer, step, RNG; rewritten every ``--eval-every`` steps and on SIGTERM/SIGINT) and, at the
end, ``final/``: a Hugging Face folder (bfloat16 safetensors, tokenizer, ``refmodels.json`` summary and the
corpus manifest) that ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` load offline.

Tokenizer and token caches live in ``--data-dir`` (default ``refmodels/runs/data``), shared by both roles.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from distill.schedules import warmup_cosine
from refmodels.corpus import CorpusConfig
from refmodels.data import PreparedData, file_sha256, prepare_data, read_json, write_json
from refmodels.modeling import (
    ROLE_SPECS,
    build_model,
    count_non_embedding_parameters,
    count_parameters,
    llama_config,
)
from refmodels.tokenizer import TokenizerConfig

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "runs" / "data"
ROLE_LEARNING_RATES = {"target": 1.5e-3, "draft": 2e-3}
# Fields that must not change between a checkpoint and the run resuming it.
LOCKED_FIELDS = ("role", "batch_size", "seq_len", "seed", "corpus_seed", "vocab_size")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run."""

    role: str
    steps: int
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3  # the CLI default depends on the role (ROLE_LEARNING_RATES)
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    val_blocks_per_domain: int = 48
    log_every: int = 10
    threads: int = 1
    bf16: bool = True
    seed: int = 0
    corpus_seed: int = 0
    vocab_size: int = 8192

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# ---------------------------------------------------------------------------------------------------------
# Data


class BlockSampler:
    """Batches of ``seq_len``-token blocks cut from the packed train stream, as a pure function of the step.

    Epoch ``e`` cuts the stream at a seeded offset in ``[0, seq_len)`` and visits its blocks in a seeded
    permutation, so a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.blocks_per_epoch = (len(tokens) - seq_len) // seq_len  # leaves room for any offset
        if self.blocks_per_epoch < batch_size:
            raise ValueError(f"the train stream ({len(tokens)} tokens) is too short for one batch")
        self._epoch = -1
        self._offset = 0
        self._order = np.zeros(0, dtype=np.int64)

    def _use_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch = epoch
            self._offset = int(rng.integers(self.seq_len))
            self._order = rng.permutation(self.blocks_per_epoch)

    def batch(self, step: int) -> torch.Tensor:
        """The ``[batch_size, seq_len]`` long tensor of training step ``step`` (0-based)."""
        rows = []
        for sample in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, position = divmod(sample, self.blocks_per_epoch)
            self._use_epoch(epoch)
            start = self._offset + int(self._order[position]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def epoch_of(self, step: int) -> float:
        """How many passes over the train stream ``step`` steps make."""
        return step * self.batch_size / self.blocks_per_epoch


def validation_blocks(val_tokens: dict[str, np.ndarray], seq_len: int, per_domain: int) -> dict[str, Any]:
    """Up to ``per_domain`` non-overlapping blocks per domain, evenly spread over its stream."""
    blocks = {}
    for domain, stream in val_tokens.items():
        available = len(stream) // seq_len
        if available == 0:
            continue
        starts = np.linspace(0, available - 1, num=min(per_domain, available)).round().astype(int) * seq_len
        blocks[domain] = torch.from_numpy(np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int64))
    return blocks


# ---------------------------------------------------------------------------------------------------------
# Optimisation


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_ratio`` at ``cfg.steps``."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Fused AdamW (much faster on CPU than the per-tensor loop) with weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def autocast(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on CPU, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def train_step(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float, cfg: TrainConfig
) -> float:
    """One optimizer step on ``batch``; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(cfg.bf16):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


@torch.no_grad()
def evaluate(model: PreTrainedModel, blocks: dict[str, torch.Tensor], cfg: TrainConfig) -> dict[str, float]:
    """Mean next-token loss (nats) per domain and over all validation blocks (key ``"all"``)."""
    model.eval()
    totals: dict[str, float] = {}
    total, count = 0.0, 0
    for domain, tensor in blocks.items():
        domain_total = 0.0
        for batch in tensor.split(cfg.batch_size):
            with autocast(cfg.bf16):
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            domain_total += float(loss.item()) * len(batch)
        totals[domain] = domain_total / len(tensor)
        total, count = total + domain_total, count + len(tensor)
    model.train()
    return {"all": total / count, **totals}


# ---------------------------------------------------------------------------------------------------------
# Run folder: checkpoint, loss curve, final model


@dataclass
class RunState:
    """Progress that a checkpoint carries besides the model and optimizer."""

    step: int = 0
    wall_seconds: float = 0.0
    pending_losses: list[float] = field(default_factory=list)  # train losses since the last evaluation


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(
    out: Path, model: PreTrainedModel, optimizer: torch.optim.Optimizer, state: RunState, cfg: TrainConfig
) -> None:
    """Write ``out/checkpoint/state.pt`` atomically."""
    folder = out / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "run_state": asdict(state),
        "train_config": asdict(cfg),
        "model_config": model.config.to_dict(),
        "rng": rng_state(),
    }
    tmp = folder / "state.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, folder / "state.pt")


def load_checkpoint(out: Path, model: PreTrainedModel, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> RunState:
    """Restore model, optimizer and RNG from ``out/checkpoint/state.pt``; return the saved progress."""
    payload = torch.load(out / "checkpoint" / "state.pt", map_location="cpu", weights_only=False)
    saved = payload["train_config"]
    changed = [name for name in LOCKED_FIELDS if saved.get(name) != getattr(cfg, name)]
    if changed:
        raise SystemExit(f"cannot resume: {', '.join(changed)} differ from the checkpoint's ({saved})")
    if saved["steps"] != cfg.steps:
        print(
            f"note: --steps changed {saved['steps']} -> {cfg.steps}; the cosine schedule stretches",
            flush=True,
        )
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    restore_rng(payload["rng"])
    return RunState(**payload["run_state"])


def truncate_curve(path: Path, last_step: int) -> None:
    """Drop loss-curve lines written after the checkpoint being resumed from."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))


def append_curve(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def save_final(
    out: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    summary: dict[str, Any],
    data_dir: Path,
) -> Path:
    """The Hugging Face folder ``out/final``: bfloat16 safetensors, tokenizer, summary, corpus manifest."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    final = out / "final"
    tmp = out / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export = copy.deepcopy(model).bfloat16().eval()
    export.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_json(tmp / "refmodels.json", summary)
    shutil.copyfile(data_dir / "corpus_manifest.json", tmp / "corpus_manifest.json")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


class StopRequest:
    """Set by SIGTERM/SIGINT so the loop can checkpoint and stop cleanly after the current step."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        print(f"signal {signum}: stopping after this step", flush=True)
        self.requested = True


# ---------------------------------------------------------------------------------------------------------
# The loop


@dataclass
class Trainer:
    """A run: config, data, model, optimizer and its folder."""

    cfg: TrainConfig
    out: Path
    data_dir: Path
    data: PreparedData
    model: PreTrainedModel
    optimizer: torch.optim.AdamW
    state: RunState

    init_from: dict[str, Any] | None = None  # the summary of the model this run continues, if any

    @property
    def curve_path(self) -> Path:
        return self.out / "loss_curve.jsonl"

    def evaluate_and_checkpoint(self, blocks: dict[str, torch.Tensor]) -> None:
        losses = evaluate(self.model, blocks, self.cfg)
        pending = self.state.pending_losses
        record = {
            "step": self.state.step,
            "train_loss": round(sum(pending) / len(pending), 5) if pending else None,
            "val_loss": round(losses.pop("all"), 5),
            "val_loss_by_domain": {k: round(v, 5) for k, v in losses.items()},
            "tokens_seen": self.state.step * self.cfg.tokens_per_step,
            "wall_seconds": round(self.state.wall_seconds, 1),
        }
        append_curve(self.curve_path, record)
        pending.clear()
        save_checkpoint(self.out, self.model, self.optimizer, self.state, self.cfg)
        print("eval " + json.dumps(record), flush=True)

    def run(self, stop: StopRequest) -> bool:
        """Train up to ``cfg.steps``; True when finished, False when stopped by a signal."""
        cfg = self.cfg
        sampler = BlockSampler(self.data.train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
        blocks = validation_blocks(self.data.val_tokens, cfg.seq_len, cfg.val_blocks_per_domain)
        self.model.train()
        window_start, window_tokens = time.perf_counter(), 0
        while self.state.step < cfg.steps and not stop.requested:
            started = time.perf_counter()
            lr = learning_rate(self.state.step, cfg)
            loss = train_step(self.model, self.optimizer, sampler.batch(self.state.step), lr, cfg)
            if not math.isfinite(loss):
                raise SystemExit(f"loss is {loss} at step {self.state.step}; lower --lr and resume")
            self.state.pending_losses.append(loss)
            self.state.step += 1
            window_tokens += cfg.tokens_per_step
            if self.state.step % cfg.log_every == 0:
                rate = window_tokens / (time.perf_counter() - window_start)
                print(
                    f"step {self.state.step}/{cfg.steps} loss {loss:.4f} "
                    f"lr {lr:.2e} tok/s {rate:.0f} "
                    f"epoch {sampler.epoch_of(self.state.step):.2f}",
                    flush=True,
                )
                window_start, window_tokens = time.perf_counter(), 0
            self.state.wall_seconds += time.perf_counter() - started
            if self.state.step % cfg.eval_every == 0 or self.state.step == cfg.steps:
                started = time.perf_counter()
                self.evaluate_and_checkpoint(blocks)
                self.state.wall_seconds += time.perf_counter() - started
                window_start, window_tokens = time.perf_counter(), 0
        if self.state.step < cfg.steps:
            save_checkpoint(self.out, self.model, self.optimizer, self.state, cfg)
            print(f"stopped at step {self.state.step}; continue with --resume", flush=True)
            return False
        return True

    def summary(self) -> dict[str, Any]:
        """What ``final/refmodels.json`` records about the run."""
        last = read_last_curve_line(self.curve_path)
        meta = read_json(self.data_dir / "meta.json")
        return {
            "role": self.cfg.role,
            "parameters": count_parameters(self.model),
            "non_embedding_parameters": count_non_embedding_parameters(self.model),
            "steps": self.state.step,
            "tokens_seen": self.state.step * self.cfg.tokens_per_step,
            "wall_seconds": round(self.state.wall_seconds, 1),
            "final_val_loss": last.get("val_loss"),
            "final_val_loss_by_domain": last.get("val_loss_by_domain"),
            "train_config": asdict(self.cfg),
            "corpus_fingerprint": meta.get("corpus_fingerprint"),
            "tokenizer_sha256": file_sha256(self.data_dir / "tokenizer" / "tokenizer.json"),
            "init_from": self.init_from,
        }


def read_last_curve_line(path: Path) -> dict[str, Any]:
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


# ---------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="run folder")
    parser.add_argument("--role", choices=tuple(ROLE_SPECS), required=True)
    parser.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint if there is one")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="shared tokenizer/token cache")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: 1.5e-3 target, 2e-3 draft)")
    defaults = TrainConfig(role="target", steps=1)
    for name in ("batch_size", "seq_len", "warmup_steps", "eval_every", "val_blocks_per_domain", "log_every"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("weight_decay", "grad_clip", "min_lr_ratio"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="model init and data order seed")
    parser.add_argument("--corpus-seed", type=int, default=defaults.corpus_seed)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32")
    parser.add_argument(
        "--init-from",
        type=Path,
        help="start from this finished model folder (same role shape and tokenizer) instead of a random init",
    )
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    values["lr"] = args.lr if args.lr is not None else ROLE_LEARNING_RATES[args.role]
    return TrainConfig(**values)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel work
        torch.set_num_interop_threads(1)


def prepare_run(args: argparse.Namespace, cfg: TrainConfig) -> Trainer:
    """Data, model, optimizer, and the state to start from (fresh or resumed)."""
    data = prepare_data(args.data_dir, CorpusConfig(seed=cfg.corpus_seed), TokenizerConfig(cfg.vocab_size))
    tokenizer = data.tokenizer
    model = build_model(llama_config(ROLE_SPECS[cfg.role], len(tokenizer), tokenizer.eos_token_id), cfg.seed)
    optimizer = make_optimizer(model, cfg)
    checkpoint = args.out / "checkpoint" / "state.pt"
    if checkpoint.is_file() and not args.resume:
        raise SystemExit(f"{checkpoint} exists: pass --resume to continue it, or use another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, args.out, args.data_dir, data, model, optimizer, RunState())
    if checkpoint.is_file():
        trainer.state = load_checkpoint(args.out, model, optimizer, cfg)
        truncate_curve(trainer.curve_path, trainer.state.step)
        print(f"resumed from step {trainer.state.step}", flush=True)
    else:
        trainer.curve_path.unlink(missing_ok=True)
    if args.init_from is not None:
        tokenizer_sha = file_sha256(args.data_dir / "tokenizer" / "tokenizer.json")
        # A resumed run keeps its checkpoint's weights; it only records where it started from.
        trainer.init_from = initial_weights(args.init_from, model, tokenizer_sha, load=not checkpoint.is_file())
    return trainer


def initial_weights(folder: Path, model: PreTrainedModel, tokenizer_sha256: str, load: bool) -> dict[str, Any]:
    """Load (when ``load``) a finished run's weights into ``model``; returns that run's summary and path.

    Refuses a folder whose tokenizer differs from this run's, or whose tensors do not fit the model.
    """
    from safetensors.torch import load_file

    summary_path, weights_path = folder / "refmodels.json", folder / "model.safetensors"
    for path in (summary_path, weights_path):
        if not path.is_file():
            raise SystemExit(f"--init-from {folder}: no {path.name} (expected a finished refmodels run)")
    summary = read_json(summary_path)
    if summary.get("tokenizer_sha256") != tokenizer_sha256:
        raise SystemExit(f"--init-from {folder}: its tokenizer differs from this run's data dir")
    state = load_file(str(weights_path))
    own = model.state_dict()
    state = {name: tensor for name, tensor in state.items() if name in own}
    wrong = [name for name, tensor in state.items() if tensor.shape != own[name].shape]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [name for name in own if name not in state and not (tied and name == "lm_head.weight")]
    if wrong or missing:
        raise SystemExit(f"--init-from {folder}: shapes do not fit role {summary.get('role')!r}: {wrong or missing}")
    if load:
        model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=False)
        if tied:
            model.tie_weights()
        print(f"starting from the weights of {folder}", flush=True)
    return {"path": str(folder), **summary}


def describe(trainer: Trainer) -> dict[str, Any]:
    """What ``run_config.json`` records: configs, parameter counts, data sizes."""
    model, cfg = trainer.model, trainer.cfg
    return {
        "train_config": asdict(cfg),
        "model_spec": asdict(ROLE_SPECS[cfg.role]),
        "parameters": count_parameters(model),
        "non_embedding_parameters": count_non_embedding_parameters(model),
        "train_tokens": len(trainer.data.train_tokens),
        "val_tokens": {k: len(v) for k, v in trainer.data.val_tokens.items()},
        "data_dir": str(trainer.data_dir),
        "command": " ".join(sys.argv),
        "init_from": trainer.init_from,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    set_threads(cfg.threads)
    trainer = prepare_run(args, cfg)
    info = describe(trainer)
    write_json(args.out / "run_config.json", info)
    print(
        f"{cfg.role}: {info['parameters']:,} parameters "
        f"({info['non_embedding_parameters']:,} non-embedding), "
        f"{info['train_tokens']:,} train tokens, {cfg.tokens_per_step} tokens/step, {cfg.steps} steps",
        flush=True,
    )
    stop = StopRequest()
    stop.install()
    if not trainer.run(stop):
        return 0
    final = save_final(args.out, trainer.model, trainer.data.tokenizer, trainer.summary(), args.data_dir)
    print(f"saved {final}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
