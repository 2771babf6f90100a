"""The training loop: KL to the target's logits, AdamW, cosine learning rate with warmup, clipping, checkpoints."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from distill.batches import BatchSource
from distill.checkpoint import RunState, save_checkpoint
from distill.config import DistillConfig
from distill.loss import forward_kl
from distill.progress import Progress
from distill.schedules import warmup_cosine
from specd_api.errors import SpecdError

FUSED_ADAMW_DEVICES = ("cpu", "cuda")


class DivergedError(SpecdError):
    """The loss stopped being a number."""


def learning_rate(step: int, cfg: DistillConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_ratio`` at ``cfg.steps``."""
    return warmup_cosine(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)


def make_optimizer(model: torch.nn.Module, cfg: DistillConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; fused where torch has a fused kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for the draft's forward pass when a half dtype is asked for; its weights stay float32."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def train_step(
    draft_model: Any,
    target_model: Any,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    lr: float,
    cfg: DistillConfig,
    precision: contextlib.AbstractContextManager[Any],
) -> float:
    """One optimizer step on ``batch`` ([b, n] int64); returns the distillation loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.no_grad():
        target_logits = target_model(input_ids=batch, use_cache=False).logits  # [b, n, vocab]
    with precision:
        draft_logits = draft_model(input_ids=batch, use_cache=False).logits  # [b, n, vocab]
    loss = forward_kl(draft_logits, target_logits, cfg.temperature)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft_model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def train(trainer: Trainer, stop: StopRequest | None = None, progress: Progress | None = None) -> bool:
    """``trainer.run`` under SIGINT/SIGTERM with a progress bar; False, and how to continue, when stopped early."""
    stop = stop or StopRequest()
    progress = progress or Progress(trainer.cfg.steps, trainer.state.step)
    try:
        with stop.installed():
            finished = trainer.run(stop, progress)
    finally:
        progress.close()
    if not finished:
        print(f"stopped at step {trainer.state.step}; continue with --resume", flush=True)
    return finished


class StopRequest:
    """Set by SIGINT/SIGTERM, so the loop checkpoints and stops cleanly after the current step."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGINT and SIGTERM while the block runs; put the previous handlers back after."""
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True


# One optimizer step: (batch [b, n] int64, learning rate) -> the loss it minimised
Step = Callable[[torch.Tensor, float], float]


def draft_step(
    draft_model: Any, target_model: Any, optimizer: torch.optim.Optimizer, cfg: DistillConfig, precision: Any
) -> Step:
    """A draft model's step (``train_step``), for ``Trainer``."""
    return lambda batch, lr: train_step(draft_model, target_model, optimizer, batch, lr, cfg, precision)


@dataclass
class Trainer:
    """The loop any distillation trains by: ``step`` on each step's batch at its learning rate, ``model`` (what is
    trained: a draft, or a head) checkpointed every ``cfg.checkpoint_every`` steps and at the end."""

    cfg: DistillConfig
    model: Any
    optimizer: torch.optim.Optimizer
    batches: BatchSource
    state: RunState
    step: Step

    def run(self, stop: StopRequest, progress: Progress) -> bool:
        """Train up to ``cfg.steps``; True when finished, False when stopped early (checkpoint written)."""
        cfg = self.cfg
        self.model.train()
        while self.state.step < cfg.steps and not stop.requested:
            started = time.perf_counter()
            lr = learning_rate(self.state.step, cfg)
            batch, _ = self.batches.batch(self.state.step)
            loss = self.step(batch, lr)
            if not math.isfinite(loss):
                raise DivergedError(f"the loss is {loss} at step {self.state.step}; lower --lr and --resume")
            self.state.step += 1
            self.state.seconds += time.perf_counter() - started
            progress.update(self.state.step, loss, lr)
            if self.state.step % cfg.checkpoint_every == 0 or self.state.step == cfg.steps:
                save_checkpoint(cfg, self.model, self.optimizer, self.state)
        if self.state.step < cfg.steps:
            save_checkpoint(cfg, self.model, self.optimizer, self.state)
            return False
        return True
