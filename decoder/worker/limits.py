"""What a client can make the worker do before it is refused: the request body is bounded on its raw bytes
(``BodyLimit``, before any JSON parsing, chunked bodies included), and client-chosen values are quoted in
error messages only in part (``quote``), so a 10 KB header never comes back whole."""

from __future__ import annotations

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


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut after ``limit`` characters with the full length noted."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def clip(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters: the backstop for messages that carry a value unquoted."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


class BodyTooLarge(ValueError):
    pass


class BodyLimit:
    """ASGI middleware: an HTTP request whose body exceeds ``max_bytes`` gets 413 before the app sees a byte.

    A Content-Length above the limit is refused at once; otherwise the body is read here, counting as it
    arrives (a chunked body has no Content-Length), and handed to the app only once it is whole and within
    the limit. The app reads bodies whole anyway (JSON), so buffering here costs no extra memory.
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
            await self.error(str(e))(scope, receive, send)
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
                raise BodyTooLarge(self._too_large(f"more than {self.max_bytes} bytes arrived"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _too_large(self, seen: str) -> str:
        return f"the request body is too large ({seen}); this worker's limit is {self.max_bytes} bytes " \
               f"(limits.max_request_bytes)"  # fmt: skip
