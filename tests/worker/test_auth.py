"""The worker locked down: its HTTP API behind an OpenAI-style API key (``Authorization: Bearer``), and its link to a
controller that asks for mutual TLS and a token.

The key check is tested three ways: as middleware in a small app (every route and header form, fast), in a real
`specd worker` process (the official openai client, /health and /metrics as configured, a large body refused before it
is read), and through the settings a user writes (bad ones refused with file, line and field). The controller link
runs the real WorkerService against a real daemon with certificates openssl made for the test."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from controller.config import TokenAuth
from controller.server import ControllerDaemon
from decoder.worker.auth import MISSING_KEY, WRONG_KEY, ApiKeyCheck
from decoder.worker.config import WorkerConfig, load_worker_config
from specd_api.security import Secret, ServerTls
from specd_api.yaml_config import CONFIG_DIR, ConfigError, parse_yaml_model
from tests.daemons import running_daemon
from tests.tls_certs import Pki, make_pki, uncomment
from tests.worker.conftest import MODEL, Worker, done_info, in_process, service_config

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-" + "k" * 40


# --- the middleware, route by route ---------------------------------------------------------------------------


def small_app(open_paths: tuple[str, ...]) -> TestClient:
    async def ok(request: Any) -> PlainTextResponse:
        await request.body()
        return PlainTextResponse("ok")

    routes = [Route(path, ok, methods=["GET", "POST"]) for path in ("/health", "/metrics", "/v1/models",
                                                                     "/v1/completions")]  # fmt: skip
    app = Starlette(routes=routes)
    app.add_middleware(ApiKeyCheck, keys={KEY: None}, open_paths=open_paths)
    return TestClient(app)


@pytest.mark.parametrize(
    ("header", "status", "code"),
    [
        pytest.param(None, 401, None, id="no-header"),
        pytest.param(f"Bearer {KEY}", 200, None, id="the-key"),
        pytest.param(f"bearer  {KEY} ", 200, None, id="scheme-in-any-case-and-spaces"),
        pytest.param(f"Basic {KEY}", 401, None, id="not-bearer"),
        pytest.param("Bearer ", 401, None, id="empty"),
        pytest.param("Bearer sk-wrong", 401, "invalid_api_key", id="wrong-key"),
        pytest.param(f"Bearer {KEY[:-1]}", 401, "invalid_api_key", id="a-prefix-of-the-key"),
        pytest.param(f"Bearer {KEY}x", 401, "invalid_api_key", id="the-key-and-more"),
        pytest.param("Bearer sk-\u00e9t\u00e9", 401, "invalid_api_key", id="non-ascii"),
    ],
)
def test_the_key_opens_a_protected_route_and_nothing_else_does(header, status, code):
    client = small_app(open_paths=())
    headers = {"Authorization": header.encode("utf-8")} if header is not None else {}
    response = client.post("/v1/completions", headers=headers, content=b"{}")
    assert response.status_code == status
    if status == 401:
        error = response.json()["error"]
        assert error == {"message": MISSING_KEY if code is None else WRONG_KEY, "type": "invalid_request_error",
                         "param": None, "code": code}  # fmt: skip
        assert response.headers["www-authenticate"] == "Bearer"
        assert "wrong" not in response.text and KEY not in response.text  # no key, right or wrong, comes back


@pytest.mark.parametrize(
    ("open_paths", "path", "status"),
    [
        pytest.param(("/health",), "/health", 200, id="health-open"),
        pytest.param(("/health",), "/metrics", 401, id="metrics-protected"),
        pytest.param(("/metrics",), "/health", 401, id="health-protected"),
        pytest.param(("/metrics",), "/metrics", 200, id="metrics-open"),
        pytest.param(("/health", "/metrics"), "/v1/models", 401, id="models-always-protected"),
        pytest.param(("/health",), "/health/../v1/models", 401, id="no-path-tricks"),
        pytest.param(("/health",), "/nowhere", 401, id="unknown-paths-too"),
    ],
)
def test_health_and_metrics_are_open_or_protected_as_configured(open_paths, path, status):
    assert small_app(open_paths).get(path).status_code == status


# --- a real worker --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def key_worker(launcher, tmp_path_factory) -> Worker:
    """A worker with an API key from a file; /health open, /metrics protected (the defaults)."""
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    return launcher.start("api-key", auth={"api_key": {"file": str(key_file)}})


def test_a_worker_with_a_key_serves_the_openai_client_that_has_it(key_worker):
    client = openai.OpenAI(base_url=f"{key_worker.url}/v1", api_key=KEY, max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_worker_with_a_key_refuses_the_client_that_has_another(key_worker):
    client = openai.OpenAI(base_url=f"{key_worker.url}/v1", api_key="sk-not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"


def test_a_worker_with_a_key_leaves_health_open_and_protects_metrics(key_worker):
    with key_worker.client() as client:
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_large_body_without_the_key_is_refused_before_it_is_read(key_worker):
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'  # twice the body limit: 413 if it were read
    with key_worker.client() as client:
        response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 401


# --- settings -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def worker_yaml(folder: Path, body: str) -> Path:
    path = folder / "worker.yaml"
    path.write_text("listen: 127.0.0.1:0\n" + body)
    return path


@pytest.mark.parametrize(
    ("body", "line", "field", "reason"),
    [
        pytest.param(
            "auth:\n  api_key: {file: missing.key}\n",
            3,
            "auth.api_key",
            "missing.key: no such file",
            id="missing-key-file",
        ),
        pytest.param("auth:\n  api_key: sk-inline\n", 3, "auth.api_key", "dictionary", id="inline-key"),
        pytest.param("auth:\n  metrics: public\n", 3, "auth.metrics", "'open' or 'protected'", id="bad-access"),
        pytest.param(
            "controller:\n  tls: {ca_file: ca-missing.crt}\n",
            3,
            "controller.tls.ca_file",
            "no such file",
            id="missing-ca",
        ),
        pytest.param(
            "controller:\n  tls: {cert_file: CLIENT_CERT}\n",
            3,
            "controller.tls",
            "go together",
            id="client-cert-without-key",
        ),
        pytest.param(
            "controller:\n  token: {env: SPECD_TEST_UNSET}\n",
            3,
            "controller.token",
            "is not set",
            id="unset-token-variable",
        ),
    ],
)
def test_bad_worker_security_settings_name_file_line_field_and_reason(tmp_path, pki, body, line, field, reason):
    path = worker_yaml(tmp_path, body.replace("CLIENT_CERT", str(pki.client.cert)))
    with pytest.raises(ConfigError) as raised:
        load_worker_config(path)
    issue = str(raised.value)
    assert issue.startswith(f"{path}:{line}: {field}: ") and reason in issue, issue


def test_the_shipped_worker_config_has_no_key_and_a_plaintext_controller_link():
    config = load_worker_config(REPO / "configs" / "worker.yaml")
    assert config.auth.api_key is None and config.controller.credentials() is None


def test_the_commented_security_examples_in_the_shipped_config_are_valid(tmp_path, pki):
    keys = ("tls", "ca_file", "cert_file", "key_file", "token", "auth", "api_key", "health", "metrics")
    text = uncomment((REPO / "configs" / "worker.yaml").read_text(), keys)
    (tmp_path / "write.token").write_text(secrets.token_hex(16))
    (tmp_path / "api.key").write_text(KEY)
    for example, real in (("/etc/specd/tls/ca.crt", pki.ca), ("/etc/specd/tls/worker.crt", pki.client.cert),
                          ("/etc/specd/tls/worker.key", pki.client.key), ("/etc/specd/tokens/write", "write.token"),
                          ("/etc/specd/worker-api.key", "api.key")):  # fmt: skip
        assert example in text
        text = text.replace(example, str(real))
    (tmp_path / "worker.yaml").write_text(text)
    config = load_worker_config(tmp_path / "worker.yaml")
    credentials = config.controller.credentials()
    assert credentials is not None and credentials.describe().startswith("mutual TLS, token from file")
    assert config.auth.api_key is not None and config.auth.api_key.reveal() == KEY
    assert (config.auth.health, config.auth.metrics) == ("open", "protected")


def test_the_worker_examples_in_ops_readme_are_valid(tmp_path, pki):
    text = (REPO / "ops" / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
              if ("api_key:" in b and "tenants:" not in b) or ("token: {" in b and "controller:" in b)]  # fmt: skip
    assert len(blocks) == 2  # the controller link, the API key
    (tmp_path / "write.token").write_text(secrets.token_hex(16))
    (tmp_path / "api.key").write_text(KEY)
    for block in blocks:
        for example, real in (("/etc/specd/tls/ca.crt", pki.ca), ("/etc/specd/tls/worker.crt", pki.client.cert),
                              ("/etc/specd/tls/worker.key", pki.client.key), ("/etc/specd/tokens/write", "write.token"),
                              ("/etc/specd/worker-api.key", "api.key")):  # fmt: skip
            block = block.replace(example, str(real))
        config = parse_yaml_model(block, WorkerConfig, "ops/README.md", context={CONFIG_DIR: tmp_path})
        assert config.controller.credentials() is not None or config.auth.api_key is not None


# --- the worker's controller link: mutual TLS and a token -------------------------------------------------------


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tokens")
    paths = {name: folder / f"{name}.token" for name in ("read", "write", "wrong")}
    for path in paths.values():
        path.write_text(secrets.token_hex(16))
    return paths


@pytest.fixture(scope="module")
def secured(tmp_path_factory, embedded_redis_url, pki, tokens) -> Iterator[ControllerDaemon]:
    """A daemon (tests/daemons.py) with an empty policy, mutual TLS and two tokens."""
    tls = ServerTls(cert_file=pki.server.cert, key_file=pki.server.key, client_ca_file=pki.ca)
    auth = TokenAuth(read_token=Secret(file=tokens["read"]), write_token=Secret(file=tokens["write"]))
    with running_daemon(embedded_redis_url, tmp_path_factory.mktemp("secured"), "{}\n", tls=tls, auth=auth) as daemon:
        yield daemon


def decision_source(tiny_pair, daemon: ControllerDaemon, pki: Pki, token: Path) -> str:
    """One request through a WorkerService linked to ``daemon`` with the client certificate and ``token``."""
    link = {
        "address": daemon.address, "decide_deadline_ms": 2000,
        "tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client.cert), "key_file": str(pki.client.key)},
        "token": {"file": str(token)},
    }  # fmt: skip
    with in_process(service_config(tiny_pair, draft=tiny_pair.draft, controller=link)) as service:
        assert service.client is not None and service.client.wait_until_ready(10.0)
        return str(done_info(service, "auth", max_new_tokens=4)["decision_source"])


def test_the_worker_links_to_a_controller_with_mutual_tls_and_its_token(tiny_pair, secured, pki, tokens):
    assert decision_source(tiny_pair, secured, pki, tokens["write"]) == "controller"


def test_a_worker_with_a_wrong_token_still_serves_and_says_why_once(tiny_pair, secured, pki, tokens, caplog):
    caplog.set_level(logging.INFO, logger="specd.controller.client")
    assert decision_source(tiny_pair, secured, pki, tokens["wrong"]) == "local_default"
    refused = [r.getMessage() for r in caplog.records if "refused this worker's credentials" in r.getMessage()]
    assert [line.split(" (")[0].rpartition(" ")[2] for line in refused] == ["Decide", "ReportRounds"], refused
    assert all("UNAUTHENTICATED" in line for line in refused)
    assert tokens["wrong"].read_text() not in caplog.text


def test_health_stays_reachable_for_probes_without_a_key(key_worker):
    assert httpx.get(f"{key_worker.url}/health", timeout=10).json()["status"] == "ok"
