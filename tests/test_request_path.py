"""The request path, measured (benchmarks/request_path.py): what one request crosses from HTTP to Redis and back stays
within the bounds docs/ARCHITECTURE.md states, and the measurement sees both ends of the path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOUNDS = re.compile(r"at most \*\*(\d+) files\*\* and \*\*(\d+) data types\*\*")


def test_one_request_crosses_no_more_files_and_data_types_than_the_architecture_says(embedded_redis_url, tmp_path):
    found = BOUNDS.search((REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert found, "docs/ARCHITECTURE.md states the request path's bounds"
    max_files, max_data_types = int(found[1]), int(found[2])
    out = tmp_path / "path.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "request_path.py"), "--redis-url", embedded_redis_url,
         "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    path = json.loads(out.read_text())
    ends = {"decoder/worker/app.py", "specd_client/client.py", "controller/service.py", "controller/storage/store.py",
            "specd_api/request_features.py", "decoder/batch_engine.py"}  # fmt: skip
    assert ends <= set(path["file_list"]), "the recorder saw the whole path"
    assert "specd_api.plan.Plan" in path["data_type_list"]
    assert path["files"] <= max_files, f"{path['files']} files: {path['file_list']}"
    assert path["data_types"] <= max_data_types, f"{path['data_types']} data types: {path['data_type_list']}"
