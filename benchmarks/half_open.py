"""gRPC calls that send their headers and never a message, over raw HTTP/2: what a hostile client (or a stuck one)
can open without any gRPC library. Each connection answers the server's SETTINGS and PINGs, so that it stays up for
as long as its user wants, and notes the streams the server ended (trailers or RST_STREAM). Used by
tests/controller/test_budgets.py and benchmarks/controller_scale.py."""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections.abc import Iterable

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


def header_block(headers: Iterable[tuple[str, str]]) -> bytes:
    """Every field a literal without indexing, no Huffman: valid for any HPACK decoder, and stateless."""
    block = b""
    for name, value in headers:
        block += b"\x00" + _integer(len(name), 7) + name.encode() + _integer(len(value), 7) + value.encode()
    return block


class HalfOpenCalls:
    """``count`` calls to ``method`` (``/package.Service/Method``) at ``host:port``, ``per_connection`` streams on
    each connection, each sending HEADERS (with ``authorization: Bearer <token>`` when a token is given) and nothing
    after. ``open`` sends them; ``close`` drops the connections."""

    def __init__(self, address: str, method: str, count: int, per_connection: int = 50, token: str | None = None):
        host, _, port = address.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.method, self.count, self.per_connection, self.token = method, count, per_connection, token
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        self._ended: set[tuple[int, int]] = set()  # (connection, stream) the server closed
        self._goaway = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="half-open", daemon=True)

    @property
    def ended_by_server(self) -> int:
        """Calls the server has ended (a status or a reset), or whose connection it closed."""
        with self._lock:
            return len(self._ended)

    def open(self) -> HalfOpenCalls:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", self.method),
                   (":authority", f"{self.target[0]}:{self.target[1]}"), ("content-type", "application/grpc"),
                   ("te", "trailers")]  # fmt: skip
        if self.token is not None:
            headers.append(("authorization", f"Bearer {self.token}"))
        block = header_block(headers)
        left = self.count
        while left > 0:
            streams = min(left, self.per_connection)
            sock = socket.create_connection(self.target, timeout=5)
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
            sock.sendall(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, block) for i in range(streams)))
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, [len(self._sockets), streams, b""])
            self._sockets.append(sock)
            left -= streams
        self._thread.start()
        return self

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
                sock, (connection, streams, buffer) = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._selector.unregister(sock)
                    with self._lock:
                        self._ended.update((connection, 2 * i + 1) for i in range(streams))
                    continue
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
