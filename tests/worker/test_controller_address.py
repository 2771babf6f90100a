"""The worker's `controller.address`: one controller, or several replicas (round_robin); a bad list is refused when
the file is loaded, with file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoder.worker.config import load_worker_config
from specd_api.yaml_config import ConfigError


def worker_yaml(folder: Path, controller: str) -> Path:
    path = folder / "worker.yaml"
    path.write_text(f"listen: 127.0.0.1:0\ncontroller:\n{controller}")
    return path


@pytest.mark.parametrize("address", ["127.0.0.1:50061", "controller.internal:50061", "10.0.0.1:50061,10.0.0.2:50061"])
def test_one_address_or_several_replicas(tmp_path, address):
    config = load_worker_config(worker_yaml(tmp_path, f"  address: '{address}'\n"))
    assert config.controller.address == address


@pytest.mark.parametrize(
    ("controller", "field", "reason"),
    [
        pytest.param("  address: 10.0.0.1:50061,\n", "controller.address", "entry 2 is empty", id="stray-comma"),
        pytest.param(
            "  address: a.internal:1,b.internal:1\n", "controller.address", "not an IP address", id="names-in-list"
        ),
        # certificates are checked against one name: an IP list gives none
        pytest.param(
            "  address: 10.0.0.1:1,10.0.0.2:1\n  tls: {}\n", "controller", "set tls.server_name", id="tls-no-name"
        ),
    ],
)
def test_a_bad_address_is_refused_with_file_line_and_field(tmp_path, controller, field, reason):
    path = worker_yaml(tmp_path, controller)
    with pytest.raises(ConfigError) as raised:
        load_worker_config(path)
    issue = str(raised.value)
    assert issue.startswith(f"{path}:") and f": {field}: " in issue and reason in issue, issue
