"""The controller's gRPC port locked down, over real sockets: TLS and mutual TLS with certificates openssl makes for
the test (tests/tls_certs.py), bearer tokens by role, the client library and the CLI speaking both, and bad settings
refused when the configuration is loaded, with file, line and field.

Two daemons serve the module: ``secured`` (mutual TLS, a read and a write token) and ``tls_only`` (TLS, no client
certificate asked, no tokens). Each refusal test has a twin that passes with the right credentials, so a refusal
cannot come from a broken set-up."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.config import ControllerConfig, TokenAuth, load_config
from controller.server import ControllerDaemon
from controller.serving.auth import RefusalLog, Tokens, exposure_warnings, refusal, required_role
from specd.cli import main as specd_main
from specd_api.request_features import RequestFeatures
from specd_api.security import ClientTls, ControllerCredentials, Secret, ServerTls, controller_channel
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError, parse_yaml_model
from specd_client import ClientConfig, ControllerClient
from tests.daemons import running_daemon
from tests.tls_certs import Pki, encrypted_copy, make_pki, uncomment
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0
CONTROLLER = "/specd.v1.Controller/"


@dataclass(frozen=True)
class TokenFiles:
    read: Path
    write: Path
    wrong: Path

    def text(self, which: str) -> str:
        return str(getattr(self, which).read_text().strip())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> TokenFiles:
    folder = tmp_path_factory.mktemp("tokens")
    paths = {}
    for name in ("read", "write", "wrong"):
        paths[name] = folder / f"{name}.token"
        paths[name].write_text(secrets.token_hex(16) + "\n")
        paths[name].chmod(0o600)
    return TokenFiles(**paths)


def running(
    folder: Path, redis_url: str, listen: str = "127.0.0.1:0", **security: Any
) -> AbstractContextManager[ControllerDaemon]:
    """A daemon (tests/daemons.py) with the shipped policy and ``security`` (``tls``, ``auth``)."""
    return running_daemon(redis_url, folder, listen=listen, shutdown_grace_seconds=0.5, **security)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, embedded_redis_url, pki, tokens) -> Iterator[ControllerDaemon]:
    """Mutual TLS (client certificates from pki.ca only) and two tokens."""
    tls = ServerTls(cert_file=pki.server.cert, key_file=pki.server.key, client_ca_file=pki.ca)
    auth = TokenAuth(read_token=Secret(file=tokens.read), write_token=Secret(file=tokens.write))
    with running(tmp_path_factory.mktemp("secured"), embedded_redis_url, tls=tls, auth=auth) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def tls_only(tmp_path_factory, embedded_redis_url, pki) -> Iterator[ControllerDaemon]:
    tls = ServerTls(cert_file=pki.server.cert, key_file=pki.server.key)
    with running(tmp_path_factory.mktemp("tls-only"), embedded_redis_url, tls=tls) as daemon:
        yield daemon


def credentials(
    pki: Pki, ca: Path | None = None, client: str | None = "client", token: Path | None = None, server_name: str = ""
) -> ControllerCredentials:
    pair = getattr(pki, client) if client else None
    tls = ClientTls(
        ca_file=ca or pki.ca, cert_file=pair.cert if pair else None, key_file=pair.key if pair else None,
        server_name=server_name or None,
    )  # fmt: skip
    return ControllerCredentials(tls=tls, token=Secret(file=token) if token else None)


@contextmanager
def stub(daemon: ControllerDaemon, creds: ControllerCredentials | None) -> Iterator[pb_grpc.ControllerStub]:
    with controller_channel(daemon.address, creds) as channel:
        yield pb_grpc.ControllerStub(channel)


def decide_request() -> pb.DecideRequest:
    return pb.DecideRequest(segment="auth", batch_size=1, drafters=["prompt_lookup"])


def report_request() -> pb.ReportRoundsRequest:
    aggregate = pb.RoundsAggregate(
        segment="auth", drafter="prompt_lookup", k=2, rounds=4, num_drafted=8, num_accepted=4,
        proposed_per_position=[4, 4], verified_per_position=[4, 3], accepted_per_position=[3, 1],
        tokens_emitted=8, draft_seconds=0.0, verify_seconds=0.04, batch_size=1,
        rounds_by_drafted=[0, 0, 4], verify_seconds_by_drafted=[0.0, 0.0, 0.04],
    )  # fmt: skip
    return pb.ReportRoundsRequest(report_id=uuid.uuid4().hex, worker_id="t", aggregates=[aggregate])


def refused_with(call: Any, request: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call(request, timeout=TIMEOUT)
    code: grpc.StatusCode = raised.value.code()
    return code


# --- transport: TLS and mutual TLS -------------------------------------------------------------------------


def test_tls_with_the_right_ca_answers(tls_only, pki):
    with stub(tls_only, credentials(pki, client=None)) as s:
        assert s.Decide(decide_request(), timeout=TIMEOUT).policy_version


def test_a_server_certificate_from_an_unknown_ca_is_refused_by_the_client(tls_only, pki):
    with stub(tls_only, credentials(pki, ca=pki.other_ca, client=None)) as s:
        assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_for_another_name_is_refused_by_the_client(tls_only, pki):
    with stub(tls_only, credentials(pki, client=None, server_name="controller.example")) as s:
        assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAVAILABLE


def test_plaintext_to_a_tls_port_gets_nothing(tls_only):
    with stub(tls_only, None) as s:
        assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "client",
    [
        pytest.param(None, id="no-client-certificate"),
        pytest.param("other_client", id="client-certificate-from-an-unknown-ca"),
    ],
)
def test_mutual_tls_refuses_a_client_without_a_certificate_its_ca_signed(secured, pki, tokens, client):
    with stub(secured, credentials(pki, client=client, token=tokens.write)) as s:
        assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAVAILABLE


# --- tokens by role ------------------------------------------------------------------------------------------


def test_right_certificate_and_token_answer_every_rpc_of_their_role(secured, pki, tokens):
    with stub(secured, credentials(pki, token=tokens.read)) as s:
        assert s.Decide(decide_request(), timeout=TIMEOUT).policy_version
        s.ListSegments(pb.ListSegmentsRequest(), timeout=TIMEOUT)
        s.GetPolicy(pb.GetPolicyRequest(), timeout=TIMEOUT)
        s.GetCosts(pb.GetCostsRequest(), timeout=TIMEOUT)
    with stub(secured, credentials(pki, token=tokens.write)) as s:
        assert s.Decide(decide_request(), timeout=TIMEOUT).policy_version  # the write token reads too
        assert s.ReportRounds(report_request(), timeout=TIMEOUT).rounds_accepted == 4
        assert s.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=TIMEOUT).version


@pytest.mark.parametrize("token", [pytest.param(None, id="no-token"), pytest.param("wrong", id="wrong-token")])
def test_no_token_or_a_wrong_one_is_unauthenticated(secured, pki, tokens, token):
    with stub(secured, credentials(pki, token=getattr(tokens, token) if token else None)) as s:
        assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAUTHENTICATED
        assert refused_with(s.ReportRounds, report_request()) == grpc.StatusCode.UNAUTHENTICATED


def test_the_read_token_may_not_write(secured, pki, tokens):
    with stub(secured, credentials(pki, token=tokens.read)) as s:
        assert refused_with(s.ReportRounds, report_request()) == grpc.StatusCode.PERMISSION_DENIED
        assert refused_with(s.ReloadPolicy, pb.ReloadPolicyRequest()) == grpc.StatusCode.PERMISSION_DENIED


def test_health_checks_need_no_token(secured, pki):
    with controller_channel(secured.address, credentials(pki)) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_watch_decisions_stream_carries_the_token_and_a_wrong_one_is_refused(secured, pki, tokens):
    """The decision tables stream is a read RPC: the client's token interceptor covers streams too."""
    request = pb.WatchDecisionsRequest(worker_id="w", drafters=["draft"])
    with stub(secured, credentials(pki, token=tokens.read)) as s:
        assert next(s.WatchDecisions(request, timeout=TIMEOUT)).full
    for token in (tokens.wrong, None):
        with stub(secured, credentials(pki, token=token)) as s:
            with pytest.raises(grpc.RpcError) as refused:
                next(s.WatchDecisions(request, timeout=TIMEOUT))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_no_log_line_carries_a_token(tmp_path, embedded_redis_url, pki, tokens, caplog):
    """From start-up to a refusal (its own daemon: refusal lines are rate-limited per daemon)."""
    caplog.set_level(logging.INFO, logger="specd")
    auth = TokenAuth(read_token=Secret(file=tokens.read), write_token=Secret(file=tokens.write))
    with running(tmp_path, embedded_redis_url, auth=auth) as daemon:
        with stub(daemon, ControllerCredentials(token=Secret(file=tokens.wrong))) as s:
            assert refused_with(s.Decide, decide_request()) == grpc.StatusCode.UNAUTHENTICATED
        text = caplog.text + repr(daemon.config) + repr(Tokens.of(daemon.config.auth))
    assert "plaintext, read and write tokens" in caplog.text  # the start-up line says how the port is guarded
    assert "refused /specd.v1.Controller/Decide from ipv4:127.0.0.1" in caplog.text
    for which in ("read", "write", "wrong"):
        assert tokens.text(which) not in text


@pytest.mark.parametrize(
    ("method", "role"),
    [
        pytest.param(CONTROLLER + "Decide", "read", id="Decide"),
        pytest.param(CONTROLLER + "GetSegmentStats", "read", id="GetSegmentStats"),
        pytest.param(CONTROLLER + "ListSegments", "read", id="ListSegments"),
        pytest.param(CONTROLLER + "GetPolicy", "read", id="GetPolicy"),
        pytest.param(CONTROLLER + "GetCosts", "read", id="GetCosts"),
        pytest.param(CONTROLLER + "WatchDecisions", "read", id="WatchDecisions"),
        pytest.param(CONTROLLER + "ReportRounds", "write", id="ReportRounds-changes-learning"),
        pytest.param(CONTROLLER + "ReloadPolicy", "write", id="ReloadPolicy-changes-decisions"),
        pytest.param(CONTROLLER + "DeleteEverything", "write", id="unknown-method-fails-closed"),
        pytest.param("/grpc.health.v1.Health/Check", None, id="health-open-for-probes"),
        pytest.param("/grpc.health.v1.Health/Watch", None, id="health-watch-open"),
        pytest.param("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "read", id="reflection"),
    ],
)
def test_every_method_has_a_role(method, role):
    assert required_role(method) == role


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        pytest.param([], grpc.StatusCode.UNAUTHENTICATED, id="none"),
        pytest.param([("authorization", "Basic dXNlcjpwYXNz")], grpc.StatusCode.UNAUTHENTICATED, id="not-bearer"),
        pytest.param([("authorization", "Bearer ")], grpc.StatusCode.UNAUTHENTICATED, id="empty"),
        pytest.param(
            [("authorization", "Bearer " + "r" * 32), ("authorization", "Bearer " + "w" * 32)],
            grpc.StatusCode.UNAUTHENTICATED,
            id="two-headers-ambiguous",
        ),
        pytest.param([("authorization", "Bearer " + "r" * 32)], grpc.StatusCode.PERMISSION_DENIED, id="read"),
        pytest.param([("authorization", "bearer " + "w" * 32)], None, id="write-scheme-any-case"),
        pytest.param([("authorization", "Bearer " + "w" * 31)], grpc.StatusCode.UNAUTHENTICATED, id="a-prefix"),
    ],
)
def test_refusal_of_a_write_rpc_by_metadata(metadata, code):
    tokens = Tokens(write=b"w" * 32, read=b"r" * 32)
    why = refusal(tokens, CONTROLLER + "ReportRounds", metadata)
    assert (why[0] if why else None) == code


def test_refusals_are_logged_at_most_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="specd.controller.auth")
    now = [0.0]
    refusals = RefusalLog(every_s=10.0, clock=lambda: now[0])
    for _ in range(1000):  # a scan
        refusals.note("/m", "ipv4:10.0.0.9:5", grpc.StatusCode.UNAUTHENTICATED, "the token is not valid here")
    now[0] = 10.5
    refusals.note("/m", "ipv4:10.0.0.9:5", grpc.StatusCode.UNAUTHENTICATED, "the token is not valid here")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "999 more refused" in lines[1]


@pytest.mark.parametrize(
    ("listen", "tls", "token", "warns"),
    [
        pytest.param("127.0.0.1:50061", False, False, None, id="loopback-plaintext-is-the-default"),
        pytest.param("[::1]:50061", False, False, None, id="v6-loopback"),
        pytest.param("localhost:0", False, False, None, id="localhost"),
        pytest.param("unix:/run/specd.sock", False, False, None, id="unix-socket"),
        pytest.param("0.0.0.0:50061", False, False, "neither TLS nor tokens", id="open-to-the-network"),
        pytest.param("10.0.0.5:50061", False, True, "plaintext", id="tokens-in-the-clear"),
        pytest.param("controller.internal:50061", True, True, None, id="tls-and-tokens"),
    ],
)
def test_exposure_warnings(pki, tokens, listen, tls, token, warns):
    server_tls = ServerTls(cert_file=pki.server.cert, key_file=pki.server.key) if tls else None
    auth = TokenAuth(write_token=Secret(file=tokens.write)) if token else TokenAuth()
    warnings = exposure_warnings(listen, server_tls, auth)
    assert (warnings == []) if warns is None else (len(warnings) == 1 and warns in warnings[0])


# --- the client library: speaks it, and fails open when refused ----------------------------------------------


@dataclass(frozen=True)
class Round:
    drafter: str = "prompt_lookup"
    k: int = 2
    num_drafted: int = 2
    num_accepted: int = 1
    num_emitted: int = 2
    draft_seconds: float = 0.0
    verify_seconds: float = 0.01
    batch_size: int = 1


def client_for(daemon: ControllerDaemon, creds: ControllerCredentials) -> ControllerClient:
    config = ClientConfig(
        address=daemon.address, worker_id="auth-test", decide_deadline_ms=2000.0, default_drafter="none",
        report_interval_s=0.05, retry_backoff_s=(0.05, 0.1), credentials=creds,
    )  # fmt: skip
    return ControllerClient(config)


def decide(client: ControllerClient) -> Any:
    return client.decide(RequestFeatures(
        segment="auth-client", batch_size=1, drafters=["prompt_lookup"], temperature=0.0, top_p=1.0, top_k=0,
        prompt_tokens=10, max_new_tokens=10, self_repetition=0.0,
    ))  # fmt: skip


def report(client: ControllerClient) -> None:
    client.report(segment="auth-client", rounds=[Round()] * 3, temperature=0.0, prompt_tokens=10, self_repetition=0.0)


def test_the_client_decides_and_reports_with_the_right_credentials(secured, pki, tokens):
    with client_for(secured, credentials(pki, token=tokens.write)) as client:
        assert client.wait_until_ready(TIMEOUT)
        assert decide(client).origin.source == "controller"
        report(client)
        wait_until(lambda: client.stats().reports_sent == 1, what="report acknowledged")
        assert client.stats().aggregates_dropped == 0


def test_a_refused_client_decides_locally_and_says_so_once(secured, pki, tokens, caplog):
    caplog.set_level(logging.INFO, logger="specd.controller.client")
    with client_for(secured, credentials(pki, token=tokens.wrong)) as client:
        plans = [decide(client) for _ in range(20)]
        assert {(p.origin.source, p.origin.fallback) for p in plans} == {("local_default", "error")}
        assert client.stats().fallbacks == {"error": 20}
        refused = [r for r in caplog.records if "refused this worker's credentials for Decide" in r.getMessage()]
        assert len(refused) == 1 and refused[0].levelno == logging.ERROR
        assert "UNAUTHENTICATED" in refused[0].getMessage()
        assert tokens.text("wrong") not in caplog.text


def test_reports_refused_for_the_read_token_stay_buffered_and_are_logged_once(secured, pki, tokens, caplog):
    caplog.set_level(logging.INFO, logger="specd.controller.client")
    with client_for(secured, credentials(pki, token=tokens.read)) as client:
        assert decide(client).origin.source == "controller"  # the read token decides
        report(client)
        wait_until(lambda: client.stats().send_failures >= 3, what="three refused sends")
        stats = client.stats()
        assert stats.reports_sent == 0 and stats.aggregates_dropped == 0 and stats.buffered > 0
        refused = [r for r in caplog.records if "for ReportRounds" in r.getMessage()]
        assert len(refused) == 1 and "PERMISSION_DENIED" in refused[0].getMessage()


def test_a_refusal_after_an_outage_is_still_logged(tmp_path, embedded_redis_url, tokens, caplog):
    """The worker started first (the controller unreachable: a warning), then the controller refuses its token: the
    refusal is a new state and gets its own line."""
    caplog.set_level(logging.INFO, logger="specd.controller.client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    creds = ControllerCredentials(token=Secret(file=tokens.wrong))
    config = ClientConfig(address=f"127.0.0.1:{port}", worker_id="t", decide_deadline_ms=2000.0, credentials=creds)
    with ControllerClient(config) as client:
        assert decide(client).origin.fallback == "unavailable"
        auth = TokenAuth(write_token=Secret(file=tokens.write))
        with running(tmp_path, embedded_redis_url, listen=f"127.0.0.1:{port}", auth=auth):
            assert client.wait_until_ready(TIMEOUT)
            assert decide(client).origin.fallback == "error"
    lines = [r.getMessage() for r in caplog.records if "controller at" in r.getMessage()]
    assert len(lines) == 2 and "did not answer" in lines[0] and "refused this worker's credentials" in lines[1], lines


def test_a_client_that_does_not_trust_the_server_falls_back(tls_only, pki):
    with client_for(tls_only, credentials(pki, ca=pki.other_ca, client=None)) as client:
        plan = decide(client)
    assert plan.origin.source == "local_default" and plan.origin.fallback == "unavailable"


# --- the CLI -------------------------------------------------------------------------------------------------


def cli(capsys: Any, *args: str) -> tuple[int, str, str]:
    status = specd_main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def cli_tls(daemon: ControllerDaemon, pki: Pki) -> list[str]:
    return ["--address", daemon.address, "--ca-file", str(pki.ca), "--cert-file", str(pki.client.cert),
            "--key-file", str(pki.client.key)]  # fmt: skip


def test_cli_reads_with_the_read_token_and_cannot_reload(secured, pki, tokens, capsys):
    status, out, err = cli(capsys, "segments", *cli_tls(secured, pki), "--token-file", str(tokens.read))
    assert status == 0 and out.startswith("segment"), err
    status, _, err = cli(capsys, "policy", "reload", *cli_tls(secured, pki), "--token-file", str(tokens.read))
    assert status == 2 and "needs the write token" in err


def test_cli_takes_credentials_from_the_environment(secured, pki, tokens, capsys, monkeypatch):
    monkeypatch.setenv("SPECD_CONTROLLER", secured.address)
    monkeypatch.setenv("SPECD_CONTROLLER_CA", str(pki.ca))
    monkeypatch.setenv("SPECD_CONTROLLER_CERT", str(pki.client.cert))
    monkeypatch.setenv("SPECD_CONTROLLER_KEY", str(pki.client.key))
    monkeypatch.setenv("SPECD_CONTROLLER_TOKEN", tokens.text("write"))
    status, out, err = cli(capsys, "policy", "reload")
    assert status == 0 and "policy reloaded" in out, err


def test_cli_without_a_token_is_told_what_is_missing(secured, pki, capsys, monkeypatch):
    monkeypatch.delenv("SPECD_CONTROLLER_TOKEN", raising=False)
    status, _, err = cli(capsys, "alpha", *cli_tls(secured, pki))
    assert status == 2 and "UNAUTHENTICATED" not in err and "a token is needed" in err and "--token-file" in err


def test_cli_without_a_client_certificate_is_told_to_give_one(secured, pki, tokens, capsys):
    args = ("--address", secured.address, "--ca-file", str(pki.ca), "--token-file", str(tokens.read))
    status, _, err = cli(capsys, "segments", *args)
    assert status == 2 and "client certificates" in err and "--cert-file" in err


def test_cli_with_an_untrusted_server_names_the_tls_handshake(tls_only, pki, capsys):
    status, _, err = cli(capsys, "costs", "--address", tls_only.address, "--ca-file", str(pki.other_ca))
    assert status == 2 and "TLS handshake" in err


def test_cli_with_a_missing_file_names_the_flag_and_the_file(pki, tmp_path, capsys):
    missing = tmp_path / "nope.crt"
    status, _, err = cli(capsys, "segments", "--address", "127.0.0.1:1", "--ca-file", str(missing))
    assert status == 2 and f"--ca-file: {missing}: no such file" in err


# --- settings refused at load time ---------------------------------------------------------------------------


def write_config(folder: Path, body: str) -> Path:
    path = folder / "controller.yaml"
    path.write_text("listen: 127.0.0.1:0\n" + body)
    return path


def load_issue(path: Path) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    return str(raised.value)


def test_relative_certificate_and_token_paths_are_taken_from_the_config_folder(tmp_path, pki, tokens, monkeypatch):
    folder = tmp_path / "etc"
    folder.mkdir()
    for source, name in ((pki.server.cert, "server.crt"), (pki.server.key, "server.key"), (pki.ca, "ca.crt"),
                         (tokens.write, "write.token")):  # fmt: skip
        (folder / name).write_bytes(source.read_bytes())
    path = write_config(folder, "tls:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: ca.crt\n"
                                "auth:\n  write_token: {file: write.token}\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    assert config.tls is not None and config.tls.cert_file == folder / "server.crt" and config.tls.mutual
    assert config.auth.write_token is not None and config.auth.write_token.reveal() == tokens.text("write")


def load_issue_within(path: Path, seconds: float, unblock: Path) -> str:
    """``load_issue(path)``, failing the test if it takes longer than ``seconds`` (a reader blocked on the FIFO
    ``unblock`` is then let go, by opening its other end, so the test ends)."""
    answer: list[str] = []
    loading = threading.Thread(target=lambda: answer.append(load_issue(path)), daemon=True)
    loading.start()
    loading.join(seconds)
    if loading.is_alive():
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        loading.join(seconds)
        pytest.fail(f"loading {path} waited on a file for more than {seconds} s")
    return answer[0]


@pytest.mark.parametrize(
    ("body", "line", "field", "reason"),
    [
        pytest.param(
            "tls:\n  cert_file: missing.crt\n  key_file: KEY\n",
            3,
            "tls.cert_file",
            "missing.crt: no such",
            id="missing-cert",
        ),
        pytest.param(
            "tls:\n  cert_file: KEY\n  key_file: KEY\n",
            3,
            "tls.cert_file",
            "not a PEM certificate",
            id="key-given-as-cert",
        ),
        pytest.param(
            "tls:\n  cert_file: CERT\n  key_file: CERT\n",
            4,
            "tls.key_file",
            "not a PEM private key",
            id="cert-given-as-key",
        ),
        pytest.param("tls:\n  cert_file: CERT\n", 3, "tls.key_file", "Field required", id="no-key"),
        pytest.param(
            "tls:\n  cert_file: CERT\n  key_file: CLIENT_KEY\n",
            2,
            "tls",
            "is not the private key of",
            id="key-of-another-certificate",
        ),
        pytest.param(
            "tls:\n  cert_file: CERT\n  key_file: ENCRYPTED\n", 2, "tls", "the key is encrypted", id="encrypted-key"
        ),
        pytest.param("auth:\n  write_token: WRITE\n", 3, "auth.write_token", "dictionary", id="inline-token"),
        pytest.param("auth:\n  read_token: {file: READ}\n", 2, "auth", "needs a write_token", id="read-without-write"),
        pytest.param(
            "auth:\n  read_token: {file: READ}\n  write_token: {file: READ}\n",
            2,
            "auth",
            "same token",
            id="one-token-for-both-roles",
        ),
        pytest.param("auth:\n  write_token: {file: SHORT}\n", 3, "auth.write_token", "fewer than 16", id="short-token"),
        pytest.param("auth:\n  write_token: {file: TWO}\n", 3, "auth.write_token", "holds 2 lines", id="two-lines"),
        pytest.param(
            "auth:\n  write_token: {env: SPECD_TEST_UNSET}\n", 3, "auth.write_token", "is not set", id="unset-env"
        ),
        pytest.param("auth:\n  write_token: {}\n", 3, "auth.write_token", "exactly one of file", id="no-source"),
        # a FIFO where a file belongs must not block the start for good, before the process listens
        pytest.param(
            "auth:\n  write_token: {file: fifo}\n",
            3,
            "auth.write_token",
            "not a regular file",
            id="token-file-is-a-fifo",
        ),
        pytest.param(
            "tls:\n  cert_file: fifo\n  key_file: KEY\n",
            3,
            "tls.cert_file",
            "not a regular file",
            id="cert-file-is-a-fifo",
        ),
        pytest.param(
            "tls:\n  cert_file: CERT\n  key_file: fifo\n",
            4,
            "tls.key_file",
            "not a regular file",
            id="key-file-is-a-fifo",
        ),
        pytest.param(
            "tls:\n  cert_file: CERT\n  key_file: KEY\n  client_ca_file: fifo\n",
            5,
            "tls.client_ca_file",
            "not a regular file",
            id="client-ca-is-a-fifo",
        ),
        pytest.param(
            "tls:\n  cert_file: .\n  key_file: KEY\n", 3, "tls.cert_file", "is a folder", id="cert-is-a-folder"
        ),
    ],
)
def test_bad_security_settings_name_file_line_field_and_reason(tmp_path, pki, tokens, body, line, field, reason):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "short.token").write_text("abc\n")
    (tmp_path / "two.token").write_text(secrets.token_hex(16) + "\n" + secrets.token_hex(16) + "\n")
    if "ENCRYPTED" in body:
        encrypted_copy(pki.server.key, tmp_path / "encrypted.key")
    body = (body.replace("CLIENT_KEY", str(pki.client.key)).replace("ENCRYPTED", "encrypted.key")
            .replace("CERT", str(pki.server.cert)).replace("KEY", str(pki.server.key))
            .replace("READ", str(tokens.read)).replace("WRITE", tokens.text("write"))
            .replace("SHORT", "short.token").replace("TWO", "two.token"))  # fmt: skip
    path = write_config(tmp_path, body)
    issue = load_issue_within(path, 5.0, unblock=tmp_path / "fifo")
    assert issue.startswith(f"{path}:{line}: {field}: "), issue
    assert reason in issue
    for secret in (tokens.text("read"), tokens.text("write")):
        assert secret not in issue


def test_a_token_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_TEST_WRITE_TOKEN", "t" * 40)
    config = load_config(write_config(tmp_path, "auth:\n  write_token: {env: SPECD_TEST_WRITE_TOKEN}\n"))
    assert config.auth.write_token is not None and config.auth.write_token.reveal() == "t" * 40
    assert "t" * 40 not in repr(config) and "t" * 40 not in str(config.model_dump())


def test_the_shipped_config_stays_plaintext_on_loopback():
    config = load_config(REPO / "configs" / "controller.yaml")
    assert config.tls is None and config.auth == TokenAuth()
    assert exposure_warnings(config.listen, config.tls, config.auth) == []


def test_the_commented_security_example_in_the_shipped_config_is_valid(tmp_path, pki, tokens):
    keys = ("tls", "cert_file", "key_file", "client_ca_file", "auth", "read_token", "write_token")
    text = uncomment((REPO / "configs" / "controller.yaml").read_text(), keys)
    for example, real in (("/etc/specd/tls/controller.crt", pki.server.cert), ("/etc/specd/tls/controller.key",
                          pki.server.key), ("/etc/specd/tls/ca.crt", pki.ca), ("/etc/specd/tokens/read", tokens.read),
                          ("/etc/specd/tokens/write", tokens.write)):  # fmt: skip
        assert example in text
        text = text.replace(example, str(real))
    (tmp_path / "controller.yaml").write_text(text)
    config = load_config(tmp_path / "controller.yaml")
    assert config.tls is not None and config.tls.mutual
    assert config.auth.read_token is not None and config.auth.write_token is not None


def security_examples(text: str, marker: str) -> list[str]:
    """The ```yaml blocks of ``text`` that hold ``marker``."""
    return [block for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if marker in block]


def test_the_controller_example_in_ops_readme_is_valid(pki, tokens):
    [block] = security_examples((REPO / "ops" / "README.md").read_text(), "client_ca_file:")
    for example, real in (("/etc/specd/tls/controller.crt", pki.server.cert), ("/etc/specd/tls/controller.key",
                          pki.server.key), ("/etc/specd/tls/ca.crt", pki.ca), ("/etc/specd/tokens/read", tokens.read),
                          ("/etc/specd/tokens/write", tokens.write)):  # fmt: skip
        block = block.replace(example, str(real))
    config = parse_yaml_model(block, ControllerConfig, "ops/README.md")
    assert config.tls is not None and config.tls.mutual and config.auth.read_token is not None
    assert exposure_warnings(config.listen, config.tls, config.auth) == []  # 0.0.0.0, but locked down
