"""A progress line on standard error: tqdm when it is installed, else a carriage-return line."""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any


class Progress:
    """Steps done out of the total, with the last loss and learning rate."""

    def __init__(self, total: int, initial: int, use_tqdm: bool | None = None) -> None:
        if use_tqdm is None:
            use_tqdm = importlib.util.find_spec("tqdm") is not None
        self.total = total
        self.step = initial
        self.started = time.perf_counter()
        self.initial = initial
        self.bar: Any = None
        if use_tqdm:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="distill", unit="step", file=sys.stderr, leave=True)

    def update(self, step: int, loss: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.step)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        else:
            rate = (step - self.initial) / max(time.perf_counter() - self.started, 1e-9)
            print(
                f"\rdistill {step}/{self.total} loss {loss:.4f} lr {lr:.2e} {rate:.2f} step/s",
                end="",
                file=sys.stderr,
                flush=True,
            )
        self.step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.step > self.initial:
            print(file=sys.stderr, flush=True)
