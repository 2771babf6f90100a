"""``select_pass``: the one place the ``runner`` setting is read (decoder.choices.RUNNER_NAMES)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decoder.choices import RUNNER_NAMES
from decoder.runners.base import ForwardPass, PassNotApplicable
from decoder.runners.graphed import GraphPass
from decoder.runners.hf import TransformersPass
from decoder.runners.invariant import InvariantPass
from decoder.runners.lean import LeanPass
from decoder.runners.native import NativePass

# runner name -> the pass it names; each raises PassNotApplicable saying why it cannot run a model
PASSES: dict[str, Callable[[Any, torch.device], ForwardPass]] = {
    "native": NativePass.create,
    "lean": LeanPass.create,
    "invariant": InvariantPass.create,
    "graphs": GraphPass.create,
    "transformers": TransformersPass,  # any causal LM
}
# the fastest that applies, by device type; transformers' always does
AUTO = ("native", "lean", "transformers")
AUTO_CUDA = ("graphs", "lean", "transformers")  # launch-bound eager passes: captured graphs first


def auto_order(device: torch.device) -> tuple[str, ...]:
    """The passes ``auto`` tries on ``device``, in order."""
    return AUTO_CUDA if device.type == "cuda" else AUTO


def select_pass(model: Any, runner: str, device: torch.device) -> ForwardPass:
    """The pass ``runner`` names for ``model`` on ``device``; for "auto", the first of ``auto_order(device)`` that
    applies. Raises ``PassNotApplicable`` (a ValueError) saying why a named pass cannot run this model here."""
    if runner == "auto":
        for name in auto_order(device):
            try:
                return PASSES[name](model, device)
            except PassNotApplicable:
                continue
    make = PASSES.get(runner)
    if make is None:
        raise PassNotApplicable(f"unknown runner {runner[:40]!r}; choose one of {', '.join(RUNNER_NAMES)}")
    return make(model, device)
