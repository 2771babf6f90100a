"""Training an EAGLE-3 head (distill/head_training.py, ``specd distill --head eagle``).

- Training-time test computes what serving computes: the unrolled step s at entry p equals the head's cache fed the
  target's states up to p - s, then its own outputs along the chain (float64, to rounding).
- The draft vocabulary is the most frequent tokens, ascending; the loss is 0 exactly where the head's distribution
  is the target's, and drops entries a step has not reached.
- ``specd distill --head eagle`` over a tiny target writes a speculators-layout head that loads for that target and
  drafts tokens the target accepts (α up from the start), with its report; bad flags are refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from decoder.heads import EagleHead, HeadCache, HeadShape, load_head
from decoder.models import load_model
from decoder.tiny import build_model
from distill.config import DistillConfig
from distill.head_training import DECAY, draft_vocabulary, head_loss, target_states, unrolled_logits
from specd_api.errors import UsageError
from tests.distill.test_distill import workspace  # noqa: F401 (the trained tiny target, a module fixture)

VOCAB = 48


def shapes() -> tuple[object, EagleHead]:
    torch.manual_seed(4)
    target = build_model("llama", VOCAB, seed=11, hidden=64, layers=4).double().eval()
    shape = HeadShape(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=VOCAB, draft_vocab=40,
                      target_hidden=64, aux_layers=(0, 2, 3))  # fmt: skip
    head = EagleHead(shape)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    return target, head.double().eval()


def test_training_time_test_computes_what_drafting_computes():
    target, head = shapes()
    batch = torch.tensor([[3, 7, 1, 9, 4, 11, 2, 5, 3, 7, 1, 30]])
    states, _ = target_states(target, batch, head.shape.aux_layers)
    states = states.double()
    logits = unrolled_logits(head, states, batch, 3)
    x = batch[0]
    with torch.no_grad():
        for p in range(2, 10):
            cache = HeadCache(head)
            out = cache.forward(head.fc(states[0, : p - 1]), x[1:p])  # entries 0..p - 2 from the target's states
            torch.testing.assert_close(head.draft_logits(out[-1:])[0], logits[0][0, p - 2], rtol=0, atol=1e-12)
            first = cache.forward(out[-1:], x[p : p + 1])  # entry p - 1 from its own output: step 1
            torch.testing.assert_close(head.draft_logits(first)[0], logits[1][0, p - 1], rtol=0, atol=1e-12)
            second = cache.forward(first, x[p + 1 : p + 2])  # entry p: step 2
            torch.testing.assert_close(head.draft_logits(second)[0], logits[2][0, p], rtol=0, atol=1e-12)


def test_the_drafter_drafts_what_training_predicts():
    # The serving drafter against training's own computation: from the states of a context, each drafted token is
    # the unrolled step's argmax at its entry, mapped by the draft vocabulary built here (not by the head's own map).
    from decoder.drafters.eagle import EagleDrafter
    from decoder.heads import LoadedHead
    from decoder.models import from_objects
    from decoder.runners import KVPool
    from decoder.runners.base import FeatureTap
    from decoder.sampling import SamplingParams

    target, head = shapes()
    ids = torch.tensor([1, 2, 3, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
                        28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 40, 41, 44, 47])  # fmt: skip
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(40))
    lm = from_objects(target, None, "models/tiny", runner="lean")
    context = torch.tensor([3, 7, 1, 9, 4, 11, 2, 5, 3, 7, 1, 30])
    tap = FeatureTap(head.shape.aux_layers)
    with torch.inference_mode():
        KVPool(lm, 1).open().forward(context[:-1], tap=tap)
    assert tap.rows is not None
    t = context.shape[0]
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):  # greedy tokens; sampled: q itself
        drafter = EagleDrafter(LoadedHead(head, "models/tiny", "random"), params, torch.Generator().manual_seed(5))
        drafter.observe(tap.rows[0])
        draft = drafter.propose(context, 3)
        batch = torch.cat([context, draft.tokens[:2]])[None]  # the drafted tokens stand where training reads true ones
        states, _ = target_states(target, batch, head.shape.aux_layers)
        with torch.no_grad():
            logits = [unrolled_logits(head, states.double(), batch, 3)[step][0, t - 2 + step] for step in range(3)]
        if params.is_greedy:
            assert draft.tokens.tolist() == [int(ids[step.argmax()]) for step in logits]
        else:
            assert draft.probs is not None
            for step, q in zip(logits, draft.probs, strict=True):
                torch.testing.assert_close(q[ids].double(), step.softmax(-1), rtol=0, atol=1e-6)  # q in float32
                assert float(q.sum() - q[ids].sum()) == 0.0  # nothing off the draft vocabulary


def test_the_draft_vocabulary_and_the_loss():
    stream = torch.tensor([5, 5, 5, 2, 2, 9, 9, 1, 7])
    assert draft_vocabulary(stream, 12, 3).tolist() == [2, 5, 9]  # the 3 most frequent, ascending
    assert draft_vocabulary(stream, 12, 4).tolist() == [1, 2, 5, 9]  # ties: the lower id

    torch.manual_seed(0)
    target_logits = torch.randn(2, 6, 12)
    ids = torch.tensor([0, 3, 4, 8, 11])
    exact = target_logits[:, 1:, ids]  # what the target gives the draft vocabulary at each entry's token
    assert float(head_loss([exact], target_logits, ids)) == pytest.approx(0.0, abs=1e-6)
    off = exact.clone()
    off[:, 0] += torch.randn(2, 5) * 3  # wrong at entry 0 only: step 1 never reaches entry 0
    assert float(head_loss([exact, off], target_logits, ids)) == pytest.approx(0.0, abs=1e-6)
    assert float(head_loss([off, exact], target_logits, ids)) > 0.01
    one = float(head_loss([off], target_logits, ids))
    assert float(head_loss([off, exact], target_logits, ids)) == pytest.approx(one / (1 + DECAY), rel=1e-5)


def test_distill_head_trains_a_head_that_loads_and_drafts(workspace, tmp_path):  # noqa: F811 (the fixture)
    out = tmp_path / "head"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "distill", "--target", str(workspace / "target"), "--head", "eagle",
         "--data", str(workspace / "data.txt"), "--steps", "60", "--batch-size", "4", "--seq-len", "48",
         "--lr", "0.005", "--draft-vocab", "200", "--eval-prompts", "4", "--eval-tokens", "16", "--threads", "1",
         "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "distill_report.json").read_text())
    assert report["alpha_after"] > report["alpha_before"] and report["alpha_after"] > 0.2, report
    assert report["kl_after"] < report["kl_before"]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["algorithm"] == "eagle3" and config["draft_vocab_size"] == 200
    target = load_model(workspace / "target", torch.device("cpu"), torch.float32)
    head = load_head(out, target)
    assert head.shape.target_hidden == target.hidden_size
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as stored:  # the embeddings are the target's: left out
        names = set(stored.keys())
    assert "embed_tokens.weight" not in names and "fc.weight" in names
    assert torch.equal(head.head.embed_tokens.weight, target.model.get_input_embeddings().weight)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"head": "medusa"}, "unknown --head 'medusa'"),
        ({"head": "eagle", "init_draft": "d"}, "give neither --init-draft nor --draft-config"),
        ({"head": "eagle", "draft_vocab": 1}, "--draft-vocab must be >= 2"),
        ({"head": "eagle", "ttt_steps": 0}, "--ttt-steps must be >= 1"),
        ({}, "or --head eagle"),
    ],
)
def test_bad_head_flags_are_refused_by_name(fields, message):
    from pathlib import Path

    given = {k: Path(v) if k == "init_draft" else v for k, v in fields.items()}
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        DistillConfig(target=Path("t"), data=(Path("d"),), steps=1, out=Path("o"), **given)
