"""``OUT/checkpoint/state.pt``: the draft, the optimizer, the step, the RNG, and the α measured before training."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from distill.config import DistillConfig
from specd_api.errors import UsageError

STATE_FILE = "state.pt"


@dataclass
class RunState:
    """Progress a checkpoint carries besides the weights and the optimizer."""

    step: int = 0
    seconds: float = 0.0  # training wall time over all runs of this distillation
    before: dict[str, float] | None = None  # Evaluation.to_json() of the draft as it started


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def has_checkpoint(cfg: DistillConfig) -> bool:
    return (cfg.checkpoint_dir / STATE_FILE).is_file()


def save_checkpoint(cfg: DistillConfig, model: Any, optimizer: torch.optim.Optimizer, state: RunState) -> None:
    """Write the checkpoint atomically (a crash mid-write leaves the previous one)."""
    cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "run_state": asdict(state),
        "locked": cfg.locked(),
        "model_config": model.config.to_dict() if hasattr(model, "config") else asdict(model.shape),  # a head's shape
        "rng": rng_state(),
    }
    tmp = cfg.checkpoint_dir / (STATE_FILE + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, cfg.checkpoint_dir / STATE_FILE)


def load_checkpoint(cfg: DistillConfig, model: Any, optimizer: torch.optim.Optimizer) -> RunState:
    """Restore the draft, optimizer and RNG; refuse a checkpoint made with settings that fix the batches."""
    path = cfg.checkpoint_dir / STATE_FILE
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: pickle, zip and torch each raise their own
        raise UsageError(f"cannot --resume: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    saved, now = payload["locked"], cfg.locked()
    changed = [name for name in now if saved.get(name) != now[name]]
    if changed:
        details = ", ".join(f"{name} {saved.get(name)!r} -> {now[name]!r}" for name in changed)
        raise UsageError(f"cannot --resume {cfg.checkpoint_dir}: settings differ from the checkpoint's ({details})")
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        first_line = str(e).strip().splitlines()[0]
        raise UsageError(f"cannot --resume: the checkpoint's draft does not fit this draft ({first_line})") from None
    optimizer.load_state_dict(payload["optimizer"])
    restore_rng(payload["rng"])
    return RunState(**payload["run_state"])
