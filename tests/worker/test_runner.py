"""The worker's ``runner`` setting reaches the engine: every runner name loads the pass it names (decoder/runners;
the engine-level proofs are in tests/decoder/test_runners.py); ``runner: transformers`` serves transformers' greedy
text and says so; with ``runner: invariant`` in bfloat16, a served greedy completion is the same text whatever the
drafter and K (decoder/runners/invariant.py; tests/decoder/test_invariant.py); so with ``runner: graphs``, which also
counts its passes outside its buckets in /metrics (decoder/runners/graphed.py; tests/decoder/test_graph_pass.py)."""

from __future__ import annotations

import pytest

from decoder.choices import RUNNER_NAMES
from decoder.native import build
from tests.worker.conftest import Reference, TinyPair, WorkerLauncher

PROMPTS = ["def parse(line):\n    ", "The quick brown fox", "SELECT name FROM users WHERE id = id"]


def test_an_invariant_bfloat16_worker_serves_the_same_greedy_text_with_every_drafter(launcher: WorkerLauncher):
    worker = launcher.start("invariant", runner="invariant", dtype="bfloat16", controller={"address": None})
    assert "the invariant pass (torch products) in bfloat16" in worker.log.read_text()
    for prompt in PROMPTS:
        texts = {}
        for drafter, k in (("none", 0), ("draft", 1), ("draft", 4), ("prompt_lookup", 4)):
            body = {"max_tokens": 24, "temperature": 0, "speculation": {"drafter": drafter, "k": k}}
            texts[drafter, k] = worker.complete(prompt, **body)["choices"][0]["text"]
        assert len(set(texts.values())) == 1, texts
        assert texts["none", 0].strip(), "the target wrote nothing"
    launcher.stop(worker)


def test_a_graphs_worker_names_its_pass_counts_passes_outside_its_buckets_and_serves_exact_text(
    launcher: WorkerLauncher,
):
    """``runner: graphs`` (decoder/runners/graphed.py; the eager stand-in on this CPU): the listening line and
    /metrics name it, a prompt longer than its widest bucket is counted as a pass outside the buckets, and in
    bfloat16 a greedy completion is the same text whatever the drafter and K (tests/decoder/test_graph_pass.py)."""
    worker = launcher.start("graphs", runner="graphs", dtype="bfloat16", controller={"address": None})
    assert "the graphs pass (torch products) in bfloat16" in worker.log.read_text()
    before = worker.metrics()
    assert before.total("specd_forward_pass_info", runner="graphs", dtype="bfloat16", kernel="torch") == 1
    texts = {}
    for drafter, k in (("none", 0), ("draft", 1), ("draft", 4), ("prompt_lookup", 4)):
        body = {"max_tokens": 24, "temperature": 0, "speculation": {"drafter": drafter, "k": k}}
        texts[drafter, k] = worker.complete(PROMPTS[0], **body)["choices"][0]["text"]
    assert len(set(texts.values())) == 1 and texts["none", 0].strip(), texts
    after = worker.metrics()
    outside = "specd_forward_pass_outside_buckets_total"
    for model, prefills in (("target", 4), ("draft", 2)):  # a prefill of more than 9 tokens per request it ran
        wide = {"model": model, "reason": "wide_rows"}
        assert after.total(outside, **wide) - before.total(outside, **wide) >= prefills, model
    assert after.total(outside, reason="many_rows") == 0
    launcher.stop(worker)


def test_the_worker_offers_the_runners_and_dtypes_the_cli_does():
    from typing import get_args

    from decoder.choices import DTYPE_NAMES, RUNNER_NAMES
    from decoder.worker.config import WorkerConfig

    fields = WorkerConfig.model_fields
    assert get_args(fields["runner"].annotation) == RUNNER_NAMES
    assert set(get_args(fields["dtype"].annotation)) == set(DTYPE_NAMES)


@pytest.mark.parametrize("runner", RUNNER_NAMES)
def test_the_worker_loads_the_pass_its_runner_names(tiny_pair: TinyPair, runner: str):
    """The worker's own loader (``WorkerService._load_engine``, what its decode thread runs) on float32 models, which
    every pass can run: target and draft pools run the named pass; auto, the native one where it builds."""
    from decoder.worker.config import WorkerConfig
    from decoder.worker.service import WorkerService

    if runner == "native" and build.load() is None:
        pytest.skip(f"no native pass here: {build.why_not()}")
    config = WorkerConfig(target=tiny_pair.target, draft=tiny_pair.near_draft, device="cpu", dtype="float32",
                          runner=runner, warm_up=False)  # fmt: skip
    engine = WorkerService(config)._load_engine()
    expected = runner if runner != "auto" else "native" if build.load() is not None else "lean"
    assert engine.draft_pool is not None
    assert engine.target_pool.forward_pass.name == engine.draft_pool.forward_pass.name == expected


def test_the_worker_captures_its_graphs_before_its_warm_up_and_says_so(tiny_pair: TinyPair, monkeypatch, caplog):
    """On a GPU the graphs pass captures one CUDA graph per bucket (a capture while serving stalls the step that
    meets it): the worker's start-up captures both pools' graphs first, logs how many and how long, then warms up.
    (What a capture does: tests/decoder/test_graph_capture.py.)"""
    import logging

    from decoder.batch_engine import BatchEngine
    from decoder.worker import service
    from decoder.worker.config import WorkerConfig

    calls: list[str] = []
    monkeypatch.setattr(BatchEngine, "capture_graphs", lambda engine: calls.append("capture") or 90)
    monkeypatch.setattr(BatchEngine, "warm_up", lambda engine: calls.append("warm_up") or 0)
    monkeypatch.setattr(service, "measure_costs", lambda engine: [])
    config = WorkerConfig(target=tiny_pair.target, draft=tiny_pair.near_draft, device="cpu", dtype="float32",
                          runner="lean", warm_up=True)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="specd.worker"):
        service.WorkerService(config)._load_engine()
    assert calls == ["capture", "warm_up"]
    assert "CUDA graphs: 90 captured" in caplog.text


@pytest.mark.parametrize("address", [None, "127.0.0.1:50051"], ids=["no-controller", "controller"])
def test_the_worker_calibrates_its_costs_only_for_a_controller(tiny_pair: TinyPair, monkeypatch, address):
    """The start-up calibration's timings are the controller's first costs: a worker with no controller to report
    them to warms up and skips them (about 2 s on the reference pair)."""
    from decoder.batch_engine import BatchEngine
    from decoder.worker import service
    from decoder.worker.config import WorkerConfig

    calls: list[str] = []
    monkeypatch.setattr(BatchEngine, "warm_up", lambda engine: calls.append("warm_up") or 0)
    monkeypatch.setattr(service, "measure_costs", lambda engine: calls.append("calibrate") or [])
    config = WorkerConfig(target=tiny_pair.target, draft=tiny_pair.near_draft, device="cpu", dtype="float32",
                          runner="lean", warm_up=True, controller={"address": address})  # fmt: skip
    service.WorkerService(config)._load_engine()
    assert calls == (["warm_up"] if address is None else ["warm_up", "calibrate"])


def test_a_transformers_worker_runs_transformers_pass_and_serves_its_greedy_text(
    launcher: WorkerLauncher, reference: Reference
):
    """``runner: transformers`` runs transformers' pass in the worker, as in the engine's single-sequence path, not
    the lean one: the listening line names the pass the target pool runs, and the text is transformers' own."""
    worker = launcher.start("transformers", runner="transformers", controller={"address": None})
    assert "the transformers pass (torch products) in float64" in worker.log.read_text()
    forward = {"runner": "transformers", "dtype": "float64", "kernel": "torch"}
    assert worker.metrics().total("specd_forward_pass_info", **forward) == 1
    for prompt in PROMPTS[:2]:
        want = reference.tokenizer.decode(reference.greedy(prompt, 16), skip_special_tokens=True)
        for drafter, k in (("none", 0), ("draft", 3), ("prompt_lookup", 4)):
            body = {"max_tokens": 16, "temperature": 0, "speculation": {"drafter": drafter, "k": k}}
            assert worker.complete(prompt, **body)["choices"][0]["text"] == want, (prompt, drafter, k)
    launcher.stop(worker)
