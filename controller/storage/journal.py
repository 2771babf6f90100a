"""A local, append-only journal of acknowledged reports that Redis could not take yet, bounded in bytes.

Each line is one report (its id and aggregates) as JSON, flushed and fsynced before the report is acknowledged.

Bound. The file never grows past ``max_bytes`` (nor past ``max_reports`` entries): a report that would cross a
bound is refused with JournalFull (the gRPC service answers RESOURCE_EXHAUSTED; the worker's client keeps the report
in its own buffer and retries it with the same id). Nothing already acknowledged is ever dropped to make room.

Replay. A cursor (the byte offset of the first entry not yet sent to Redis) advances after each batch, so a replay
reads one batch at a time, resumes where it stopped, and nothing re-reads the whole file on a timer. Once the
replayed prefix is half the file (or all of it), the unsent tail is copied to a fresh file that replaces the journal
(compaction). Entries keep their report ids, so one sent twice (a crash between a send and the cursor's update) is
deduplicated by the store's script and counted once.

Crash safety. A torn last line (a crash mid-append: never acknowledged) is cut on open, with one log line. The cursor
file names the journal's inode; it is written before a compaction's copy is renamed into place, so on open a cursor
naming the copy finishes that rename, and a cursor naming neither file means "from the start" (replays more, which
deduplication absorbs, and never skips an entry).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path

from controller.decision.counts import Aggregate

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 2**20
BATCH_BYTES = 2**20  # what one replay step reads (at least one whole entry)
_READ_CHUNK = 2**20

Entry = tuple[str, list[Aggregate]]  # (report_id, aggregates)
Line = tuple[int, Entry | None]  # (offset just past the line, its entry; None when unreadable)


def entry(report_id: str, aggregates: Sequence[Aggregate]) -> bytes:
    """A report's line in the journal."""
    line = json.dumps({"report_id": report_id, "aggregates": [record(a) for a in aggregates]})
    return (line + "\n").encode()


class JournalFull(Exception):
    """The journal reached its bound; the report is not acknowledged (the worker keeps and retries it)."""


class Journal:
    """Thread-safe: appends come from RPC threads; reads and replay from one background thread at a time.

    Opening recovers what a crash left (an unfinished compaction, a torn last line) and counts the unsent entries;
    it parses no entry.
    """

    def __init__(self, path: Path, max_reports: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_reports < 1 or max_bytes < 1:
            raise ValueError(f"journal bounds must be >= 1, got {max_reports} reports and {max_bytes} bytes")
        self.path = path
        self.max_reports = max_reports
        self.max_bytes = max_bytes
        self.cursor_path = path.with_name(path.name + ".cursor")
        self._copy_path = path.with_name(path.name + ".compacting")
        self._lock = threading.Lock()  # the file's end, the counters and the cursor
        self._replay_lock = threading.Lock()  # one replay at a time
        self._refusing = False  # full: the first refusal of an episode is logged, not every one
        path.parent.mkdir(parents=True, exist_ok=True)
        self._cursor = self._recover()
        self._size = self.path.stat().st_size
        self._count = _count_lines(self.path, self._cursor, self._size)

    def __len__(self) -> int:
        """Entries not yet sent to Redis."""
        return self._count

    @property
    def size(self) -> int:
        """Bytes on disk: what ``max_bytes`` bounds (sent entries included until the next compaction)."""
        return self._size

    @property
    def cursor(self) -> int:
        return self._cursor

    # --- writes -------------------------------------------------------------------------------------

    def append(self, report_id: str, aggregates: Sequence[Aggregate]) -> None:
        """Write one report durably, or raise JournalFull (a bound, or the disk refused the write)."""
        self.append_entry(entry(report_id, aggregates))

    def append_entry(self, data: bytes) -> None:
        """``append`` of a report ``entry`` made beforehand (the learner encodes it before taking its lock)."""
        with self._lock:
            if self._count >= self.max_reports or self._size + len(data) > self.max_bytes:
                raise self._refuse(len(data))
            try:
                with self.path.open("ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                self._cut_to(self._size)  # a partial line must not be glued to the next append
                raise JournalFull(f"cannot write the telemetry journal {self.path}: {e}") from None
            self._size += len(data)
            self._count += 1
            if self._refusing:
                self._refusing = False
                log.info("telemetry journal accepts reports again (%d of %d bytes used)", self._size, self.max_bytes)

    def _refuse(self, needed: int) -> JournalFull:
        reason = (
            f"telemetry journal full: {self._size} of {self.max_bytes} bytes and {self._count} of "
            f"{self.max_reports} reports used, this report needs {needed} bytes"
        )
        if not self._refusing:
            self._refusing = True
            log.warning("%s; refusing reports (RESOURCE_EXHAUSTED: workers keep and retry them) until Redis "
                        "has taken the backlog", reason)  # fmt: skip
        return JournalFull(reason)

    # --- reads --------------------------------------------------------------------------------------

    def read(self, start: int, end: int | None = None, max_bytes: int | None = None) -> list[Line]:
        """The lines from offset ``start`` (a line boundary) up to ``end`` (default: the end now), stopping once
        ``max_bytes`` are read (after at least one line). Unreadable lines come back as None, logged once here."""
        lines = []
        for line in self.scan(start, end):
            lines.append(line)
            if max_bytes is not None and line[0] - start >= max_bytes:
                break
        return lines

    def scan(self, start: int, end: int | None = None) -> Iterator[Line]:
        """``read`` as a generator: one chunk in memory at a time, whatever the journal's size."""
        if end is None:
            end = self._size
        for offset, raw in _lines(self.path, start, end):
            if not raw.strip():
                yield offset, None  # a blank line: nothing to send, nothing to say
                continue
            try:
                yield offset, _parse(raw)
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                log.error("skipping unreadable journal entry ending at byte %d of %s: %s", offset, self.path, e)
                yield offset, None

    def entries(self) -> list[Entry]:
        """Every entry not yet sent (tests and tools; the daemon reads in batches)."""
        return [entry for _, entry in self.read(self._cursor) if entry is not None]

    # --- replay -------------------------------------------------------------------------------------

    def replay(
        self, send: Callable[[str, list[Aggregate]], object], until: float | None = None, batch_bytes: int = BATCH_BYTES
    ) -> int:
        """Send the entries from the cursor to the end as it is now, in order; returns how many were sent. Entries
        appended meanwhile wait for the next replay. Each entry is parsed just before it is sent, and the cursor is
        saved after every ``batch_bytes``; ``until`` (time.monotonic()) stops the replay early, between batches.
        When ``send`` raises (Redis is down), the entries before the failing one count as sent and the error
        propagates: a replay that cannot send parses one entry, not the journal."""
        sent = 0
        with self._replay_lock:
            with self._lock:
                end = self._size
            while self._cursor < end and (until is None or time.monotonic() < until):
                start = reached = self._cursor
                lines = 0
                try:
                    for offset, entry in self.scan(start, end):
                        if entry is not None:
                            send(*entry)
                            sent += 1
                        reached, lines = offset, lines + 1
                        if reached - start >= batch_bytes:
                            break
                finally:
                    end -= self._advance(reached, lines)  # a compaction moved every offset down
                if reached == start:
                    break  # nothing left that ends in a newline; never spin on it
        return sent

    def _advance(self, offset: int, lines: int) -> int:
        """Move the cursor past ``lines`` lines, to ``offset``, and save it; compact once the sent prefix is half the
        file. Returns how many bytes a compaction removed from the front (0 without one). A disk error here is
        logged, not raised: the cursor in memory is right, and the one on disk errs towards replaying again."""
        with self._lock:
            if offset == self._cursor:
                return 0
            self._cursor, self._count = offset, self._count - lines
            start, end = self._cursor, self._size
        try:
            if start * 2 < end:
                with self._lock:
                    self._write_cursor(_inode(self.path), self._cursor)
                return 0
            # Copy the unsent tail without the lock (appends only add past ``end``), then what came meanwhile.
            tail = _read_range(self.path, start, end)
            with self._lock:
                self._replace_with(tail + _read_range(self.path, end, self._size))
            return start
        except OSError as e:
            log.error("cannot save the telemetry journal's cursor or compact %s: %s", self.path, e)
            return 0

    def _replace_with(self, tail: bytes) -> None:
        """Swap in a journal that holds only ``tail`` (the unsent entries), cursor at 0. Holds the lock."""
        with self._copy_path.open("wb") as f:
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
        self._write_cursor(_inode(self._copy_path), 0)  # from here on, a crash finishes the swap on open
        os.replace(self._copy_path, self.path)
        _fsync_dir(self.path.parent)
        self._cursor, self._size = 0, len(tail)

    def _write_cursor(self, inode: int, offset: int) -> None:
        """Atomic (write and rename); not fsynced: a lost update replays entries again, which dedup absorbs."""
        tmp = self.cursor_path.with_name(self.cursor_path.name + ".tmp")
        tmp.write_text(f"{inode} {offset}\n")
        os.replace(tmp, self.cursor_path)

    # --- recovery -----------------------------------------------------------------------------------

    def _recover(self) -> int:
        """Finish a compaction a crash interrupted, cut a torn last line, and return the cursor."""
        saved = _read_cursor(self.cursor_path)
        if saved is not None and self._copy_path.exists() and _inode(self._copy_path) == saved[0]:
            os.replace(self._copy_path, self.path)  # the copy and its cursor were written: finish the swap
            log.info("finished the telemetry journal compaction a crash interrupted (%s)", self.path)
        self._copy_path.unlink(missing_ok=True)
        self.path.touch()
        _drop_torn_tail(self.path)
        if saved is None:
            return 0
        inode, offset = saved
        size = self.path.stat().st_size
        if inode == _inode(self.path) and 0 <= offset <= size and _at_line_start(self.path, offset):
            return offset
        log.warning(
            "the journal cursor %s does not match %s; replaying it from the start (reports already in Redis are "
            "deduplicated)", self.cursor_path, self.path,
        )  # fmt: skip
        return 0

    def _cut_to(self, size: int) -> None:
        try:
            os.truncate(self.path, size)
        except OSError as e:
            log.error("cannot cut a failed append from %s: %s", self.path, e)


# An entry's aggregates are their fields as JSON, each under its Aggregate name.
_RECORDED = tuple(f.name for f in fields(Aggregate))


def record(a: Aggregate) -> dict[str, object]:
    """``a`` as an entry of a journal line holds it. Its fields are numbers, strings and tuples of them, which JSON
    writes as they are: ``dataclasses.asdict``'s deep copy takes 85 % of a report's encoding (194 ms at the bounds)."""
    return {name: getattr(a, name) for name in _RECORDED}


def _parse(line: bytes) -> Entry:
    record = json.loads(line)
    aggregates = []
    known = {f.name for f in fields(Aggregate)}
    for a in record["aggregates"]:
        for name in ("proposed_per_position", "verified_per_position", "accepted_per_position"):
            a[name] = tuple(a[name])
        a["by_drafted"] = tuple((int(r), float(s)) for r, s in a["by_drafted"])
        aggregates.append(Aggregate(**{name: value for name, value in a.items() if name in known}))
    return record["report_id"], aggregates


def _lines(path: Path, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """The lines in [start, end), each with the offset just past its newline (a last line without one is left out)."""
    with path.open("rb") as f:
        f.seek(start)
        offset, rest = start, b""
        while offset < end:
            chunk = f.read(min(_READ_CHUNK, end - offset))
            if not chunk:
                break
            base = offset - len(rest)  # where ``rest`` begins
            offset += len(chunk)
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for part in parts:
                base += len(part) + 1
                yield base, part


def _count_lines(path: Path, start: int, end: int) -> int:
    count = 0
    with path.open("rb") as f:
        f.seek(start)
        while start < end:
            chunk = f.read(min(_READ_CHUNK, end - start))
            if not chunk:
                break
            start += len(chunk)
            count += chunk.count(b"\n")
    return count


def _read_range(path: Path, start: int, end: int) -> bytes:
    with path.open("rb") as f:
        f.seek(start)
        return f.read(end - start)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left without its newline by a crash mid-append (that report was never acknowledged)."""
    with path.open("r+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        keep, pos = 0, end
        while pos > 0:  # search backwards for the last newline, a chunk at a time
            start = max(pos - _READ_CHUNK, 0)
            f.seek(start)
            found = f.read(pos - start).rfind(b"\n")
            if found >= 0:
                keep = start + found + 1
                break
            pos = start
        log.warning("dropping a torn last line (%d bytes, never acknowledged) from %s", end - keep, path)
        f.truncate(keep)


def _at_line_start(path: Path, offset: int) -> bool:
    if offset == 0:
        return True
    with path.open("rb") as f:
        f.seek(offset - 1)
        return f.read(1) == b"\n"


def _read_cursor(path: Path) -> tuple[int, int] | None:
    try:
        inode, offset = path.read_text().split()
        return int(inode), int(offset)
    except (OSError, ValueError):
        return None


def _inode(path: Path) -> int:
    return path.stat().st_ino


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
