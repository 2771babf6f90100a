"""gRPC calls that send their headers and never a message, over raw HTTP/2: what a hostile client (or a stuck one)
can open without any gRPC library. Each connection answers the server's SETTINGS and PINGs, so that it stays up for
as long as its user wants, and notes the streams the server ended (trailers or RST_STREAM). Used by
tests/controller/test_budgets.py and benchmarks/controller_scale.py.

With an ``ssl.SSLContext`` (``attacker_tls()``: ALPN h2, no client certificate, the server not verified) the calls go
over TLS: against a mutual-TLS port the server refuses the handshake (TLS 1.3: the client's side completes, its
first bytes are answered by an alert, ``certificate required``, and the close), and each such connection is counted
as refused with the alert's reason. ``ReconnectingCalls`` is the sustained form: threads that open a connection, send
the calls' headers, wait for the server to end it, and open the next, until stopped."""

from __future__ import annotations

import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541 §5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def attacker_tls() -> ssl.SSLContext:
    """A TLS client with no certificate of its own that trusts any server (an attacker need not know the CA), ALPN
    h2 as gRPC requires."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def refusal_reason(error: OSError) -> str:
    """What the server's refusal looked like: the TLS alert's reason, or the socket error's name."""
    if isinstance(error, ssl.SSLError):
        return str(error.reason or type(error).__name__)
    return type(error).__name__


def header_block(headers: Iterable[tuple[str, str]]) -> bytes:
    """Every field a literal without indexing, no Huffman: valid for any HPACK decoder, and stateless."""
    block = b""
    for name, value in headers:
        block += b"\x00" + _integer(len(name), 7) + name.encode() + _integer(len(value), 7) + value.encode()
    return block


def call_headers(target: tuple[str, int], method: str, token: str | None, tls: bool) -> bytes:
    """The header block of a call to ``method`` (with ``authorization: Bearer <token>`` when a token is given)."""
    headers = [(":method", "POST"), (":scheme", "https" if tls else "http"), (":path", method),
               (":authority", f"{target[0]}:{target[1]}"), ("content-type", "application/grpc"),
               ("te", "trailers")]  # fmt: skip
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    return header_block(headers)


def connect(target: tuple[str, int], tls: ssl.SSLContext | None, streams: int, block: bytes) -> socket.socket:
    """A connection (TLS with ``tls``: the handshake done) that has sent the preface and ``streams`` calls' HEADERS.
    Raises OSError (ssl.SSLError among them) when the server refuses it."""
    sock = socket.create_connection(target, timeout=5)
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=target[0])
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        sock.sendall(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, block) for i in range(streams)))
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket) -> bytes:
    """What the socket has now (b"": closed); raises BlockingIOError (ssl.SSLWantReadError included) when nothing
    has come yet, OSError when the server broke it off (a TLS alert among them)."""
    data = sock.recv(65536)
    while data and isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted but not read: select won't say
        data += sock.recv(65536)
    return data


class HalfOpenCalls:
    """``count`` calls to ``method`` (``/package.Service/Method``) at ``host:port``, ``per_connection`` streams on
    each connection, each sending HEADERS (with ``authorization: Bearer <token>`` when a token is given) and nothing
    after; over TLS with ``tls``. ``open`` sends them; ``close`` drops the connections. A connection the server
    broke off (a TLS alert, a reset, a close) before sending a single byte counts in ``refused`` (by reason)."""

    def __init__(
        self, address: str, method: str, count: int, per_connection: int = 50, token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        host, _, port = address.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.method, self.count, self.per_connection, self.token, self.tls = method, count, per_connection, token, tls
        self.connections = 0
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        self._ended: set[tuple[int, int]] = set()  # (connection, stream) the server closed
        self._refused: Counter[str] = Counter()  # connections broken off before the server's first byte, by reason
        self._goaway = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="half-open", daemon=True)

    @property
    def ended_by_server(self) -> int:
        """Calls the server has ended (a status or a reset), or whose connection it closed."""
        with self._lock:
            return len(self._ended)

    @property
    def refused(self) -> dict[str, int]:
        """Connections the server broke off before its first byte (a refused TLS handshake), by reason."""
        with self._lock:
            return dict(self._refused)

    def open(self) -> HalfOpenCalls:
        block = call_headers(self.target, self.method, self.token, self.tls is not None)
        left = self.count
        while left > 0:
            streams = min(left, self.per_connection)
            connection, left = self.connections, left - streams
            self.connections += 1
            try:
                sock = connect(self.target, self.tls, streams, block)
            except OSError as e:
                if self.tls is None:
                    raise
                self._end(connection, streams, refusal_reason(e))  # refused in the handshake
                continue
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, [connection, streams, b"", False])
            self._sockets.append(sock)
        self._thread.start()
        return self

    def _end(self, connection: int, streams: int, refused: str | None = None) -> None:
        with self._lock:
            self._ended.update((connection, 2 * i + 1) for i in range(streams))
            if refused is not None:
                self._refused[refused] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._sockets:
            sock.close()
        self._selector.close()

    def __enter__(self) -> HalfOpenCalls:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.1):
                sock, (connection, streams, buffer, heard) = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                reason = "closed"
                try:
                    data = receive(sock)
                except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    continue
                except OSError as e:
                    data, reason = b"", refusal_reason(e)
                if not data:
                    self._selector.unregister(sock)
                    self._end(connection, streams, None if heard or self.tls is None else reason)
                    continue
                key.data[3] = True
                key.data[2] = self._frames(sock, connection, buffer + data)

    def _frames(self, sock: socket.socket, connection: int, buffer: bytes) -> bytes:
        """Handles the whole frames in ``buffer``; returns what is left of it."""
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
                with self._lock:
                    self._ended.add((connection, stream))
            elif kind == GOAWAY:
                with self._lock:
                    self._goaway += 1
        return buffer


class ReconnectingCalls:
    """The sustained form: ``threads`` threads, each opening a connection (TLS with ``tls``), sending
    ``per_connection`` calls' HEADERS on it (``method``, ``token`` as in HalfOpenCalls), reading until the server
    breaks it off or ``hold_s`` passes, then opening the next, until ``close``. Counts connections, those the server
    refused before its first byte (by reason) and those it let through (sent an HTTP/2 frame)."""

    def __init__(
        self, address: str, method: str, threads: int, per_connection: int = 50, token: str | None = None,
        tls: ssl.SSLContext | None = None, hold_s: float = 1.0,
    ) -> None:  # fmt: skip
        host, _, port = address.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.per_connection, self.tls, self.hold_s = per_connection, tls, hold_s
        self._block = call_headers(self.target, method, token, tls is not None)
        self.connections = self.let_through = 0
        self._refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = 0.0
        self._threads = [threading.Thread(target=self._run, name=f"reconnecting-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip

    def open(self) -> ReconnectingCalls:
        self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> dict[str, Any]:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        seconds = time.perf_counter() - self._started
        with self._lock:
            return {"connections": self.connections, "connections_per_second": self.connections / seconds,
                    "calls": self.connections * self.per_connection, "refused": dict(self._refused),
                    "let_through": self.let_through}  # fmt: skip

    def __enter__(self) -> ReconnectingCalls:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            outcome = self._once()
            with self._lock:
                self.connections += 1
                if outcome is None:
                    self.let_through += 1
                else:
                    self._refused[outcome] += 1

    def _once(self) -> str | None:
        """One connection: the reason the server refused it before its first byte, or None when it sent one."""
        try:
            sock = connect(self.target, self.tls, self.per_connection, self._block)
        except OSError as e:
            return refusal_reason(e)
        with sock:
            sock.settimeout(self.hold_s)
            try:
                return None if receive(sock) else "closed"
            except TimeoutError:
                return "no answer"
            except OSError as e:
                return refusal_reason(e)
