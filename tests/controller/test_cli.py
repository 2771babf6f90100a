"""`specd alpha`, `specd segments` and `specd policy` against a running controller, through subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import running_daemon

REPO = Path(__file__).resolve().parents[2]


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, embedded_redis_url):
    """A daemon (tests/daemons.py) that refreshes only when told, holding one report of segment "code"."""
    tmp = tmp_path_factory.mktemp("cli")
    with running_daemon(embedded_redis_url, tmp, learning={"refresh_seconds": 3600}) as d:
        stub = pb_grpc.ControllerStub(grpc.insecure_channel(d.address))
        agg = pb.RoundsAggregate(
            segment="code", drafter="draft", k=2, rounds=10, num_drafted=20, num_accepted=15,
            proposed_per_position=[10, 10], verified_per_position=[10, 8], accepted_per_position=[8, 7],
            tokens_emitted=25, draft_seconds=0.02, verify_seconds=0.1, batch_size=1,
            rounds_by_drafted=[0, 0, 10], verify_seconds_by_drafted=[0.0, 0.0, 0.1],
        )  # fmt: skip
        stub.ReportRounds(pb.ReportRoundsRequest(report_id="cli-1", aggregates=[agg]))
        assert d.controller is not None and d.controller.learner.refresh()
        yield d


def test_alpha_json_reports_the_learned_rate(daemon):
    done = specd("alpha", "code", "--json", "--address", daemon.address)
    assert done.returncode == 0, done.stderr
    [segment] = json.loads(done.stdout)
    assert segment["segment"] == "code"
    assert segment["alpha"] == pytest.approx(15 / 20)
    assert segment["alpha_by_drafter"] == {"draft": pytest.approx(0.75)}
    assert segment["decision"]["policy_version"]


def test_alpha_table_and_segments_list(daemon):
    table = specd("alpha", "--address", daemon.address)
    assert table.returncode == 0 and "code" in table.stdout and "0.75" in table.stdout
    listing = specd("segments", "--address", daemon.address)
    assert listing.returncode == 0 and "code" in listing.stdout


def test_policy_show_and_reload(daemon):
    version = daemon.controller.policies.current.version
    shown = specd("policy", "show", "--address", daemon.address)
    assert shown.returncode == 0 and f"# version {version}" in shown.stdout
    reloaded = specd("policy", "reload", "--address", daemon.address)
    assert reloaded.returncode == 0 and version in reloaded.stdout


def test_policy_check(tmp_path):
    good = specd("policy", "check", str(REPO / "policies" / "default.yaml"))
    assert good.returncode == 0 and "ok" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  exploration_rate: 2\nsegments:\n  - match: a\n    colour: red\n")
    done = specd("policy", "check", str(bad))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"{bad}:2: defaults.exploration_rate: Input should be less than or equal to 0.5",
        f"{bad}:5: segments[0].colour: Extra inputs are not permitted",
    ]


def test_unreachable_controller_is_one_line(tmp_path):
    done = specd("alpha", "--address", "127.0.0.1:1")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "no controller answers at 127.0.0.1:1" in done.stderr
