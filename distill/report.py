"""``OUT/distill_report.json`` and the before/after summary printed at the end of a run."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.config import EVAL_K
from distill.evaluate import Evaluation


@dataclass(frozen=True)
class Report:
    before: Evaluation
    after: Evaluation
    steps: int
    tokens: int  # tokens the draft was trained on
    seconds: float  # training wall time, summed over resumed runs
    eval_prompts: int
    eval_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "alpha_before": self.before.alpha,
            "alpha_after": self.after.alpha,
            "kl_before": self.before.kl,
            "kl_after": self.after.kl,
            "agreement_before": self.before.agreement,
            "agreement_after": self.after.agreement,
            "steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "eval_k": EVAL_K,
            "eval_prompts": self.eval_prompts,
            "eval_tokens": self.eval_tokens,
        }

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)

    def summary(self) -> str:
        b, a = self.before, self.after
        return "\n".join(
            [
                f"held-out ({self.eval_prompts} prompts x {self.eval_tokens} tokens)   before -> after",
                f"  α (greedy, K={EVAL_K})          {b.alpha:6.3f} -> {a.alpha:6.3f}",
                f"  KL(target ‖ draft), nats    {b.kl:6.3f} -> {a.kl:6.3f}",
                f"  top-1 agreement             {b.agreement:6.3f} -> {a.agreement:6.3f}",
                f"{self.steps} steps, {self.tokens:,} tokens, {self.seconds:.1f} s of training",
            ]
        )
