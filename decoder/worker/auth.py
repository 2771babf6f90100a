"""The worker's API keys, OpenAI style: ``Authorization: Bearer <key>`` on every request, else 401 with an OpenAI
error body. ``ApiKeyCheck`` is ASGI middleware in front of everything else (the body limit included), so a caller
without a key is refused before a byte of its body is read; /health and /metrics can each be left open. A key is
compared with every configured key in constant time (the time does not depend on which key matches) and never appears
in a response or a log line. The tenant a key names (``TenantKey``, None for the operator's key) goes with the request,
in its ASGI state under ``TENANT_STATE``, for the segment check (decoder/worker/app.py)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from starlette.responses import JSONResponse

from decoder.worker.limits import ASGIApp, Receive, Scope, Send
from decoder.worker.openai_api import error_body
from specd_api.security import AUTHORIZATION, bearer_token

MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth "
    "(i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY = "Incorrect API key provided."
TENANT_STATE = "specd_tenant"
_HEADER = AUTHORIZATION.encode()


def unauthorized(message: str, code: str | None) -> JSONResponse:
    body = error_body(message, "invalid_request_error", None, code)
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyCheck:
    """ASGI middleware: an HTTP request to a path outside ``open_paths`` needs ``Authorization: Bearer <key>`` with
    one of ``keys`` (each key -> what it names, set as the request's ``TENANT_STATE``)."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, object], open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self._keys = [(key.encode(), named) for key, named in keys.items()]
        self.open_paths = frozenset(open_paths)

    def __repr__(self) -> str:
        return f"ApiKeyCheck(keys={len(self._keys)}, open_paths={sorted(self.open_paths)})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        """The 401 for the request's credentials, or None (the tenant its key names is then in its state)."""
        values = [value for name, value in scope.get("headers", ()) if name == _HEADER]
        token = bearer_token(values[0]) if len(values) == 1 else None
        if token is None:
            return unauthorized(MISSING_KEY, None)
        given = token.encode("latin-1")  # the header's own bytes back
        matched = [named for key, named in self._keys if hmac.compare_digest(given, key)]  # every key compared
        if not matched:
            return unauthorized(WRONG_KEY, "invalid_api_key")
        scope.setdefault("state", {})[TENANT_STATE] = matched[0]
        return None
