"""A worker with a draft head (``head:`` in its config) over its real path: it offers ``eagle``, a request that asks
for it is drafted by the head and answered with target-only's text; a head for another target stops the worker at
start-up with the file, the field and the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from decoder.heads import EagleHead, HeadShape, save_head
from decoder.heads.layout import default_aux_layers
from tests.worker.conftest import TinyPair, WorkerLauncher


def write_head(folder: Path, target: Path, verifier: str) -> Path:
    """A random EAGLE-3 head for the tiny target, saved as trained for ``verifier``."""
    config = AutoConfig.from_pretrained(target)
    shape = HeadShape(
        hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=config.vocab_size, draft_vocab=150,
        target_hidden=config.hidden_size, aux_layers=default_aux_layers(config.num_hidden_layers),
    )  # fmt: skip
    torch.manual_seed(0)
    head = EagleHead(shape)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.2)
        head.d2t.copy_(torch.arange(0, 300, 2) - torch.arange(150))  # the even ids
        head.t2d[torch.arange(0, 300, 2)] = True
    save_head(head, folder, verifier, ["LlamaForCausalLM"])
    return folder


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_pair: TinyPair) -> Path:
    return write_head(tmp_path_factory.mktemp("head") / "eagle", tiny_pair.target, str(tiny_pair.target))


def test_a_worker_with_a_head_offers_and_runs_eagle(launcher: WorkerLauncher, head: Path):
    worker = launcher.start("eagle", head=str(head), draft=None)
    try:
        prompt = "The with statement is used to"
        plain = worker.complete(prompt, max_tokens=24, temperature=0, speculation={"drafter": "none", "k": 0})
        eagle = worker.complete(prompt, max_tokens=24, temperature=0, speculation={"drafter": "eagle", "k": 3})
        assert eagle["specd"]["drafter"] == "eagle" and eagle["specd"]["num_drafted"] > 0, eagle["specd"]
        assert eagle["choices"][0]["text"] == plain["choices"][0]["text"]
        sampled = worker.complete(prompt, max_tokens=16, temperature=1.0, speculation={"drafter": "eagle", "k": 2})
        assert sampled["specd"]["drafter"] == "eagle"
    finally:
        launcher.stop(worker)


def test_a_head_for_another_target_stops_the_worker_by_name(launcher: WorkerLauncher, tiny_pair: TinyPair, tmp_path):
    other = write_head(tmp_path / "other", tiny_pair.target, "someone/another-model")
    config = launcher.config("eagle-other", head=str(other), draft=None)
    run = subprocess.run([sys.executable, "-m", "specd", "worker", "--config", str(config)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert "config.json: field speculators_config.verifier.name_or_path" in run.stderr, run.stderr[-1500:]
    assert "'someone/another-model'" in run.stderr and "Traceback" not in run.stderr
