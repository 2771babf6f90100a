"""What a client can make the worker do before it is refused: the request body is bounded on its raw bytes
(``BodyLimit``, before any JSON parsing, chunked bodies included), and client-chosen values are quoted in
error messages only in part (``quote``), so a 10 KB header never comes back whole."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

QUOTE_CHARS = 64  # the most characters of a client's value an error message repeats
MESSAGE_CHARS = 500  # the longest error message the worker sends
# After a 413, the rest of the body is read and dropped, up to these bounds, before the connection is closed: closed
# with unread bytes, a socket is reset, and a client still sending loses the 413 to the reset.
DISCARD_BYTES = 64 << 20
DISCARD_SECONDS = 10.0


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut after ``limit`` characters with the full length noted."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def clip(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters: the backstop for messages that carry a value unquoted."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


class BodyTooLarge(ValueError):
    def __init__(self, message: str, more: bool = True) -> None:
        super().__init__(message)
        self.more = more  # more of the body is still to come


class BodyLimit:
    """ASGI middleware: an HTTP request whose body exceeds ``max_bytes`` gets 413 before the app sees a byte.

    A Content-Length above the limit is refused at once; otherwise the body is read here, counting as it
    arrives (a chunked body has no Content-Length), and handed to the app only once it is whole and within
    the limit. The app reads bodies whole anyway (JSON), so buffering here costs no extra memory.

    The 413 is sent whole at once with ``Connection: close``; the rest of the body is then read and dropped (up to
    ``DISCARD_BYTES`` or ``DISCARD_SECONDS``) before the response ends and the connection closes, so that a client
    still sending gets the 413 and an orderly close, not a reset.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, error: Callable[[str], JSONResponse]) -> None:
        self.app, self.max_bytes, self.error = app, max_bytes, error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared(scope)
            first = await self._read_body(receive)
        except BodyTooLarge as e:
            await self._refuse(str(e), e.more, receive, send)
            return
        pending = [first]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _check_declared(self, scope: Scope) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                raise BodyTooLarge(self._too_large(f"Content-Length is {int(value)} bytes"))

    async def _read_body(self, receive: Receive) -> Message:
        """The whole body as one message (or the disconnect that cut it short)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # http.disconnect: the app sees it as it would have
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                more = bool(message.get("more_body", False))
                raise BodyTooLarge(self._too_large(f"more than {self.max_bytes} bytes arrived"), more)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, message: str, more: bool, receive: Receive, send: Send) -> None:
        """The 413, whole, then the rest of the body dropped, then the end of the response (the server closes)."""
        response = self.error(message)
        headers = [*response.raw_headers, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if more:
            await _discard_body(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _too_large(self, seen: str) -> str:
        return f"the request body is too large ({seen}); this worker's limit is {self.max_bytes} bytes " \
               f"(limits.max_request_bytes)"  # fmt: skip


async def _discard_body(receive: Receive) -> None:
    """Read and drop the rest of a request's body: until it ends, the client goes, or a discard bound is reached."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DISCARD_SECONDS
    dropped = 0
    while dropped <= DISCARD_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))
