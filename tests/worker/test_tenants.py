"""Segments bound to credentials, over a real `specd worker` process: a tenant's key names only the segments its
globs allow (else 403 naming the field, body or header), its requests that name none are learned under its own
prefix, and the operator's key names any segment. So no tenant's traffic reaches another's segments. Bad tenant
settings are refused naming file, line and field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder.worker.config import load_worker_config
from decoder.worker.segments import CLASSIFIER_SEGMENTS
from specd_api.yaml_config import ConfigError
from tests.worker.conftest import Worker
from tests.worker.test_auth import worker_yaml as auth_worker_yaml

KEYS = {"operator": "sk-" + "o" * 40, "tenant-a": "sk-" + "a" * 40, "tenant-b": "sk-" + "b" * 40}


@pytest.fixture(scope="module")
def tenants(launcher, tmp_path_factory) -> Worker:
    folder = tmp_path_factory.mktemp("tenant-keys")
    files = {}
    for name, key in KEYS.items():
        files[name] = folder / f"{name}.key"
        files[name].write_text(key + "\n")
    auth = {
        "api_key": {"file": str(files["operator"])},
        "tenants": [
            {"name": "tenant-a", "key": {"file": str(files["tenant-a"])}, "segments": ["tenant-a*"]},
            {"name": "tenant-b", "key": {"file": str(files["tenant-b"])}, "segments": ["tenant-b*", "shared-?"]},
        ],
    }
    return launcher.start("tenants", draft=None, auth=auth)


def post(worker: Worker, key: str | None, body: dict[str, Any], **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {KEYS[key]}"
    payload = {"prompt": "def add(a, b):\n    return a + b\n", "max_tokens": 3, "temperature": 0, **body}
    return httpx.post(f"{worker.url}/v1/completions", json=payload, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("key", "segment", "header"),
    [
        ("tenant-a", "tenant-b-1", False),
        ("tenant-a", "tenant-b-1", True),
        ("tenant-b", "tenant-a", False),
        ("tenant-b", "shared-10", False),  # "shared-?" is one character
        ("tenant-a", "default", True),
    ],
)
def test_a_tenants_key_naming_a_segment_outside_its_globs_is_refused(tenants, key, segment, header) -> None:
    response = post(tenants, key, {} if header else {"segment": segment}, **({"x-specd-segment": segment}
                                                                            if header else {}))  # fmt: skip
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["param"] == "segment" and error["type"] == "permission_error"
    assert f"auth.tenants[{key}].segments" in error["message"]


@pytest.mark.parametrize(
    ("key", "segment"),
    [("tenant-a", "tenant-a"), ("tenant-a", "tenant-a-eval"), ("tenant-b", "shared-1"), ("operator", "tenant-a-eval"),
     ("operator", "anything")],
)  # fmt: skip
def test_a_key_names_the_segments_it_may(tenants, key, segment) -> None:
    response = post(tenants, key, {"segment": segment})
    assert response.status_code == 200, response.text
    assert response.json()["specd"]["segment"] == segment


def test_a_tenants_unnamed_requests_are_learned_under_its_own_prefix(tenants) -> None:
    for key in ("tenant-a", "tenant-b"):
        served = post(tenants, key, {}).json()["specd"]["segment"]
        prefix, _, inferred = served.partition("/")
        assert prefix == key and inferred in CLASSIFIER_SEGMENTS, served
    operator = post(tenants, "operator", {}).json()["specd"]["segment"]
    assert operator in CLASSIFIER_SEGMENTS  # the operator's key, as without keys: the shared inferred segments


def test_without_a_key_nothing_is_served(tenants) -> None:
    assert post(tenants, None, {"segment": "tenant-a"}).status_code == 401
    wrong = httpx.post(f"{tenants.url}/v1/completions", json={"prompt": "x"},
                       headers={"authorization": "Bearer sk-" + "c" * 40}, timeout=60)  # fmt: skip
    assert wrong.status_code == 401


def worker_yaml(folder: Path, body: str) -> Path:
    for name, key in KEYS.items():
        (folder / f"{name}.key").write_text(key + "\n")
    return auth_worker_yaml(folder, body)


@pytest.mark.parametrize(
    ("body", "line", "field", "reason"),
    [
        pytest.param(
            "auth:\n  tenants:\n    - {name: a, key: {file: tenant-a.key}, segments: []}\n",
            4,
            "auth.tenants[0].segments",
            "at least 1",
            id="no-globs",
        ),
        pytest.param(
            "auth:\n  tenants:\n    - {name: 'a b', key: {file: tenant-a.key}, segments: [a*]}\n",
            4,
            "auth.tenants[0].name",
            "should match",
            id="bad-name",
        ),
        pytest.param(
            "auth:\n  tenants:\n    - {name: a, key: {file: tenant-a.key}, segments: [a*]}\n"
            "    - {name: a, key: {file: tenant-b.key}, segments: [b*]}\n",
            2,
            "auth",
            "given twice",
            id="name-twice",
        ),
        pytest.param(
            "auth:\n  api_key: {file: tenant-a.key}\n  tenants:\n    - {name: a, key: {file: tenant-a.key}, "
            "segments: [a*]}\n",
            2,
            "auth",
            "same key",
            id="key-twice",
        ),
        pytest.param(
            "default_segment: "
            + "d" * 100
            + "\nauth:\n  tenants:\n    - {name: "
            + "t" * 40
            + ", key: {file: tenant-a.key}, segments: [a*]}\n",
            None,
            "",
            "128 characters",
            id="inferred-too-long",
        ),
    ],
)
def test_bad_tenant_settings_name_file_line_field_and_reason(tmp_path, body, line, field, reason) -> None:
    path = worker_yaml(tmp_path, body)
    with pytest.raises(ConfigError) as raised:
        load_worker_config(path)
    issue = str(raised.value)
    if line is not None:
        assert issue.startswith(f"{path}:{line}: {field}: "), issue
    assert reason in issue and str(path) in issue, issue


def test_the_tenants_example_in_ops_readme_is_valid(tmp_path, monkeypatch) -> None:
    text = (Path(__file__).resolve().parents[2] / "ops" / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if "tenants:" in b]
    assert len(blocks) == 1
    block = blocks[0]
    for name in ("worker-api", "tenant-a"):
        (tmp_path / f"{name}.key").write_text(KEYS["operator" if name == "worker-api" else name] + "\n")
        block = block.replace(f"/etc/specd/{name}.key", str(tmp_path / f"{name}.key"))
    monkeypatch.setenv("SPECD_TENANT_B_KEY", KEYS["tenant-b"])
    path = tmp_path / "worker.yaml"
    path.write_text(block)
    auth = load_worker_config(path).auth
    assert [t.name for t in auth.tenants] == ["tenant-a", "tenant-b"]
    assert auth.tenants[0].allows("tenant-a-eval") and not auth.tenants[0].allows("tenant-b")
    assert [t.name if t else None for t in auth.credentials().values()] == ["tenant-a", "tenant-b", None]
