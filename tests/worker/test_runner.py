"""The worker's ``runner`` setting reaches the engine: with ``runner: invariant`` in bfloat16, a served greedy
completion is the same text whatever the drafter and K (decoder/llama_invariant.py; the engine-level proof is in
tests/decoder/test_invariant.py)."""

from __future__ import annotations

from tests.worker.conftest import WorkerLauncher

PROMPTS = ["def parse(line):\n    ", "The quick brown fox", "SELECT name FROM users WHERE id = id"]


def test_an_invariant_bfloat16_worker_serves_the_same_greedy_text_with_every_drafter(launcher: WorkerLauncher):
    worker = launcher.start("invariant", runner="invariant", dtype="bfloat16", controller={"address": None})
    assert "the invariant pass in bfloat16" in worker.log.read_text()
    for prompt in PROMPTS:
        texts = {}
        for drafter, k in (("none", 0), ("draft", 1), ("draft", 4), ("prompt_lookup", 4)):
            body = {"max_tokens": 24, "temperature": 0, "speculation": {"drafter": drafter, "k": k}}
            texts[drafter, k] = worker.complete(prompt, **body)["choices"][0]["text"]
        assert len(set(texts.values())) == 1, texts
        assert texts["none", 0].strip(), "the target wrote nothing"
    launcher.stop(worker)


def test_the_worker_offers_the_runners_and_dtypes_the_cli_does():
    from typing import get_args

    from decoder.choices import DTYPE_NAMES, RUNNER_NAMES
    from decoder.worker.config import WorkerConfig

    fields = WorkerConfig.model_fields
    assert get_args(fields["runner"].annotation) == RUNNER_NAMES
    assert set(get_args(fields["dtype"].annotation)) == set(DTYPE_NAMES)
