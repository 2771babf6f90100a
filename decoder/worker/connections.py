"""What one HTTP connection may hold, and for how long (contract 10): uvicorn's bounds set explicitly
(``uvicorn_options``), and the one uvicorn lacks, a deadline for a request to arrive (``DeadlineH11Protocol``).

uvicorn cancels its keep-alive timer on every byte received and has no timeout for a request's head or body, so
under uvicorn alone a client that sends half a request, or nothing at all, holds its connection (a file descriptor, a
task) until the worker stops; at a stop, each such request waits out the whole grace period and is then cancelled
with a traceback in the log (thousands of them log 52 MB in 12 s). Here a request must arrive whole within
``limits.request_read_seconds`` of its connection opening, or of the connection's previous response; else the
connection is closed, with one log line. At a stop, a request still arriving is closed at once: nothing was admitted.

And one client address holds at most ``limits.max_connections_per_host`` connections at once: uvicorn's
``limit_concurrency`` counts every client's together, so one host's idle connections (4,200 of them) would make every
other client's request a 503. A connection past the host's share is answered 503 at once and closed (logged at most once
a minute), and counts nowhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from decoder.worker.config import RequestLimits
from decoder.worker.openai_api import error_body
from specd_api.host_counts import HostCounts, client_host
from specd_api.sparse_log import SparseLog

log = logging.getLogger("specd.worker")

_ARRIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)  # the client's side once its request (head and body) is whole


class HostConnections:
    """How many connections each client address holds (on the server's event loop only: no lock)."""

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host  # 0: no bound
        self.held = HostCounts()
        self.refused = 0
        self._refusals = SparseLog(log, logging.WARNING, 60.0)

    def take(self, host: str) -> bool:
        """One more connection for ``host``, or False when it holds its share already."""
        held = self.held.of(host)
        if self.per_host and held >= self.per_host:
            self.refused += 1
            self._refusals.note("refused a connection from %s: it holds %d already (limits.max_connections_per_host; "
                                "logged at most once a minute)", host, held)  # fmt: skip
            return False
        self.held.add(host)
        return True

    def give_back(self, host: str) -> None:
        self.held.remove(host)


_OVER_SHARE = json.dumps(
    error_body("this address holds as many connections as the worker gives one client "
               "(limits.max_connections_per_host)", "rate_limit_error")
).encode()  # fmt: skip
OVER_SHARE_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_OVER_SHARE), _OVER_SHARE)
)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request to arrive whole, and each client address's share of
    the connections (``read_deadline_protocol``)."""

    read_seconds = 30.0
    hosts: ClassVar[HostConnections] = HostConnections(0)
    sparse: ClassVar[SparseLog] = SparseLog(log, logging.INFO, 1.0)  # lines of connections closed for their client's
    # doing
    _deadline: asyncio.TimerHandle | None = None
    _host: str | None = None  # the address this connection is counted under, once counted

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        answer_without_delay(transport)
        host = client_host(self.client[0]) if self.client else ""
        if not self.hosts.take(host):
            transport.write(OVER_SHARE_RESPONSE)
            transport.close()
            return
        self._host = host
        self._arm()  # a connection that sends nothing is held no longer than one that sends half

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state in _ARRIVED:
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's clock starts (a pipelined request already whole disarms it at once)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._host is not None:
            self.hosts.give_back(self._host)
            self._host = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self.conn.their_state not in _ARRIVED:
            # Its body is still arriving: nothing was admitted, and waiting would hold the stop for the whole grace.
            self.sparse.note("stopping: closed %s, whose request had not arrived whole", self._peer())
            self.transport.close()
            return
        super().shutdown()

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.read_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state in _ARRIVED:
            return
        self.sparse.note("closed %s: no whole request within %gs (limits.request_read_seconds)", self._peer(),
                         self.read_seconds)  # fmt: skip
        self.transport.close()

    def _peer(self) -> str:
        return "a connection from {}:{}".format(*self.client) if self.client else "a connection"


def answer_without_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on an accepted TCP connection. asyncio sets it only where the socket's protocol number is
    IPPROTO_TCP, and a listening socket from ``socket.create_server`` has 0, as has every connection it accepts. h11
    writes a response's head and its body as two sends, so Nagle held the body back until the client's delayed ACK:
    40 ms on every response, /health included (44 ms against 4 ms on loopback)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def read_deadline_protocol(seconds: float, per_host: int = 0) -> type[DeadlineH11Protocol]:
    """``DeadlineH11Protocol`` with ``seconds`` for a request to arrive and ``per_host`` connections per client
    address (0: no bound), with a count of its own (uvicorn builds one protocol per connection)."""
    namespace = {"read_seconds": seconds, "hosts": HostConnections(per_host),
                 "sparse": SparseLog(log, logging.INFO, 1.0)}  # fmt: skip
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), namespace)


def uvicorn_options(limits: RequestLimits) -> dict[str, Any]:
    """uvicorn's settings that bound what a connection holds, explicit rather than uvicorn's defaults."""
    return {
        "http": read_deadline_protocol(limits.request_read_seconds, limits.max_connections_per_host),
        "timeout_keep_alive": limits.keep_alive_seconds,  # idle between requests
        "h11_max_incomplete_event_size": limits.max_header_bytes,  # a request's head; larger: 400
        "limit_concurrency": limits.max_connections,  # connections (or requests) at once; beyond: 503
    }
