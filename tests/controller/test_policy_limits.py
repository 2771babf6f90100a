"""The controller's own inputs: a FIFO at the policy path, a max_batch_size past int32, a policy of 25,000
glob rules, an embedded server whose socket path is too long."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import typing
from pathlib import Path

import pytest

from controller.decision.policy import (
    MAX_RULES,
    DrafterOverride,
    DrafterSettings,
    PolicyStore,
    Settings,
    SettingsOverride,
    file_version,
    load_policy,
    parse_policy,
)
from controller.storage.redis_conn import _MAX_UNIX_PATH, make_client, short_socket_dir, start_embedded
from specd_api.checks import MAX_BATCH_SIZE, MAX_INT32
from specd_api.yaml_config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_a_fifo_at_the_policy_path_is_refused_at_once(tmp_path: Path) -> None:
    good = tmp_path / "policy.yaml"
    good.write_text("defaults:\n  min_speedup: 1.1\n")
    store = PolicyStore(load_policy(good))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def read_it() -> None:
        try:
            load_policy(fifo)
        except ConfigError as e:
            outcome.append(e)

    reader = threading.Thread(target=read_it, daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "reading a FIFO policy hangs"
    assert outcome and "not a regular file" in str(outcome[0])
    assert file_version(fifo) is None  # the watcher sees no change instead of blocking

    good.unlink()
    os.mkfifo(good)  # the file in force becomes a FIFO: the reload is refused, the policy in force stays
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        store.reload(settle_seconds=0.01)
    assert time.monotonic() - started < 2 and store.current.document.defaults.min_speedup == 1.1


def test_specd_policy_check_refuses_a_fifo_quickly(tmp_path: Path) -> None:
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "specd", "policy", "check", str(fifo)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert done.returncode != 0 and "not a regular file" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("where", ["defaults:\n  max_batch_size: 2147483648\n",
                                   'segments:\n  - match: "a*"\n    max_batch_size: 99999999999\n',
                                   "defaults:\n  min_new_tokens: 2147483648\n",
                                   'segments:\n  - match: "a*"\n    min_new_tokens: 2147483648\n'])  # fmt: skip
def test_a_policy_integer_past_int32_is_refused(where: str) -> None:
    with pytest.raises(ConfigError, match=where.split(":")[-2].split()[-1]):
        parse_policy(where)


POLICY_MODELS = (Settings, SettingsOverride, DrafterSettings, DrafterOverride)


@pytest.mark.parametrize("model", POLICY_MODELS, ids=lambda m: m.__name__)
def test_every_integer_a_policy_holds_fits_the_wires_int32(model: type) -> None:
    """A policy integer past int32 would pass the check, then break every WatchDecisions when it reached the
    table's int32 field (max_batch_size or min_new_tokens at 2**31). Every integer field has an upper bound within
    int32."""
    for name, field in model.model_fields.items():
        if int not in (*typing.get_args(field.annotation), field.annotation):
            continue
        bounds = [m.le for m in field.metadata if getattr(m, "le", None) is not None]
        assert bounds and bounds[0] <= MAX_INT32, f"{model.__name__}.{name}: no upper bound within int32"


def test_a_policy_at_every_integers_bound_serves_decisions_and_tables(embedded_redis_url, tmp_path: Path) -> None:
    """A policy with every integer at its upper bound (and the floats at 1e308) passes the check; then Decide and a
    WatchDecisions stream with a learned segment's table answer, over gRPC (a min_new_tokens of 2**31 would fail every
    stream with UNKNOWN "Value out of range")."""
    from specd_api.v1 import controller_pb2 as pb
    from specd_api.v1 import controller_pb2_grpc as pb_grpc
    from tests.controller.test_calibration_service import draft_request
    from tests.daemons import RPC_TIMEOUT, connected, running_daemon

    text = (f"defaults:\n  max_batch_size: {MAX_BATCH_SIZE}\n  min_new_tokens: {MAX_INT32}\n  probe_rounds: 64\n"
            "  k_headroom: 64\n  prefill_cost_per_token: 1.0e+308\n  plan_prior_rounds: 1.0e+308\n"
            "  drafters:\n    draft: {k_min: 64, k_max: 64, cost_ratio: 1.0e+308}\n")  # fmt: skip
    parse_policy(text)
    with running_daemon(embedded_redis_url, tmp_path, text) as daemon, connected(daemon) as channel:
        stub = pb_grpc.ControllerStub(channel)
        stub.ReportRounds(
            pb.ReportRoundsRequest(report_id="bounds", worker_id="w", aggregates=[draft_request("at-the-bounds")]),
            timeout=RPC_TIMEOUT,
        )
        deadline = time.monotonic() + 20
        while stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="at-the-bounds"), timeout=RPC_TIMEOUT).rounds < 20:
            assert time.monotonic() < deadline, "the report never showed"
            time.sleep(0.05)
        decision = stub.Decide(pb.DecideRequest(segment="at-the-bounds", batch_size=1, drafters=["draft"],
                                                max_new_tokens=MAX_INT32), timeout=RPC_TIMEOUT)  # fmt: skip
        assert decision.policy_version
        stream = stub.WatchDecisions(pb.WatchDecisionsRequest(worker_id="w", drafters=["draft"]), timeout=30)
        first = next(stream)
        stream.cancel()
        [table] = [t for t in first.segments if t.segment == "at-the-bounds"]
        assert table.min_new_tokens == MAX_INT32 and table.max_batch_size == MAX_BATCH_SIZE


def test_too_many_rules_are_refused_and_matching_is_resolved_once(tmp_path: Path) -> None:
    rules = "".join(f'  - match: "tenant-{i}-*"\n    min_speedup: 1.2\n' for i in range(MAX_RULES + 1))
    with pytest.raises(ConfigError, match=f"at most {MAX_RULES}"):
        parse_policy("segments:\n" + rules)
    rules = "".join(f'  - match: "tenant-{i}-*"\n    min_speedup: 1.2\n' for i in range(MAX_RULES))
    policy = parse_policy("segments:\n" + rules)
    first = time.perf_counter()
    settings = policy.for_segment("unmatched")  # every glob tried once
    once = time.perf_counter() - first
    again = time.perf_counter()
    for _ in range(1000):
        assert policy.for_segment("unmatched") is settings
    per_call = (time.perf_counter() - again) / 1000
    assert per_call < max(once / 10, 50e-6), (once, per_call)
    assert policy.for_segment(f"tenant-{MAX_RULES - 1}-x").min_speedup == 1.2


def test_an_embedded_server_with_a_long_state_dir_listens_on_a_private_socket(tmp_path: Path) -> None:
    # Past the Unix-socket path limit the server must not fall back to loopback TCP without a password.
    deep = tmp_path / ("d" * max(1, _MAX_UNIX_PATH - len(str(tmp_path)) + 8))
    server, url = start_embedded(deep)
    try:
        assert url.startswith("unix://") and make_client(url, 2.0).ping()
        socket_dir = Path(url.removeprefix("unix://")).parent
        assert socket_dir.stat().st_mode & 0o077 == 0 and socket_dir.stat().st_uid == os.getuid()
        assert server.port in (0, None) or not _tcp_open(server.port)
    finally:
        server.stop()
    again, url_again = start_embedded(deep)  # a restart finds the same socket
    again.stop()
    assert url_again == url


def test_the_socket_path_is_measured_in_bytes(tmp_path: Path) -> None:
    """A state dir of fewer characters than the limit but more bytes (60 'é' are 120 bytes) is measured in bytes:
    counted in characters it would pass the check, and the server could not start ("unix socket path too long")."""
    base = Path(tempfile.mkdtemp(prefix="s-"))  # short: the characters must stay under the limit
    wide = base / ("é" * 40)
    socket = wide / "valkey.sock"
    assert len(str(socket)) <= _MAX_UNIX_PATH < len(os.fsencode(socket)), (len(str(socket)), len(os.fsencode(socket)))
    try:
        server, url = start_embedded(wide)
        try:
            assert url.startswith("unix://") and make_client(url, 2.0).ping()
            assert len(os.fsencode(url.removeprefix("unix://"))) <= _MAX_UNIX_PATH
        finally:
            server.stop()
            shutil.rmtree(Path(url.removeprefix("unix://")).parent, ignore_errors=True)  # the short folder
    finally:
        shutil.rmtree(base)


def test_a_socket_folder_taken_by_someone_else_gives_way_to_a_new_private_one(tmp_path: Path) -> None:
    """The short folder's name is predictable: another local user who made it first must not stop the start ("not a
    private folder"). A new private folder of a random name is used instead."""
    deep = tmp_path / ("d" * max(1, _MAX_UNIX_PATH - len(str(tmp_path)) + 8))
    taken = short_socket_dir(deep)
    taken.rmdir()
    taken.mkdir(mode=0o755)  # as another user's would be: readable by all
    taken.chmod(0o755)
    try:
        server, url = start_embedded(deep)
        try:
            folder = Path(url.removeprefix("unix://")).parent
            assert folder != taken and folder.stat().st_mode & 0o077 == 0 and make_client(url, 2.0).ping()
        finally:
            server.stop()
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        taken.rmdir()


def _tcp_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
