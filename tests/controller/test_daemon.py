"""`specd controller` as a real process: systemd notify protocol on a real socket, SIGHUP reload,
graceful SIGTERM, file-watch reload, and a clear refusal to start with a bad policy."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import DEFAULT_POLICY
from tests.waiting import free_port

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp: Path, redis_url: str, policy: Path, port: int) -> Path:
    config = tmp / "controller.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nredis_url: {redis_url}\npolicy_path: {policy}\nstate_dir: {tmp / 'state'}\n"
        f"policy_watch_seconds: 0.2\nlearning: {{prefix: d{port}}}\n"
    )
    return config


def write_tokened_config(tmp: Path, redis_url: str) -> tuple[Path, int, dict[str, str]]:
    """A controller's config on a free port with the shipped policy, a grace of 1 s, and a read and a write token
    read from ``T_READ`` and ``T_WRITE``: (the config, its port, the environment holding the tokens)."""
    policy = tmp / "policy.yaml"
    policy.write_text(DEFAULT_POLICY.read_text())
    port = free_port()
    config = write_config(tmp, redis_url, policy, port)
    config.write_text(config.read_text() + "shutdown_grace_seconds: 1\n"
                      "auth: {read_token: {env: T_READ}, write_token: {env: T_WRITE}}\n")  # fmt: skip
    return config, port, {"T_READ": secrets.token_urlsafe(24), "T_WRITE": secrets.token_urlsafe(24)}


class NotifySocket:
    """The systemd side of sd_notify: a datagram socket that collects what the daemon says."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.5)
        self.messages: list[str] = []

    def wait_for(self, key: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.messages:
                if key in message.splitlines():
                    self.messages.remove(message)
                    return message
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}")


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text((REPO / "policies" / "default.yaml").read_text())
    return path


def start(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "specd", "controller", "--config", str(config)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def policy_version(port: int) -> str:
    stub = pb_grpc.ControllerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return stub.GetPolicy(pb.GetPolicyRequest(), timeout=5).version


def test_notify_reload_and_graceful_stop(tmp_path, policy, embedded_redis_url):
    notify = NotifySocket(tmp_path / "notify.sock")
    port = free_port()
    process = start(
        write_config(tmp_path, embedded_redis_url, policy, port),
        {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000", "WATCHDOG_PID": ""},
    )
    try:
        ready = notify.wait_for("READY=1")
        assert f"STATUS=serving on 127.0.0.1:{port}" in ready.splitlines()
        notify.wait_for("WATCHDOG=1")  # pings at WATCHDOG_USEC / 2
        first = policy_version(port)

        # SIGHUP with a changed file: RELOADING (with MONOTONIC_USEC), READY, a new version
        policy.write_text(policy.read_text() + "\n# edited\n")
        process.send_signal(signal.SIGHUP)
        reloading = notify.wait_for("RELOADING=1")
        assert any(line.startswith("MONOTONIC_USEC=") for line in reloading.splitlines())
        notify.wait_for("READY=1")
        assert policy_version(port) != first

        # An invalid edit is refused by the file watcher; the policy in force stays
        second = policy_version(port)
        policy.write_text("defaults:\n  min_speedup: 0.5\n")
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")
        assert policy_version(port) == second

        process.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert process.wait(timeout=30) == 0
        output = process.stdout.read() if process.stdout else ""
        assert "policy reload refused" in output and "defaults.min_speedup" in output
        assert "Traceback" not in output
    finally:
        if process.poll() is None:
            process.kill()


def test_refuses_to_start_with_a_bad_policy(tmp_path, embedded_redis_url):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  max_batch_size: many\n")
    process = start(write_config(tmp_path, embedded_redis_url, bad, free_port()), {})
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert f"{bad}:2: defaults.max_batch_size" in output
    assert "Traceback" not in output


def test_refuses_a_bad_config_with_file_line_and_field(tmp_path):
    config = tmp_path / "controller.yaml"
    config.write_text("listen: 127.0.0.1:0\nlearning:\n  half_life_seconds: -5\n")
    done = subprocess.run(
        [sys.executable, "-m", "specd", "controller", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"{config}:3: learning.half_life_seconds" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_second_controller_on_the_same_port_refuses_to_start(tmp_path, policy, embedded_redis_url):
    """gRPC binds with SO_REUSEPORT unless told not to: the second daemon then started silently and the kernel
    split the connections between the two."""
    port = free_port()
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    first = start(write_config(first_dir, embedded_redis_url, policy, port), {})
    try:
        deadline = time.monotonic() + 60
        while True:  # the first one serves
            try:
                policy_version(port)
                break
            except grpc.RpcError:
                assert first.poll() is None and time.monotonic() < deadline, "the first controller did not start"
                time.sleep(0.2)
        second = start(write_config(second_dir, embedded_redis_url, policy, port), {})
        try:
            output, _ = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            pytest.fail("the second controller is running on the port the first one holds")
        assert second.returncode != 0, output
        assert f"cannot listen on 127.0.0.1:{port}" in output and "Traceback" not in output
        assert first.poll() is None and policy_version(port)  # the first one is untouched
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_the_report_process_ends_with_a_killed_daemon(tmp_path, policy, embedded_redis_url):
    """The child that stores reports (controller/serving/report_process.py) exits once its daemon is SIGKILLed: outside
    systemd's control group nothing else would end it."""
    notify = NotifySocket(tmp_path / "notify.sock")
    process = start(write_config(tmp_path, embedded_redis_url, policy, free_port()),
                    {"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})  # fmt: skip
    try:
        notify.wait_for("READY=1")
        deadline = time.monotonic() + 30
        while not (children := _report_processes(process.pid)):
            assert time.monotonic() < deadline, "no report process started"
            time.sleep(0.1)
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in children):
            assert time.monotonic() < deadline, f"report process {children} outlived its daemon"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()


def _report_processes(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Not exited (a zombie nothing has reaped yet has exited: its parent was killed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
