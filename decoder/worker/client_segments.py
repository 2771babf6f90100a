"""Which segment a client may name: the worker's ``client_segments``.

The controller keeps at most ``learning.max_segments`` segments per learning window; a segment takes its place at
its first report and keeps it until it has been silent for a whole window (an hour by default). Segments a worker
infers are few (the classifier's five and ``default_segment``), but a client may name any: one client naming a new
segment per request could fill every place, and each later new segment, whoever's, would learn only as ``_overflow``.

So a client's name is admitted here, once the rest of its request has passed every check (a refused request takes
no place):

- ``allowed: false``, or a name no glob of ``names`` matches: the request is refused (400, param ``segment``);
- a name this worker holds (taken from a client and named again within ``window_seconds``): admitted;
- another name: taken while this worker holds fewer than ``max_names`` client-named segments, and the client address
  that names it brought fewer than ``max_names_per_host`` of them, and, if that address holds any, more than
  ``new_host_share`` of ``max_names`` places are free (kept for addresses that hold none); else the request is served
  under the segment the worker would infer, as if it had named none (a segment only chooses how to speculate: the
  output is the same), and counted. A name no request names for ``window_seconds`` gives its place back.

A worker so holds at most ``max_names`` of the controller's places, however long a client keeps naming new ones or
keeps its names alive, and one address at most ``max_names_per_host`` of them: a flood from one client leaves the
others' new names room, and a few addresses at their share still leave ``new_host_share`` of the places (a quarter)
to addresses that hold none. Deployments size ``max_names`` x workers within the controller's ``max_segments``, and
``window_seconds`` to its window. The globs are compiled into one pattern when the worker starts, so a name costs one
match whatever their number.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from decoder.worker.config import ClientSegments
from specd_api.host_counts import HostCounts

MAX_REMEMBERED = 10_000  # names remembered when max_names is 0 (no bound): least recently named out


class SegmentRefused(ValueError):
    """A client named a segment this worker does not take (the message names the setting)."""


class SegmentAdmission:
    """``admit(name, host)``: the segment a request naming ``name`` from client address ``host`` is served under
    (the name, or None: infer one), or SegmentRefused. ``always`` are names taken without a place (the ones the worker
    infers itself). Thread-safe."""

    def __init__(
        self, bounds: ClientSegments, always: Iterable[str] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bounds = bounds
        self._always = frozenset(always)
        self._names = re.compile("|".join(f"(?:{fnmatch.translate(glob)})" for glob in bounds.names))
        self._clock = clock
        self._held: OrderedDict[str, tuple[float, str]] = OrderedDict()  # name -> (last named, the address that
        # brought it), least recently named first
        self._by_host = HostCounts()  # the names each address brought
        self._lock = threading.Lock()
        self.ignored = 0  # requests served under an inferred segment: no place left for their name

    def check(self, name: str) -> None:
        """Raises SegmentRefused for a name this worker never takes (``allowed``, ``names``)."""
        if not self.bounds.allowed:
            raise SegmentRefused("this worker does not take a client's segment (client_segments.allowed is false)")
        if name not in self._always and not self._names.fullmatch(name):
            raise SegmentRefused(f"{name!r} is not among the segments this worker takes (client_segments.names)")

    def admit(self, name: str, host: str) -> str | None:
        self.check(name)
        if name in self._always:
            return name
        bounds = self.bounds
        now = self._clock()
        with self._lock:
            self._give_back_silent(now)
            held = self._held.get(name)
            if held is not None:
                self._held[name] = (now, held[1])
                self._held.move_to_end(name)
                return name
            mine = self._by_host.of(host)
            free = bounds.max_names - len(self._held)
            kept = int(bounds.max_names * bounds.new_host_share) if mine else 0  # for addresses holding none
            if bounds.max_names and (free <= kept or mine >= bounds.max_names_per_host):
                self.ignored += 1
                return None
            self._held[name] = (now, host)
            self._by_host.add(host)
            if len(self._held) > MAX_REMEMBERED:  # no bound set: the memory still has one
                self._drop_oldest()
            return name

    def held(self) -> dict[str, int]:
        """The names held now, by the address that brought them."""
        with self._lock:
            self._give_back_silent(self._clock())
            return self._by_host.hosts()

    def _give_back_silent(self, now: float) -> None:
        while self._held:
            last = next(iter(self._held.values()))[0]
            if now - last < self.bounds.window_seconds:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, host) = self._held.popitem(last=False)
        self._by_host.remove(host)
