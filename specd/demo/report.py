"""What the demo reports after the traffic: what the controller learned (its ListSegments) and where the traces
went (the file exporters' JSON lines)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from specd.demo.driver import Figure, SegmentRow


@dataclass(frozen=True)
class Learned:
    """One segment as the controller sees it."""

    segment: str
    rounds: float  # decayed
    alpha_by_drafter: dict[str, float]
    decision: str  # e.g. "draft K=4 (best_expected_speedup, x1.31)" or "off (below_min_speedup)"
    stale: bool


def learned_from(segments: Iterable[Any]) -> list[Learned]:
    """From ``SegmentStats`` messages (or anything shaped like them)."""
    from controller.cli import describe, segment_summary
    from specd.demo.configs import AA_PREFIX

    learned = []
    for s in segments:
        if s.segment.startswith(AA_PREFIX):  # the A/A's traffic: forced off, nothing learned
            continue
        summary = segment_summary(s)
        learned.append(Learned(s.segment, float(s.rounds), dict(summary["alpha_by_drafter"]), describe(s.decision),
                               bool(s.stale)))  # fmt: skip
    return learned


def fetch_learned(
    address: str, lengths: dict[str, tuple[int, int]] | None = None, timeout_seconds: float = 5.0
) -> list[Learned]:
    """The controller's segments (ListSegments), each with the decision it would make now for the traffic's own
    request: ``lengths`` per segment, its (new tokens, prompt tokens), read by GetSegmentStats (a learning segment,
    ``<segment>#sampled``, by its segment's)."""
    from specd_api.modes import base_segment
    from specd_api.v1 import controller_pb2, controller_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        response = stub.ListSegments(controller_pb2.ListSegmentsRequest(), timeout=timeout_seconds)
        segments = []
        for s in response.segments:
            new_tokens, prompt_tokens = (lengths or {}).get(base_segment(s.segment), (0, 0))
            if new_tokens:
                request = controller_pb2.GetSegmentStatsRequest(
                    segment=s.segment, max_new_tokens=new_tokens, prompt_tokens=prompt_tokens
                )
                s = stub.GetSegmentStats(request, timeout=timeout_seconds)
            segments.append(s)
    return learned_from(segments)


@dataclass(frozen=True)
class TraceFile:
    path: Path
    spans: int
    trace_ids: frozenset[str]
    services: frozenset[str]


@dataclass(frozen=True)
class TraceSummary:
    files: list[TraceFile]

    @property
    def spans(self) -> int:
        return sum(f.spans for f in self.files)

    @property
    def trace_ids(self) -> frozenset[str]:
        return frozenset().union(*(f.trace_ids for f in self.files))

    def shared_trace_ids(self) -> frozenset[str]:
        """Traces with spans in more than one file: a worker's request continued in the controller."""
        seen: dict[str, int] = {}
        for f in self.files:
            for trace_id in f.trace_ids:
                seen[trace_id] = seen.get(trace_id, 0) + 1
        return frozenset(t for t, n in seen.items() if n > 1)


def read_trace_file(path: Path) -> TraceFile:
    """Counts a file exporter's spans (one JSON object per line); a torn last line is skipped."""
    spans, trace_ids, services = 0, set(), set()
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            spans += 1
            trace_ids.add(str(record.get("trace_id", "")))
            services.add(str(record.get("service_name", "")))
    return TraceFile(path, spans, frozenset(trace_ids), frozenset(services))


def read_traces(paths: Iterable[Path]) -> TraceSummary:
    return TraceSummary([read_trace_file(p) for p in paths])


@dataclass(frozen=True)
class DemoReport:
    """Everything the final summary prints."""

    rows: list[SegmentRow]
    overall: SegmentRow
    requests_planned: int
    seconds: float
    interrupted: bool
    settings: str  # e.g. "12 prompts per segment, max 48 tokens, concurrency 1, seed 0"
    fallbacks: dict[str, int]  # cause -> adaptive requests decided without the controller's answer
    learned: list[Learned] | None
    learned_error: str | None  # why ``learned`` is missing
    traces: TraceSummary
    plot: Path | None
    logs: list[Path]
    aa: Figure | None = None  # the A/A: the adaptive worker with speculation off over the baseline


def summary_document(report: DemoReport) -> dict[str, Any]:
    """``summary.json``: the headline (the paired median per prompt, its interval, the totals ratio beside it), each
    segment's, the A/A, and the failures."""
    overall = report.overall

    def figure(row: SegmentRow) -> dict[str, Any]:
        low_high = list(row.median_pair_interval) if row.median_pair_interval else None
        return {"paired_median": row.median_pair_speedup, "interval": low_high, "totals_ratio": row.speedup,
                "pairs": row.pairs}  # fmt: skip

    aa = report.aa
    aa_figure = {
        "ratio": aa.median if aa else None,
        "interval": list(aa.interval) if aa and aa.interval else None,
        "pairs": aa.pairs if aa else 0,
    }
    return {
        "overall": figure(overall),
        "segments": {row.segment: figure(row) for row in report.rows},
        "aa": aa_figure,
        "failures": overall.failures,
        "requests": overall.done,
        "interrupted": report.interrupted,
        "seconds": round(report.seconds, 1),
        "settings": report.settings,
    }


def write_summary(report: DemoReport, path: Path) -> None:
    path.write_text(json.dumps(summary_document(report), indent=2) + "\n")
