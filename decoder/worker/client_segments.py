"""Which segment a client may name: the worker's ``client_segments`` (issue 22).

The controller keeps at most ``learning.max_segments`` segments per learning window; a segment takes its place at
its first report and keeps it until it has been silent for a whole window (an hour by default). Segments a worker
infers are few (the classifier's five and ``default_segment``), but a client may name any: one client naming a new
segment per request once filled every place, and each later new segment, whoever's, learned only as ``_overflow``.

So a client's name is admitted here before anything else reads it:

- ``allowed: false``, or a name no glob of ``names`` matches: the request is refused (400, param ``segment``);
- a name this worker took from a client in the last hour: admitted;
- a new name: admitted while fewer than ``new_per_hour`` names were taken for the first time in the last hour; past
  that, the request is served under the segment the worker would infer, as if it had named none (a segment only
  chooses how to speculate: the output is the same), and counted. A flood of made-up names then holds at most
  ``new_per_hour`` of the controller's places per worker, and the names already learned keep theirs.

The names remembered are bounded (``MAX_REMEMBERED``, least recently seen out: a name pushed out is new again), and
the globs are compiled into one pattern when the worker starts, so a name costs one match whatever their number.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from decoder.worker.config import ClientSegments

WINDOW_SECONDS = 3600.0  # "an hour": the controller's default learning window
MAX_REMEMBERED = 10_000  # names remembered as taken (least recently seen out)


class SegmentRefused(ValueError):
    """A client named a segment this worker does not take (the message names the setting)."""


class SegmentAdmission:
    """``admit(name)``: the segment a client's name is served under (the name, or None: infer one), or
    SegmentRefused. ``always`` are names taken without counting (the ones the worker infers itself). Thread-safe."""

    def __init__(
        self, bounds: ClientSegments, always: Iterable[str] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bounds = bounds
        self._always = frozenset(always)
        self._names = re.compile("|".join(f"(?:{fnmatch.translate(glob)})" for glob in bounds.names))
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # name -> last seen, least recently seen first
        self._taken: deque[float] = deque()  # when each name of the last hour was first taken
        self._lock = threading.Lock()
        self.ignored = 0  # requests served under an inferred segment: the hour's budget of new names was spent

    def admit(self, name: str) -> str | None:
        if not self.bounds.allowed:
            raise SegmentRefused("this worker does not take a client's segment (client_segments.allowed is false)")
        if name in self._always:
            return name
        if not self._names.fullmatch(name):
            raise SegmentRefused(f"{name!r} is not among the segments this worker takes (client_segments.names)")
        now = self._clock()
        with self._lock:
            seen = self._seen.get(name)
            if seen is not None and now - seen < WINDOW_SECONDS:
                self._seen[name] = now
                self._seen.move_to_end(name)
                return name
            while self._taken and now - self._taken[0] >= WINDOW_SECONDS:
                self._taken.popleft()
            if self.bounds.new_per_hour:
                if len(self._taken) >= self.bounds.new_per_hour:
                    self.ignored += 1
                    return None
                self._taken.append(now)
            self._seen[name] = now
            self._seen.move_to_end(name)
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)
            return name
