"""Supervision of the embedded Redis (storage/redis_conn.py ``Supervisor``), with real processes and real gRPC.

A dead embedded Redis must be restarted, and gRPC health must not stay SERVING while the controller runs stale.
Here: SIGKILL it under a running controller; the ``specd.redis`` health turns NOT_SERVING within seconds while
``""`` and the Controller service stay SERVING (Decide answers from memory); it is restarted on the same socket and
data; health is SERVING again; the reports made during the outage were journaled and are stored exactly once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controller.server import REDIS_HEALTH, SERVICE_NAME
from controller.storage.redis_conn import PID_FILE, Supervisor, _running, make_client, start_embedded
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_journal import (
    NOT_SERVING,
    ROUNDS,
    RPC_TIMEOUT,
    SERVING,
    health,
    report_request,
    running_daemon,
    stored_rounds,
    wait_until,
)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A state dir whose socket path fits in AF_UNIX's 108 bytes (pytest's tmp_path may not)."""
    with tempfile.TemporaryDirectory(prefix="sv", dir="/tmp") as folder:
        yield Path(folder)


def test_a_killed_embedded_redis_is_restarted_and_health_follows(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backoff = (4.0, 8.0)  # the first restart comes 4 s after the death: the outage the reports below fall into
    with (
        caplog.at_level(logging.INFO),
        running_daemon(short_dir, None, redis_restart_backoff_seconds=backoff) as daemon,
    ):
        learner, url = daemon.controller.learner, daemon._redis.url  # type: ignore[union-attr]
        pid_file = short_dir / "redis" / PID_FILE
        with grpc.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.ControllerStub(channel)
            assert health(channel, REDIS_HEALTH) == SERVING
            assert not stub.ReportRounds(report_request("before", "chat"), timeout=RPC_TIMEOUT).journaled

            # 1. SIGKILL: no chance to clean up, as the OOM killer would do it.
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            assert wait_until(lambda: health(channel, REDIS_HEALTH) == NOT_SERVING, timeout=5)
            degraded_after = time.monotonic() - killed_at

            # 2. Degraded, not down: health "" and the Controller service stay SERVING; Decide answers, marked stale;
            # reports are journaled and acknowledged.
            assert (health(channel, ""), health(channel, SERVICE_NAME)) == (SERVING, SERVING)
            decision = stub.Decide(
                pb.DecideRequest(segment="chat", batch_size=1, drafters=["draft"], max_new_tokens=64),
                timeout=RPC_TIMEOUT,
            )
            assert decision.stale
            outage = [f"during-{n}" for n in range(5)]
            for report_id in outage:
                assert stub.ReportRounds(report_request(report_id, "chat"), timeout=RPC_TIMEOUT).journaled
            assert health(channel, REDIS_HEALTH) == NOT_SERVING, "the test's reports fell after the restart"

            # 3. Restarted on the same socket and data: health SERVING again, the journal replayed.
            assert wait_until(lambda: health(channel, REDIS_HEALTH) == SERVING, timeout=20)
            recovered_after = time.monotonic() - killed_at
            # (Redis may answer a moment before the supervisor has noted the new pid.)
            assert wait_until(lambda: int(pid_file.read_text()) != pid, timeout=5)
            assert _running(int(pid_file.read_text())) and not _running(pid)
            assert wait_until(lambda: not len(learner.journal), timeout=10)
            assert not stub.Decide(
                pb.DecideRequest(segment="chat", batch_size=1, drafters=["draft"], max_new_tokens=64),
                timeout=RPC_TIMEOUT,
            ).stale

            # 4. Exactly once: a worker's retry of a report acknowledged during the outage is a duplicate.
            assert stub.ReportRounds(report_request(outage[2], "chat"), timeout=RPC_TIMEOUT).duplicate
            check = make_client(url, 2.0)
            assert stored_rounds(check, daemon.config.learning.prefix) == len(ROUNDS) * (1 + len(outage))
            check.close()
    restarts = [r for r in caplog.records if "embedded Redis restarted" in r.getMessage()]
    deaths = [r for r in caplog.records if "exited with status" in r.getMessage()]
    assert (len(restarts), len(deaths)) == (1, 1), "each death and each restart logged once"
    print(f"\nSIGKILL: health degraded after {degraded_after:.2f}s, SERVING again after {recovered_after:.2f}s")
    assert degraded_after < 3.0


def test_a_failed_restart_backs_off_and_a_later_one_succeeds(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Something else holds the socket for a while: each try fails and the delay doubles, up to its bound."""
    server, url = start_embedded(short_dir)
    assert url.startswith("unix://")
    supervisor = Supervisor(server, (0.2, 0.8))
    supervisor.start()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with caplog.at_level(logging.INFO, logger="controller.storage.redis_conn"):
            os.kill(server._process.pid, signal.SIGKILL)
            path = url.removeprefix("unix://")
            os.unlink(path)  # what the dead server left; the squatter takes the name before the first try
            squatter.bind(path)
            squatter.listen()
            assert wait_until(lambda: len(failures(caplog)) >= 3, timeout=10)
            squatter.close()
            os.unlink(path)
            assert wait_until(lambda: supervisor.restarts == 1, timeout=10)
        client = make_client(url, 2.0)
        assert client.ping()
        client.close()
        delays = [r.getMessage().rsplit("next try in ", 1)[1] for r in failures(caplog)[:3]]
        assert delays == ["0.4s", "0.8s", "0.8s"], "doubling from 0.2 s, bounded at 0.8 s"
    finally:
        squatter.close()
        supervisor.stop()
        server.stop()


def failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "restarting embedded Redis failed" in r.getMessage()]


def test_a_stopped_but_living_server_is_not_restarted(short_dir: Path) -> None:
    """SIGSTOP (or a long script) makes Redis unresponsive, not dead: a restart beside it would fight over its files.
    The controller runs degraded until it answers again."""
    server, _ = start_embedded(short_dir)
    supervisor = Supervisor(server, (0.1, 0.2))
    supervisor.start()
    pid = server._process.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1.0)
        assert supervisor.restarts == 0 and int((short_dir / PID_FILE).read_text()) == pid
    finally:
        os.kill(pid, signal.SIGCONT)
        supervisor.stop()
        server.stop()


def test_every_acknowledged_write_is_in_the_append_only_file_before_the_answer(short_dir: Path) -> None:
    """A report is acknowledged once Redis answers, so the embedded server must write (and fsync) before answering.
    Under "everysec" Valkey may postpone the write while a background fsync runs, and a SIGKILL then loses
    acknowledged reports (CI lost 4 rounds that way). Each write is followed at once by a SIGKILL here."""
    server, url = start_embedded(short_dir)
    try:
        client = make_client(url, 2.0)
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        for n in range(5):
            client.incr("acknowledged")
            os.kill(server._process.pid, signal.SIGKILL)
            server._process.wait()
            server.terminate()
            server.start(timeout=15.0)
            assert int(client.get("acknowledged") or 0) == n + 1
        client.close()
    finally:
        server.stop()
