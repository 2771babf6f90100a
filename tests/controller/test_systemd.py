"""sd_notify against real AF_UNIX datagram sockets, the watchdog thread, and the systemd units themselves (the
controller's and the worker's, which lives beside it in ops/)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.serving.systemd import Notifier, WatchdogPinger, notify_address

OPS = Path(__file__).resolve().parents[2] / "ops"
UNIT = OPS / "specd-controller.service"
WORKER_UNIT = OPS / "specd-worker.service"
UNITS = {"controller": UNIT, "worker": WORKER_UNIT}
# The bar: the controller's unit scores 1.2 ("OK"); neither unit may fall back past 1.5.
MAX_EXPOSURE = 1.5
RECV_TIMEOUT_S = 2.0


class Receiver:
    """The manager's end of NOTIFY_SOCKET: a bound datagram socket we read messages from."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value  # what NOTIFY_SOCKET would say

    def recv(self) -> str:
        self.sock.settimeout(RECV_TIMEOUT_S)
        return self.sock.recv(4096).decode()

    def drain(self) -> list[str]:
        """Every message already queued, without waiting."""
        messages = []
        self.sock.setblocking(False)
        try:
            while True:
                messages.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return messages

    def notifier(self, **extra: str) -> Notifier:
        return Notifier.from_environment({"NOTIFY_SOCKET": self.env_value, **extra})


@pytest.fixture
def path_receiver(tmp_path: Path) -> Iterator[Receiver]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield Receiver(sock, str(path))


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"specd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield Receiver(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    return request.getfixturevalue(f"{request.param}_receiver")


def test_each_call_sends_one_datagram_with_the_exact_assignments(receiver: Receiver) -> None:
    with receiver.notifier() as notifier:
        assert notifier.enabled
        notifier.ready()
        assert receiver.recv() == "READY=1"
        notifier.ready(status="serving on :50051")
        assert receiver.recv() == "READY=1\nSTATUS=serving on :50051"
        notifier.stopping()
        assert receiver.recv() == "STOPPING=1"
        notifier.stopping(status="draining 3 requests")
        assert receiver.recv() == "STOPPING=1\nSTATUS=draining 3 requests"
        notifier.status("policy v7 loaded")
        assert receiver.recv() == "STATUS=policy v7 loaded"
        notifier.watchdog()
        assert receiver.recv() == "WATCHDOG=1"


def test_reloading_carries_the_current_monotonic_clock_in_microseconds(receiver: Receiver) -> None:
    notifier = receiver.notifier()
    before = time.monotonic_ns() // 1000
    notifier.reloading()
    after = time.monotonic_ns() // 1000
    reloading, stamp = receiver.recv().split("\n")
    assert reloading == "RELOADING=1"
    key, value = stamp.split("=")
    assert key == "MONOTONIC_USEC"
    # Between two readings of the same clock: a wall-clock or millisecond value would fall outside.
    assert before <= int(value) <= after


def test_a_newline_in_a_status_cannot_forge_another_assignment(receiver: Receiver) -> None:
    receiver.notifier().status("line one\nREADY=1")
    assert receiver.recv() == "STATUS=line one READY=1"


def test_after_close_calls_send_nothing(receiver: Receiver) -> None:
    notifier = receiver.notifier()
    notifier.ready()
    assert receiver.recv() == "READY=1"
    notifier.close()
    assert not notifier.enabled
    notifier.watchdog()
    notifier.stopping()
    assert receiver.drain() == []


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({}, id="unset"),
        pytest.param({"NOTIFY_SOCKET": ""}, id="empty"),
        pytest.param({"NOTIFY_SOCKET": "relative/path"}, id="relative path (systemd accepts only absolute)"),
        pytest.param({"NOTIFY_SOCKET": "@"}, id="bare @ names no socket"),
        pytest.param({"NOTIFY_SOCKET": "vsock:2:1234"}, id="vsock is not supported"),
    ],
)
def test_without_a_usable_notify_socket_every_call_is_a_no_op(environ: dict[str, str]) -> None:
    notifier = Notifier.from_environment({**environ, "WATCHDOG_USEC": "30000000"})
    assert not notifier.enabled
    notifier.ready("x")
    notifier.reloading()
    notifier.stopping("x")
    notifier.status("x")
    notifier.watchdog()
    assert notifier.watchdog_interval() is None  # nothing to ping even though a watchdog is asked for
    notifier.close()


def test_from_environment_reads_os_environ_by_default(path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_receiver.env_value)
    Notifier.from_environment().ready()
    assert path_receiver.recv() == "READY=1"


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@/org/freedesktop/systemd1/notify/1", "\0/org/freedesktop/systemd1/notify/1"),  # "@" -> NUL
        ("notify", None),
        (None, None),
    ],
)
def test_notify_address(value: str | None, address: str | None) -> None:
    assert notify_address(value) == address


def test_sending_to_a_missing_socket_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "no-such-socket")})
    assert notifier.enabled  # it cannot know until it sends
    with caplog.at_level("DEBUG", logger="controller.serving.systemd"):
        notifier.ready()
        notifier.watchdog()
    assert "no-such-socket" in caplog.text  # the failure is logged, at debug level only
    assert all(record.levelname == "DEBUG" for record in caplog.records)


def test_sending_to_a_socket_nobody_reads_any_more_does_not_raise(tmp_path: Path) -> None:
    path = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
    # The file is still there but no socket is bound to it: sendto fails with ECONNREFUSED.
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": str(path)})
    notifier.ready()
    notifier.stopping()


@pytest.mark.parametrize(
    ("extra", "interval"),
    [
        pytest.param({"WATCHDOG_USEC": "30000000"}, 15.0, id="WatchdogSec=30 -> ping every 15 s"),
        pytest.param({"WATCHDOG_USEC": "500000"}, 0.25, id="half a second -> every quarter second"),
        pytest.param({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "<self>"}, 15.0, id="PID is ours"),
        pytest.param({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None, id="PID is another's"),
        pytest.param({}, None, id="no watchdog"),
        pytest.param({"WATCHDOG_USEC": "0"}, None, id="zero means off"),
        pytest.param({"WATCHDOG_USEC": "soon"}, None, id="garbage is ignored"),
    ],
)
def test_watchdog_interval(path_receiver: Receiver, extra: dict[str, str], interval: float | None) -> None:
    if extra.get("WATCHDOG_PID") == "<self>":
        extra = {**extra, "WATCHDOG_PID": str(os.getpid())}
    assert path_receiver.notifier(**extra).watchdog_interval() == interval


PING_INTERVAL_S = 0.02
QUIET_S = 10 * PING_INTERVAL_S  # long enough for several pings, had any been sent


def test_watchdog_pinger_pings_only_while_healthy_and_not_after_stop(path_receiver: Receiver) -> None:
    healthy = threading.Event()
    healthy.set()
    saw_unhealthy = threading.Event()

    def is_healthy() -> bool:
        if not healthy.is_set():
            saw_unhealthy.set()
            return False
        return True

    pinger = WatchdogPinger(path_receiver.notifier(), PING_INTERVAL_S, is_healthy=is_healthy)
    pinger.start()
    try:
        assert [path_receiver.recv() for _ in range(3)] == ["WATCHDOG=1"] * 3

        healthy.clear()
        # Once the pinger has seen "unhealthy", its last ping (sent before that check) is queued.
        assert saw_unhealthy.wait(RECV_TIMEOUT_S)
        path_receiver.drain()
        time.sleep(QUIET_S)
        assert path_receiver.drain() == []

        healthy.set()
        assert path_receiver.recv() == "WATCHDOG=1"
    finally:
        pinger.stop()  # joins the thread: nothing can be sent after it returns
    path_receiver.drain()
    time.sleep(QUIET_S)
    assert path_receiver.drain() == []


def test_a_health_check_that_raises_counts_as_unhealthy(path_receiver: Receiver) -> None:
    def broken() -> bool:
        raise RuntimeError("redis client wedged")

    with WatchdogPinger(path_receiver.notifier(), PING_INTERVAL_S, is_healthy=broken):
        time.sleep(QUIET_S)
    assert path_receiver.drain() == []


def test_watchdog_pinger_as_context_manager_pings_at_once(path_receiver: Receiver) -> None:
    with WatchdogPinger(path_receiver.notifier(), interval=60.0):
        # The first ping goes out on start, not after a whole interval.
        assert path_receiver.recv() == "WATCHDOG=1"


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_watchdog_pinger_rejects_a_non_positive_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        WatchdogPinger(Notifier(None), interval)


def test_watchdog_pinger_cannot_start_twice() -> None:
    with WatchdogPinger(Notifier(None), 60.0) as pinger, pytest.raises(RuntimeError):
        pinger.start()


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def installable_copy(name: str, tmp_path: Path) -> Path:
    """The unit with ExecStart= pointing at /bin/true: verify checks that it is executable, and the real one exists
    only once installed."""
    text = UNITS[name].read_text()
    assert f"ExecStart=/opt/specd/.venv/bin/specd {name} " in text
    unit = tmp_path / UNITS[name].name
    unit.write_text(text.replace("/opt/specd/.venv/bin/specd", shutil.which("true") or "/bin/true"))
    return unit


@needs_systemd_analyze
@pytest.mark.parametrize("name", UNITS)
def test_unit_file_passes_systemd_analyze_verify(name: str, tmp_path: Path) -> None:
    unit = installable_copy(name, tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # verify exits 0 on unknown keys and unparsable values; it only warns, so warnings fail too.
    assert result.stderr == "" and result.stdout == "", result.stderr + result.stdout


@needs_systemd_analyze
@pytest.mark.parametrize("name", UNITS)
def test_unit_exposure_score_stays_at_most_the_bar(name: str, tmp_path: Path) -> None:
    unit = installable_copy(name, tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, result.stdout


HARDENING_KEYS = {
    "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities", "ProtectSystem", "ProtectHome", "PrivateTmp",
    "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectClock", "ProtectHostname", "ProtectProc", "PrivateMounts", "RemoveIPC", "RestrictNamespaces",
    "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality", "MemoryDenyWriteExecute", "RestrictAddressFamilies",
    "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber", "UMask",
}  # fmt: skip


def settings(unit: Path) -> set[str]:
    """The unit's ``Key=value`` lines, comments and section headers left out."""
    lines = (line.strip() for line in unit.read_text().splitlines())
    return {line for line in lines if line and not line.startswith(("#", "["))}


def test_the_worker_keeps_the_controllers_sandbox_but_for_what_torch_needs() -> None:
    """Every hardening line of the controller's unit is in the worker's, except two, each explained in the worker's
    unit: writable-and-executable memory (torch's JIT kernels) and the @resources system calls (CPU affinity, NUMA
    memory policy)."""
    controller = {line for line in settings(UNIT) if line.partition("=")[0] in HARDENING_KEYS}
    worker = settings(WORKER_UNIT)
    assert len(controller) == len(HARDENING_KEYS) + 2, "one line per key; SystemCallFilter= three times"
    # the controller denies @resources but setpriority (its report process lowers its own priority); the worker
    # allows @resources whole
    allowed_gaps = {
        "MemoryDenyWriteExecute=yes",
        "SystemCallFilter=~@privileged @resources",
        "SystemCallFilter=setpriority",
    }
    assert controller - worker == allowed_gaps
    assert "SystemCallFilter=~@privileged" in worker
    assert not any(line.startswith("MemoryDenyWriteExecute=") for line in worker)
    comments = [line for line in WORKER_UNIT.read_text().splitlines() if line.startswith("#")]
    for why in ("MemoryDenyWriteExecute", "@resources"):  # each gap is explained where it is made
        assert any(why in line for line in comments), why
