"""`pip install specd` (no extra) is the controller: build the wheel from this tree, install it into a fresh venv
with no torch, start `specd controller` from a copy of configs/controller.yaml and answer Decide over gRPC.

Dependencies come from the package index pip is configured with (pip.conf, PIP_* variables; on the CI machines a
local mirror, so this is quick), never from this checkout: the venv runs in a folder with no project code on its
path."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.waiting import free_port

REPO = Path(__file__).resolve().parent.parent
# pyproject's packages.find
PACKAGES = ("specd", "specd_api", "specd_client", "decoder", "controller", "workloads", "refmodels", "distill")
WORKER_ONLY = ("torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn")
DEMO_ONLY = ("rich", "matplotlib", "httpx")


def source_tree(into: Path) -> Path:
    """What a clean checkout would build from: the packaged folders' tracked and new, not ignored, files."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "pyproject.toml", "README.md",
         *PACKAGES],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (REPO / name).is_file():  # a file deleted in the working tree but not yet in git
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, into / name)
    return into


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "SPECD_REDIS_URL")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def controller_venv(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel, installed without extras; returns its bin folder."""
    tmp = tmp_path_factory.mktemp("packaging")
    wheels = tmp / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", wheels,
        source_tree(tmp / "src"), cwd=tmp)  # fmt: skip
    [wheel] = wheels.glob("specd-*.whl")
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", wheel, cwd=tmp, timeout=600)
    return venv / "bin"


def test_the_base_install_has_no_torch_and_no_worker_or_demo_packages(controller_venv: Path, tmp_path: Path):
    probe = "import importlib.util as u; print(sorted(n for n in NAMES if u.find_spec(n)))"
    done = run(controller_venv / "python", "-c", probe.replace("NAMES", repr(WORKER_ONLY + DEMO_ONLY)), cwd=tmp_path)
    assert done.stdout.strip() == "[]"
    failed = subprocess.run([controller_venv / "python", "-c", "import torch"], cwd=tmp_path, capture_output=True)
    assert failed.returncode != 0 and b"No module named 'torch'" in failed.stderr


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["demo", "--prompts-per-segment", "2"], "demo"),  # its parser imports rich: a stand-in says what to add
        (["worker", "--config", "configs/worker.yaml"], "worker"),  # gets as far as uvicorn
        (["tiny-pair", "--out", "pair"], "worker"),
    ],
)
def test_a_command_of_an_extra_names_the_extra_in_one_line(
    controller_venv: Path, command: list[str], extra: str, tmp_path: Path
):
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "worker.yaml", tmp_path / "configs")
    done = subprocess.run([controller_venv / "specd", *command], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"specd {command[0]}: error: needs the module ")
    assert line.endswith(f"which the base install (the controller) leaves out: pip install 'specd[{extra}]'")


def test_the_base_install_runs_the_controller_and_answers_decide(controller_venv: Path, tmp_path: Path):
    # configs/controller.yaml as shipped, next to the shipped policies (its policy_path is relative to it), with a
    # free port and a state folder (embedded Redis) of this test's own.
    (tmp_path / "configs").mkdir()
    shutil.copytree(REPO / "policies", tmp_path / "policies")
    config = yaml.safe_load((REPO / "configs" / "controller.yaml").read_text())
    port = free_port()
    config.update(listen=f"127.0.0.1:{port}", state_dir=str(tmp_path / "state"))
    path = tmp_path / "configs" / "controller.yaml"
    path.write_text(yaml.safe_dump(config))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "SPECD_REDIS_URL")}
    process = subprocess.Popen([controller_venv / "specd", "controller", "--config", path], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if re.search(rf"listening on 127\.0\.0\.1:{port}\b", line):
                break
        else:
            pytest.fail(f"the controller exited ({process.wait()}):\n{''.join(output)}")

        # Asked from the same venv: the installed stubs, no project code from this checkout.
        decide = f"""
            import grpc, sys
            from specd_api.v1 import controller_pb2 as pb, controller_pb2_grpc as pb_grpc
            stub = pb_grpc.ControllerStub(grpc.insecure_channel("127.0.0.1:{port}"))
            plan = stub.Decide(pb.DecideRequest(segment="code", batch_size=1, drafters=["draft", "prompt_lookup"],
                                                max_new_tokens=64), timeout=10)
            print(plan.drafter, plan.policy_version, "torch" in sys.modules)
        """
        drafter, version, torch_loaded = run(controller_venv / "python", "-c", textwrap.dedent(decide),
                                             cwd=tmp_path).stdout.split()  # fmt: skip
        assert drafter in ("draft", "prompt_lookup", "none") and version and torch_loaded == "False"

        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 15
    finally:
        if process.poll() is None:
            process.kill()
    rest = process.stdout.read() if process.stdout else ""
    assert "Traceback" not in "".join(output) + rest
