"""What one HTTP connection may hold, and for how long (contract 10): uvicorn's bounds set explicitly
(``uvicorn_options``), and the one uvicorn lacks, a deadline for a request to arrive (``DeadlineH11Protocol``).

uvicorn cancels its keep-alive timer on every byte received and has no timeout for a request's head or body, so a
client that sent half a request, or nothing at all, held its connection (a file descriptor, a task) until the worker
stopped; at a stop, each such request waited out the whole grace period and was then cancelled with a traceback in the
log (issue 22: thousands of them logged 52 MB in 12 s). Here a request must arrive whole within
``limits.request_read_seconds`` of its connection opening, or of the connection's previous response; else the
connection is closed, with one log line. At a stop, a request still arriving is closed at once: nothing was admitted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from decoder.worker.config import RequestLimits

log = logging.getLogger("specd.worker")

_ARRIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)  # the client's side once its request (head and body) is whole


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request to arrive whole (``read_deadline_protocol``)."""

    read_seconds = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        answer_without_delay(transport)
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
        super().connection_lost(exc)

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self.conn.their_state not in _ARRIVED:
            # Its body is still arriving: nothing was admitted, and waiting would hold the stop for the whole grace.
            log.info("stopping: closed %s, whose request had not arrived whole", self._peer())
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
        log.info("closed %s: no whole request within %gs (limits.request_read_seconds)", self._peer(),
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


def read_deadline_protocol(seconds: float) -> type[DeadlineH11Protocol]:
    """``DeadlineH11Protocol`` with ``seconds`` for a request to arrive (uvicorn builds one per connection)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"read_seconds": seconds})


def uvicorn_options(limits: RequestLimits) -> dict[str, Any]:
    """uvicorn's settings that bound what a connection holds, explicit rather than uvicorn's defaults."""
    return {
        "http": read_deadline_protocol(limits.request_read_seconds),
        "timeout_keep_alive": limits.keep_alive_seconds,  # idle between requests
        "h11_max_incomplete_event_size": limits.max_header_bytes,  # a request's head; larger: 400
        "limit_concurrency": limits.max_connections,  # connections (or requests) at once; beyond: 503
    }
