"""Who may call what on the controller's gRPC port.

Transport: ``server_credentials`` turns the ``tls:`` settings into gRPC's TLS credentials, with client certificates
required when a client CA is set (mutual TLS). Calls: with tokens configured, ``TokenCheck`` (a server interceptor)
lets a call through only with ``authorization: Bearer <token>`` in its metadata, by role:

| role | RPCs | tokens that open them |
|---|---|---|
| open | grpc.health.v1.Health (Check, Watch): probes need no secret | none needed |
| read | Decide, GetSegmentStats, ListSegments, GetPolicy, GetCosts, server reflection | the read or the write token |
| write | ReportRounds, ReloadPolicy, and any method this table does not name | the write token |

No token, or a token that matches neither: UNAUTHENTICATED. The read token on a write RPC: PERMISSION_DENIED. Tokens
are compared in constant time (``hmac.compare_digest``) and never logged; refusals are logged at most every
``LOG_EVERY_S`` seconds, with how many there were in between.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from controller.config import TokenAuth
from specd_api.security import AUTHORIZATION, ServerTls, bearer_token, read_checked
from specd_api.sparse_log import SparseLog
from specd_api.v1 import controller_pb2

log = logging.getLogger("specd.controller.auth")
Role = Literal["read", "write"]
CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["Controller"]
WRITE_RPCS = frozenset({"ReportRounds", "ReloadPolicy"})  # they change what the controller knows or does
READ_METHODS = frozenset(f"/{CONTROLLER.full_name}/{m.name}" for m in CONTROLLER.methods if m.name not in WRITE_RPCS)
OPEN_PREFIX = f"/{health.SERVICE_NAME}/"
READ_PREFIX = f"/{reflection.SERVICE_NAME}/"
LOG_EVERY_S = 10.0


def required_role(method: str) -> Role | None:
    """The role ``method`` (``/package.Service/Method``) needs; None: open to all."""
    if method.startswith(OPEN_PREFIX):
        return None
    if method in READ_METHODS or method.startswith(READ_PREFIX):
        return "read"
    return "write"  # ReportRounds, ReloadPolicy, and whatever is added later until this table says otherwise


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """TLS with the configured certificate; with a client CA, a client must present a certificate it signed."""
    client_ca = read_checked(tls.client_ca_file) if tls.client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(read_checked(tls.key_file), read_checked(tls.cert_file))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


@dataclass(frozen=True)
class Tokens:
    """The accepted tokens, as bytes; never in a repr."""

    write: bytes = field(repr=False)
    read: bytes | None = field(default=None, repr=False)

    @classmethod
    def of(cls, auth: TokenAuth) -> Tokens | None:
        if auth.write_token is None:
            return None
        read = auth.read_token.reveal().encode() if auth.read_token is not None else None
        return cls(auth.write_token.reveal().encode(), read)

    def role_of(self, token: str) -> Role | None:
        """The role ``token`` opens; None when it matches no token. Both comparisons run, in constant time."""
        presented = token.encode("utf-8", "surrogateescape")
        is_write = hmac.compare_digest(presented, self.write)
        is_read = self.read is not None and hmac.compare_digest(presented, self.read)
        return "write" if is_write else "read" if is_read else None


def refusal(tokens: Tokens, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
    """Why a call to ``method`` with ``metadata`` is refused (status and message), or None when it may go on."""
    needed = required_role(method)
    if needed is None:
        return None
    values = [value for key, value in metadata or () if key == AUTHORIZATION]
    token = bearer_token(values[0]) if len(values) == 1 else None
    if token is None:
        return grpc.StatusCode.UNAUTHENTICATED, "a token is needed: metadata 'authorization: Bearer <token>'"
    role = tokens.role_of(token)
    if role is None:
        return grpc.StatusCode.UNAUTHENTICATED, "the token is not valid here"
    if needed == "write" and role == "read":
        name = method.rpartition("/")[2]
        return grpc.StatusCode.PERMISSION_DENIED, f"{name} needs the write token; this is the read token"
    return None


class RefusalLog:
    """One warning line per ``every_s`` at most, however many calls are refused (a scan must not flood the log)."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lines = SparseLog(log, logging.WARNING, every_s, " ({n} more refused in the last {seconds:g} s)", clock)

    def note(self, method: str, peer: str, code: grpc.StatusCode, reason: str) -> None:
        self._lines.note("refused %s from %s: %s: %s", method, peer, code.name, reason)


class TokenCheck(grpc.aio.ServerInterceptor):
    """The token check in front of every handler (see the module's table)."""

    def __init__(self, tokens: Tokens, refusals: RefusalLog | None = None) -> None:
        self.tokens = tokens
        self.refusals = refusals or RefusalLog()
        # (method, code, reason) -> its refusing handler, built once; (method) -> does it stream its responses.
        # Both are bounded by the service's methods: only a method that has a handler is ever kept.
        self._refusing: dict[tuple[str, grpc.StatusCode, str], grpc.RpcMethodHandler] = {}
        self._streaming: dict[str, bool] = {}

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = details.method
        why = refusal(self.tokens, method, details.invocation_metadata)
        if why is None:
            return await continuation(details)
        streaming = self._streaming.get(method)
        if streaming is None:  # the first refusal of this method: learn its kind from the handlers behind
            handler = await continuation(details)
            if handler is None:
                return None  # no such method: UNIMPLEMENTED, as without tokens
            streaming = self._streaming[method] = bool(handler.response_streaming)
        key = (method, *why)
        refusing = self._refusing.get(key)
        if refusing is None:
            refusing = self._refusing[key] = refusing_handler(streaming, method, *why, self.refusals)
        return refusing


def refusing_handler(
    response_streaming: bool, method: str, code: grpc.StatusCode, reason: str, refusals: RefusalLog
) -> grpc.RpcMethodHandler:
    """A handler that refuses the call as soon as its headers are in, on the event loop, without waiting for its
    request: a request-streaming handler, which grpc.aio runs at once and which never reads (on the wire every kind
    of call is a stream, so the client sees its status whatever the method's kind). A caller not yet trusted holds
    no thread, no stream and no parse of its bytes, even when it never sends a message."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        refusals.note(method, context.peer(), code, reason)
        await context.abort(code, reason)

    if response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


def is_loopback(listen: str) -> bool:
    """Does ``listen`` (host:port, [v6]:port or unix:path) accept connections from this host only?"""
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warnings(listen: str, tls: ServerTls | None, auth: TokenAuth) -> list[str]:
    """What an operator should know about a listen address reachable from other hosts."""
    if is_loopback(listen):
        return []
    if tls is None and auth.write_token is None:
        return [f"listening on {listen} with neither TLS nor tokens: anyone who reaches this port can report "
                "telemetry and reload the policy (see ops/README.md, Security)"]  # fmt: skip
    if tls is None:
        return [f"listening on {listen} without TLS: tokens and telemetry cross the network in plaintext"]
    return []
