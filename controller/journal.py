"""A local, bounded, append-only journal of acknowledged reports that Redis could not take yet.

Each line is one report (its id and aggregates) as JSON, flushed and fsynced before the report is
acknowledged. Replay re-sends reports in order with their original ids, so a report that did reach Redis
before a crash is deduplicated there and never counted twice.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path

from controller.counts import Aggregate

log = logging.getLogger(__name__)


class JournalFull(Exception):
    """The journal reached its bound; the report is not acknowledged (the worker keeps and retries it)."""


class Journal:
    def __init__(self, path: Path, max_reports: int) -> None:
        self.path = path
        self.max_reports = max_reports
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(path)
        self._count = sum(1 for _ in path.open()) if path.exists() else 0

    def __len__(self) -> int:
        return self._count

    def append(self, report_id: str, aggregates: Sequence[Aggregate]) -> None:
        line = json.dumps({"report_id": report_id, "aggregates": [asdict(a) for a in aggregates]})
        with self._lock:
            if self._count >= self.max_reports:
                raise JournalFull(f"telemetry journal holds {self._count} reports, its bound")
            with self.path.open("a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._count += 1

    def entries(self) -> list[tuple[str, list[Aggregate]]]:
        with self._lock:
            if not self.path.exists():
                return []
            lines = self.path.read_text().splitlines()
        entries = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(_parse(line))
            except (ValueError, KeyError, TypeError) as e:
                log.error("skipping unreadable journal line %d of %s: %s", number, self.path, e)
        return entries

    def replay(self, send: Callable[[str, list[Aggregate]], object]) -> int:
        """Send every entry in order; drop the journal once all went through. Returns how many were sent.

        ``send`` raising leaves the journal as it was (entries already sent are deduplicated on retry).
        """
        entries = self.entries()
        for report_id, aggregates in entries:
            send(report_id, aggregates)
        with self._lock:
            # Entries appended while replaying stay for the next replay.
            remaining = self.path.read_text().splitlines()[len(entries) :] if self.path.exists() else []
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in remaining))
            os.replace(tmp, self.path)
            self._count = len(remaining)
        return len(entries)


RENAMED = {"num_draft_tokens": "k", "proposed": "num_drafted"}  # a journal written before the 0.2 names


def _parse(line: str) -> tuple[str, list[Aggregate]]:
    record = json.loads(line)
    aggregates = []
    known = {f.name for f in fields(Aggregate)}
    for a in record["aggregates"]:
        a = {RENAMED.get(name, name): value for name, value in a.items()}
        for name in ("proposed_per_position", "verified_per_position", "accepted_per_position"):
            a[name] = tuple(a[name])
        a["by_drafted"] = tuple((int(r), float(s)) for r, s in a.get("by_drafted", ()))
        aggregates.append(Aggregate(**{name: value for name, value in a.items() if name in known}))
    return record["report_id"], aggregates


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left without its newline by a crash mid-append (that report was never acknowledged)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("dropping a torn last line (%d bytes) from %s", len(data) - keep, path)
        with path.open("r+b") as f:
            f.truncate(keep)
