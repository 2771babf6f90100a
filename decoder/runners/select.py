"""``select_pass``: the one place the ``runner`` setting is read (decoder.choices.RUNNER_NAMES)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decoder.choices import RUNNER_NAMES
from decoder.runners.base import ForwardPass, PassNotApplicable
from decoder.runners.hf import TransformersPass
from decoder.runners.invariant import InvariantPass
from decoder.runners.lean import LeanPass
from decoder.runners.native import NativePass

# runner name -> the pass it names; each raises PassNotApplicable saying why it cannot run a model
PASSES: dict[str, Callable[[Any, torch.device], ForwardPass]] = {
    "native": NativePass.create,
    "lean": LeanPass.create,
    "invariant": InvariantPass.create,
    "transformers": TransformersPass,  # any causal LM
}
AUTO = ("native", "lean", "transformers")  # the fastest that applies; transformers' always does


def select_pass(model: Any, runner: str, device: torch.device) -> ForwardPass:
    """The pass ``runner`` names for ``model`` on ``device``; for "auto", the first of ``AUTO`` that applies.
    Raises ``PassNotApplicable`` (a ValueError) saying why a named pass cannot run this model here."""
    if runner == "auto":
        for name in AUTO:
            try:
                return PASSES[name](model, device)
            except PassNotApplicable:
                continue
    make = PASSES.get(runner)
    if make is None:
        raise PassNotApplicable(f"unknown runner {runner[:40]!r}; choose one of {', '.join(RUNNER_NAMES)}")
    return make(model, device)
