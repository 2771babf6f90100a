"""The bench's pictures (Agg canvas, no display): speedup by segment and arm; the adaptive arm's drafter and K over
time per segment (and the drift scenario's decisions)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specd.bench.measure import ADAPTIVE, STATIC_ARMS, Sample

COLOURS = {
    "draft": "#2a9d8f", "prompt_lookup": "#e76f51", "chain": "#6a4c93", "suffix": "#e9c46a", "eagle": "#264653",
    "none": "#8d99ae",
}  # fmt: skip


def plot_speedups(segments: dict[str, dict[str, Any]], path: Path) -> Path:
    names = list(segments)
    ran = [a for a in STATIC_ARMS[1:] if any(a in seg["arms_vs_none"] for seg in segments.values())]
    arms = [*ran, "oracle", "adaptive (cold)", "adaptive (warm)"]
    figure = Figure(figsize=(max(10, 1.6 * len(names) + 6), 4.8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    width = 0.85 / len(arms)
    for j, arm in enumerate(arms):
        values = []
        for seg in segments.values():
            if arm == "oracle":
                values.append(seg["oracle_vs_none"])
            elif arm.startswith("adaptive"):
                values.append(seg["adaptive_warm_vs_none" if "warm" in arm else "adaptive_vs_none"])
            else:
                values.append(seg["arms_vs_none"].get(arm, 0.0))
        colour = "#264653" if arm.startswith("adaptive") else "#f4a261" if arm == "oracle" else None
        axes.bar([i + (j - len(arms) / 2) * width for i in range(len(names))], values, width, label=arm, color=colour,
                 alpha=1.0 if colour else 0.55)  # fmt: skip
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(names)), names)
    axes.set_ylabel("decode tokens/s over none (median over prompts)")
    axes.set_title("speedup by segment and arm (paired per prompt, same run)")
    axes.legend(fontsize=6, ncol=4, loc="upper right")
    figure.tight_layout()
    figure.savefig(path)
    return path


def plot_decisions(samples: Sequence[Sample], path: Path, drift: dict[str, Any] | None = None) -> Path:
    segments = list(dict.fromkeys(s.segment for s in samples if s.arm == ADAPTIVE))
    panels = len(segments) + (1 if drift else 0)
    figure = Figure(figsize=(10, 1.6 * max(panels, 1) + 0.8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.subplots(max(panels, 1), 1, sharex=False, squeeze=False)[:, 0]
    for ax, segment in zip(axes, segments, strict=False):
        chosen = [s for s in samples if s.arm == ADAPTIVE and s.segment == segment and s.run == 0]  # the first run
        for i, s in enumerate(chosen):
            ax.scatter(i, s.mean_k if s.drafter != "none" else 0, color=COLOURS.get(s.drafter, "black"),
                       marker="x" if s.exploration else "o", s=18)  # fmt: skip
        ax.set_ylabel(segment, fontsize=8)
        ax.set_ylim(-0.5, 12)
    if drift:
        ax = axes[-1]
        for t in drift["timeline"]:
            k = t["mean_k"] if t["drafter"] != "none" else 0
            marker = "x" if t["exploration"] else "o"
            ax.scatter(t["request"], k, color=COLOURS.get(t["drafter"], "black"), marker=marker, s=18)
        half = len(drift["timeline"]) // 2
        ax.axvline(half - 0.5, color="red", linewidth=1)
        ax.set_ylabel("drift", fontsize=8)
    axes[0].set_title("adaptive: mean K of each request (0 = no speculation; colour = drafter, x = probe)")
    figure.tight_layout()
    figure.savefig(path)
    return path
