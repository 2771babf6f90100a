"""The demo's picture: per segment, decode tokens/s of the adaptive and the baseline worker side by side, and
the adaptive worker's α with the decision it ended on. Rendered with the Agg canvas (no display needed)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specd.demo.driver import SegmentRow
from specd.demo.view import fmt_decision, fmt_speedup


def plot(rows: list[SegmentRow], path: Path, title: str = "specd demo") -> Path:
    """Writes a PNG to ``path`` and returns it."""
    names = [row.segment for row in rows]
    x = list(range(len(rows)))
    width = 0.38
    figure = Figure(figsize=(10, 4.2), dpi=110)
    FigureCanvasAgg(figure)
    rates, alphas = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})

    adaptive = [row.tokens_per_second_adaptive or 0.0 for row in rows]
    baseline = [row.tokens_per_second_baseline or 0.0 for row in rows]
    rates.bar([i - width / 2 for i in x], adaptive, width, label="adaptive (controller)", color="#2a9d8f")
    rates.bar([i + width / 2 for i in x], baseline, width, label="baseline (no speculation)", color="#b0b0b0")
    for i, row in enumerate(rows):
        if row.speedup is not None:
            top = max(adaptive[i], baseline[i])
            rates.annotate(fmt_speedup(row.speedup), (i, top), textcoords="offset points", xytext=(0, 3),
                           ha="center", fontsize=9)  # fmt: skip
    rates.set_xticks(x, names)
    rates.set_ylim(0, max([*adaptive, *baseline, 1.0]) * 1.15)
    rates.set_ylabel("decode tokens/s")
    rates.set_title("tokens/s on the same prompts")
    rates.legend(loc="lower right", fontsize=8)

    alpha = [row.alpha or 0.0 for row in rows]
    alphas.bar(x, alpha, 0.6, color="#e9c46a")
    for i, row in enumerate(rows):
        alphas.annotate(fmt_decision(row), (i, alpha[i]), textcoords="offset points", xytext=(0, 3), ha="center",
                        fontsize=7, rotation=90 if len(rows) > 3 else 0, va="bottom")  # fmt: skip
    alphas.set_xticks(x, names)
    alphas.set_ylim(0, 1.25)
    alphas.set_ylabel("α = accepted / proposed")
    alphas.set_title("α of the adaptive worker, last decision")
    for axes in (rates, alphas):
        axes.tick_params(axis="x", labelsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
