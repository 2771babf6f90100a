"""The sd_notify protocol, spoken directly: readiness, reload, stop and watchdog messages to systemd.

A service started with `Type=notify` finds an AF_UNIX datagram socket's address in $NOTIFY_SOCKET
(a path, or "@name" for the Linux abstract namespace) and sends it newline-separated KEY=VALUE lines,
one message per datagram (sd_notify(3)). Outside systemd the variable is unset and every call here is
a no-op, so the daemon calls these methods unconditionally. Sending never raises: a lost status
message must not take the daemon down with it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType

logger = logging.getLogger(__name__)

# How long one send may block when systemd's receive queue is full; a notification is not worth more.
SEND_TIMEOUT_S = 2.0


def notify_address(value: str | None) -> str | None:
    """The AF_UNIX address for a $NOTIFY_SOCKET value, or None when there is nothing we can send to.

    "/run/systemd/notify" is a filesystem path; "@name" names "\\0name" in the abstract namespace.
    systemd accepts nothing else over AF_UNIX (relative paths are invalid); "vsock:CID:PORT" is
    systemd's AF_VSOCK form for a VM's PID 1 talking to its host, never a service's, so it is skipped.
    """
    if not value:
        return None
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("vsock"):
        logger.debug("NOTIFY_SOCKET=%r is an AF_VSOCK address, not supported; notifications are off", value)
    else:
        logger.debug("NOTIFY_SOCKET=%r is neither an absolute path nor '@name'; notifications are off", value)
    return None


def format_message(assignments: Mapping[str, str]) -> bytes:
    """KEY=VALUE lines; a newline inside a value would start a forged assignment, so it becomes a space."""
    lines = [f"{key}={value.replace(chr(10), ' ')}" for key, value in assignments.items()]
    return "\n".join(lines).encode()


def parse_positive_int(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        logger.debug("ignoring %s=%r: not an integer", name, value)
        return None
    if number <= 0:
        logger.debug("ignoring %s=%r: not positive", name, value)
        return None
    return number


class Notifier:
    """Sends sd_notify messages when NOTIFY_SOCKET is set; a no-op otherwise.

    Safe to share between threads (the WatchdogPinger's and the daemon's main loop): one socket, opened
    on the first message, used under a lock.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None, watchdog_pid: int | None = None) -> None:
        self._address = address  # an AF_UNIX address as notify_address() returns it, or None
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._socket: socket.socket | None = None
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(
            notify_address(env.get("NOTIFY_SOCKET")),
            watchdog_usec=parse_positive_int("WATCHDOG_USEC", env.get("WATCHDOG_USEC")),
            watchdog_pid=parse_positive_int("WATCHDOG_PID", env.get("WATCHDOG_PID")),
        )

    @property
    def enabled(self) -> bool:
        return self._address is not None and not self._closed

    def ready(self, status: str | None = None) -> None:
        self._notify({"READY": "1"}, status)

    def reloading(self) -> None:
        # Type=notify-reload (systemd >= 253) requires MONOTONIC_USEC with RELOADING=1, so that the
        # manager can tell this reload from an older one; it is harmless with plain Type=notify.
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._notify({"RELOADING": "1", "MONOTONIC_USEC": str(now_usec)})

    def stopping(self, status: str | None = None) -> None:
        self._notify({"STOPPING": "1"}, status)

    def status(self, text: str) -> None:
        self._notify({}, text)

    def watchdog(self) -> None:
        self._notify({"WATCHDOG": "1"})

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half of WatchdogSec=, as sd_watchdog_enabled(3) advises.

        None when notifications are off, no watchdog is configured, or WATCHDOG_PID names another
        process (the variables were inherited by a child, which must not ping on its parent's behalf).
        """
        if not self.enabled or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1e6

    def close(self) -> None:
        """Close the socket; later calls are no-ops."""
        with self._lock:
            self._closed = True
            if self._socket is not None:
                self._socket.close()
                self._socket = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _notify(self, assignments: dict[str, str], status: str | None = None) -> None:
        if status is not None:
            assignments["STATUS"] = status
        if assignments:
            self._send(format_message(assignments))

    def _send(self, message: bytes) -> None:
        if self._address is None:
            return
        with self._lock:
            if self._closed:
                return
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    self._socket.settimeout(SEND_TIMEOUT_S)
                self._socket.sendto(message, self._address)
            except OSError as error:
                logger.debug("sd_notify %r to %r failed: %s", message, self._address, error)


class WatchdogPinger:
    """A daemon thread that calls notifier.watchdog() every interval until stop(); a context manager too.

    It pings only while is_healthy() returns True (an exception counts as False), so a daemon whose
    main loop is wedged stops pinging and systemd restarts it after WatchdogSec=.
    """

    def __init__(self, notifier: Notifier, interval: float, is_healthy: Callable[[], bool] = lambda: True) -> None:
        if not interval > 0:
            raise ValueError(f"watchdog interval must be positive, got {interval!r}")
        self._notifier = notifier
        self._interval = interval
        self._is_healthy = is_healthy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("WatchdogPinger already started")
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> WatchdogPinger:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        was_healthy = True
        while not self._stop.is_set():
            healthy = self._check_health()
            if healthy:
                self._notifier.watchdog()
            elif was_healthy:
                logger.warning("daemon unhealthy: withholding watchdog pings, systemd will restart it")
            if healthy and not was_healthy:
                logger.info("daemon healthy again: watchdog pings resumed")
            was_healthy = healthy
            self._stop.wait(self._interval)

    def _check_health(self) -> bool:
        try:
            return bool(self._is_healthy())
        except Exception:
            logger.exception("watchdog health check raised; treating the daemon as unhealthy")
            return False
