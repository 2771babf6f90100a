"""A budget of report work per peer host: a token bucket per client IP, charged by a report's work (``cost_of``).

One client sending ReportRounds at the size bound back to back would take the CPU the other clients' Decide needs (the
parsing, the checks, the sums, and Redis's 2,300 HINCRBYFLOATs per report). ``ReportBudget`` gives each peer host
``rate`` aggregates a second with a burst of ``burst``; the service asks it right after a report's cheap size check
and refuses a report over budget with RESOURCE_EXHAUSTED before any of that work, storing nothing (so a retry of the
same report_id later counts once). The worker's client keeps a refused report and retries it with backoff.

- **Charged by aggregates and segments.** Each aggregate costs the same fixed work (its fields checked, an
  ``Aggregate`` built, its segment's Redis fields incremented) whatever its K; its per-position lists are bounded
  per report by ``MAX_REPORT_POSITIONS``. Each segment a report touches costs ``SEGMENT_COST`` aggregates more than
  the first (its keys, its change mark, its cached estimates): 1,000 aggregates spread over 980 segments took the
  controller 5.4x the CPU of the same aggregates over 16 (1,717 ms against 318 ms), about 1.45 ms a segment, 4.5
  aggregates' work. A report costs at most the bucket (``burst``), so one at the size bound always passes a full
  bucket, however spread.
- **Per host, not per connection.** A client opens as many connections as it likes, but not as many addresses:
  the peer is the IP of ``context.peer()`` (``ipv4:10.0.0.5:51234`` -> ``10.0.0.5``, ``ipv6:[::1]:5000`` -> ``::1``,
  ``ipv6:[::ffff:10.0.0.5]:1`` -> ``10.0.0.5``).
  Anything else (a Unix socket, a form gRPC may add) counts as one shared peer, ``SHARED_PEER``.
- **Bounded.** At most ``max_peers`` buckets are kept, least recently used first out; a peer that comes back after
  being dropped starts with a full bucket, as a new one does (what it could have sent in the meantime anyway).
- **A refusal costs the bucket nothing.** Nothing of a refused report is done, so none of the budget is spent; the
  refusal says when the bucket will hold the report, and is logged at most once a ``LOG_EVERY_SECONDS`` per peer.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from specd_api.host_counts import client_host

SEGMENT_COST = 4  # aggregates' work per segment a report touches beyond its first (measured: about 4.5)
SHARED_PEER = "unknown"  # every peer whose address does not parse (Unix sockets among them) shares one bucket
DEFAULT_MAX_PEERS = 4096
LOG_EVERY_SECONDS = 60.0
# The longest a call is held before its request is read (``hold_seconds``): a client over its budget of report work
# is paced by it; one whose report still does not fit when read is refused (serving/request_wait.py holds it).
MAX_HOLD_SECONDS = 5.0


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer string (``ipv4:ADDR:PORT``, ``ipv6:[ADDR]:PORT``, percent-encoded or not): its
    address in canonical form, an IPv6 one by its /64 (``specd_api.host_counts.client_host``); ``SHARED_PEER`` for
    anything else."""
    scheme, _, rest = unquote(peer).partition(":")
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        return SHARED_PEER
    if scheme == "ipv6" and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif scheme != "ipv4":
        return SHARED_PEER
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of the host
    except ValueError:
        return SHARED_PEER
    if (scheme == "ipv4") != (address.version == 4):
        return SHARED_PEER
    return client_host(str(address))  # IPv6 by its /64; an IPv4 client of a dual-stack socket as its IPv4 address


@dataclass(frozen=True)
class OverBudget:
    """A report refused: the peer, the seconds until its bucket holds the report, and whether to log it now."""

    peer: str
    cost: int
    retry_after_seconds: float
    log: bool


@dataclass
class _Bucket:
    tokens: float
    updated: float  # the clock's time of ``tokens``
    logged: float = -float("inf")  # when a refusal of this peer was last logged
    last_cost: int = 0  # the aggregates of its last report charged or refused: what its next one likely costs


class ReportBudget:
    """Token buckets of ``rate`` aggregates a second, ``burst`` at most, one per peer host; thread-safe."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_peers: int = DEFAULT_MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
        max_hold_seconds: float = 0.0,
    ) -> None:
        if not (rate > 0 and burst > 0 and max_peers >= 1):
            raise ValueError(f"a report budget needs rate > 0, burst > 0 and max_peers >= 1, got {rate}, {burst}, "
                             f"{max_peers}")  # fmt: skip
        self.rate, self.burst, self.max_peers, self.clock = rate, burst, max_peers, clock
        self.max_hold_seconds = max_hold_seconds  # the longest ``hold_seconds`` (0: never held, refused once read)
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def cost_of(self, segments: Sequence[str]) -> int:
        """What a report of one aggregate per item of ``segments`` costs: its aggregates and ``SEGMENT_COST`` per
        segment beyond the first, at most the bucket."""
        cost = len(segments) + SEGMENT_COST * max(len(set(segments)) - 1, 0)
        return int(min(cost, self.burst))

    def charge(self, peer: str, cost: int) -> OverBudget | None:
        """Spend ``cost`` aggregates of ``peer``'s bucket (a host from ``peer_host``); None when they were there,
        else the refusal (and nothing is spent)."""
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get(peer)
            if bucket is None:
                bucket = self._buckets[peer] = _Bucket(self.burst, now)
                if len(self._buckets) > self.max_peers:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(peer)
                bucket.tokens = min(self.burst, bucket.tokens + max(now - bucket.updated, 0.0) * self.rate)
                bucket.updated = now
            bucket.last_cost = cost
            if cost <= bucket.tokens:
                bucket.tokens -= cost
                return None
            log = now - bucket.logged >= LOG_EVERY_SECONDS
            if log:
                bucket.logged = now
            return OverBudget(peer, cost, (cost - bucket.tokens) / self.rate, log)

    def hold_seconds(self, peer: str) -> float:
        """How long to hold ``peer``'s next report before reading it: until its bucket holds what its last report
        cost (0 for a peer with budget to spare, or never seen). A client sending back to back is paced to its
        budget by the hold, before its report is read and parsed (a refusal after parsing still costs ~4 ms of the
        controller's interpreter for a report at the size bound: refused 130 times a second, an attack goes on)."""
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get(peer)
            if bucket is None:
                return 0.0
            tokens = min(self.burst, bucket.tokens + max(now - bucket.updated, 0.0) * self.rate)
            return min(max(bucket.last_cost - tokens, 0.0) / self.rate, self.max_hold_seconds)

    def peers(self) -> int:
        with self._lock:
            return len(self._buckets)
