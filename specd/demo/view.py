"""The demo's terminal output: the live table (a rich renderable), the plain progress line for logs, and the
final summary. Pure rendering: rows in, renderables or strings out."""

from __future__ import annotations

import os
from pathlib import Path

from rich import box
from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from specd.demo.driver import CONTROLLER_SOURCES, REQUEST_SOURCE, SegmentRow
from specd.demo.report import DemoReport, Learned, TraceSummary

BAR_WIDTH = 12
BAR_MIN_WIDTH = 92  # terminal columns the table needs with its progress bars


def fmt_alpha(alpha: float | None) -> str:
    return f"{alpha:.2f}" if alpha is not None else "-"


def fmt_rate(rate: float | None) -> str:
    return f"{rate:.0f}" if rate is not None else "-"


def fmt_speedup(speedup: float | None) -> str:
    return f"{speedup:.2f}x" if speedup is not None else "-"


def fmt_interval(interval: tuple[float, float] | None) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval is not None else ""


FALLBACK_MARK = "*"
REQUEST_MARK = "†"
MARK_NOTES = {
    FALLBACK_MARK: "the worker's fallback: the controller did not answer in time",
    REQUEST_MARK: "the request's own plan: a seeded sampled request decodes without speculation",
}


def decision_mark(source: str | None) -> str:
    """How a decision's source is marked: not at all for the controller's answer (or no decision yet), a dagger
    when the request fixed its own plan, a star when the worker ran without the controller's answer (its
    fallback)."""
    if source in (*CONTROLLER_SOURCES, None):
        return ""
    return REQUEST_MARK if source == REQUEST_SOURCE else FALLBACK_MARK


def fmt_decision(row: SegmentRow) -> str:
    """The latest decision: "draft K=4", "off", or "-" before the first, with its source's mark (``decision_mark``)."""
    if row.drafter is None:
        return "-"
    text = "off" if row.drafter == "none" else f"{row.drafter} K≤{row.k}"
    return text + decision_mark(row.decision_source)


def fmt_explored(row: SegmentRow) -> str:
    return f"{row.explored}/{row.decided}" if row.decided else "-"


def _speedup_style(speedup: float | None) -> str:
    if speedup is None:
        return ""
    return "green" if speedup >= 1.05 else ("red" if speedup < 0.95 else "")


def progress_table(
    rows: list[SegmentRow], overall: SegmentRow, title: str = "specd demo", width: int | None = None
) -> Table:
    """Per segment: requests done (bar and count), α, the latest decision and how often the controller
    explored, decode tokens/s of each worker, and the speedup; the last row is over all segments. About 90
    columns wide; on a terminal narrower than ``BAR_MIN_WIDTH`` the bars are left out."""
    bars = width is None or width >= BAR_MIN_WIDTH
    table = Table(title=title, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)  # fmt: skip
    table.add_column("segment", no_wrap=True)
    if bars:
        table.add_column("requests", no_wrap=True)
    table.add_column("done", justify="right", no_wrap=True)
    table.add_column("α", justify="right", no_wrap=True)
    table.add_column("decision", no_wrap=True)
    table.add_column("explored", justify="right", no_wrap=True)
    table.add_column("tok/s\nadaptive", justify="right", no_wrap=True)
    table.add_column("tok/s\nbaseline", justify="right", no_wrap=True)
    table.add_column("speedup", justify="right", no_wrap=True)
    for row in [*rows, overall]:
        last = row is overall
        cells: list[RenderableType] = [Text(row.segment, style="bold" if last else "")]
        if bars:
            cells.append(ProgressBar(total=max(row.total, 1), completed=row.done, width=BAR_WIDTH))
        cells += [
            f"{row.done}/{row.total}",
            fmt_alpha(row.alpha),
            "" if last else fmt_decision(row),
            fmt_explored(row),
            fmt_rate(row.tokens_per_second_adaptive),
            fmt_rate(row.tokens_per_second_baseline),
            Text(fmt_speedup(row.speedup), style=_speedup_style(row.speedup)),
        ]
        table.add_row(*cells, end_section=not last and row is rows[-1])
    notes = Text()
    marks = {decision_mark(row.decision_source) for row in rows}
    for mark, note in MARK_NOTES.items():
        if mark in marks:
            notes.append(f"{mark} {note}  ")
    if overall.failures:
        notes.append(f"failed requests: {overall.failures}", style="red")
    if notes:
        table.caption = notes
    return table


def progress_line(rows: list[SegmentRow], overall: SegmentRow, elapsed_seconds: float) -> str:
    """One line for logs: requests done, and α and speedup per segment so far."""
    parts = [f"[{elapsed_seconds:5.0f}s] {overall.done}/{overall.total} requests"]
    for row in rows:
        parts.append(f"{row.segment} α {fmt_alpha(row.alpha)} {fmt_speedup(row.speedup)}")
    parts.append(f"overall {fmt_speedup(overall.speedup)}")
    if overall.failures:
        parts.append(f"{overall.failures} failed")
    return " | ".join(parts)


def learned_table(learned: list[Learned]) -> Table:
    drafters = sorted({d for item in learned for d in item.alpha_by_drafter})
    table = Table(title="what the controller learned", title_justify="left")
    table.add_column("segment")
    table.add_column("rounds", justify="right")
    for drafter in drafters:
        table.add_column(f"α {drafter}", justify="right")
    table.add_column("decision now")
    for item in learned:
        cells = [fmt_alpha(item.alpha_by_drafter.get(d)) for d in drafters]
        decision = item.decision + (" [stale]" if item.stale else "")
        table.add_row(item.segment, f"{item.rounds:.0f}", *cells, decision)
    return table


def shown(path: Path) -> str:
    """A path relative to the working folder when it is inside it (shorter to read), else absolute."""
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)


def traces_text(traces: TraceSummary) -> Text:
    shared = len(traces.shared_trace_ids())
    text = Text(
        f"traces: {traces.spans} spans in {len(traces.files)} files, {len(traces.trace_ids)} distinct trace ids "
        f"({shared} shared by a worker and the controller)\n"
    )
    for f in traces.files:
        text.append(f"  {shown(f.path)}: {f.spans} spans, {len(f.trace_ids)} trace ids\n")
    return text


def render_summary(report: DemoReport, width: int | None = None) -> RenderableType:
    overall = report.overall
    state = "interrupted after" if report.interrupted else "finished in"
    parts: list[RenderableType] = [
        progress_table(report.rows, overall, f"specd demo: {state} {report.seconds:.0f} s", width)
    ]
    lines = Text(f"{report.settings}\n")
    if overall.median_pair_speedup is not None:
        lines.append(f"overall speedup: {fmt_speedup(overall.median_pair_speedup)}", style="bold")
        lines.append(
            f" {fmt_interval(overall.median_pair_interval)} (the median over the {overall.pairs} prompts both workers "
            f"answered of the adaptive worker's decode tokens/s over the baseline's; totals "
            f"{fmt_rate(overall.tokens_per_second_adaptive)} vs {fmt_rate(overall.tokens_per_second_baseline)} "
            f"tokens/s: {fmt_speedup(overall.speedup)})\n"
        )
    else:
        lines.append("overall speedup: - (no prompt was answered by both workers)\n")
    aa = report.aa
    if aa is not None and aa.median is not None:
        lines.append(
            f"A/A: the adaptive worker with speculation off (its controller answering none) ran "
            f"{fmt_speedup(aa.median)} {fmt_interval(aa.interval)} the baseline's decode tokens/s over {aa.pairs} "
            "prompts: what being controlled costs\n"
        )
    failures = f"failures: {overall.failures} of {overall.done} requests"
    lines.append(failures + "\n", style="red" if overall.failures else "green")
    if report.fallbacks:
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(report.fallbacks.items()))
        lines.append(f"decisions made without the controller's answer (the worker's fallback): {causes}\n")
    parts.append(lines)
    if report.learned is not None:
        parts.append(learned_table(report.learned))
    else:
        parts.append(Text(f"what the controller learned: unavailable ({report.learned_error})\n", style="yellow"))
    parts.append(traces_text(report.traces))
    files = Text()
    if report.plot is not None:
        files.append(f"plot: {shown(report.plot)}\n")
    files.append(f"summary: {shown(report.plot.parent / 'summary.json')}\n" if report.plot is not None else "")
    files.append("logs: " + ", ".join(shown(p) for p in report.logs))
    parts.append(files)
    return Group(*parts)
