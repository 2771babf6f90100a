"""`specd distill`: the loss, the data split, exact resume, and that distilling raises α of a fresh draft.

The target is a tiny llama trained for a few seconds on Python's own documentation, so it has learned
something a draft can copy (a random target's near-flat distributions have no stable argmax to agree on).
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decoder.models import load_model
from decoder.tiny import build_model, build_tokenizer
from distill.batches import continue_with_target
from distill.config import DistillConfig
from distill.data import DataError, pack, read_documents, split_documents
from distill.evaluate import evaluate, held_out
from distill.loss import forward_kl, top1_agreement
from distill.pipeline import distill
from distill.progress import Progress
from distill.trainer import StopRequest, learning_rate
from specd.cli import main
from specd_api.errors import TokenizerMismatchError, UsageError

DRAFT_CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
TARGET_TRAIN_STEPS = 100


def python_docs(count: int = 30) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)[:count])


def train_tiny_target(tokenizer, text: str, steps: int):
    """A tiny llama taught next-token prediction on ``text``: sharp, learnable preferences."""
    model = build_model("llama", len(tokenizer), seed=0, hidden=64, layers=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.div_(8.0)  # undo tiny's spreading: training sets the scale
    stream = pack([text], tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - 64, (8,), generator=generator)
        batch = torch.stack([stream[s : s + 64] for s in starts.tolist()])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """target/ (trained tiny llama), data.txt, draft.json (a fresh smaller llama), other_draft/ (other tokenizer)."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = build_tokenizer()
    text = python_docs()
    (root / "data.txt").write_text(text)
    target = train_tiny_target(tokenizer, text, TARGET_TRAIN_STEPS)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    (root / "draft.json").write_text(json.dumps(DRAFT_CONFIG))
    other_tokenizer = build_tokenizer(vocab_size=320)
    build_model("llama", len(other_tokenizer), seed=1, hidden=32, layers=1).save_pretrained(root / "other_draft")
    other_tokenizer.save_pretrained(root / "other_draft")
    return root


def small_config(root: Path, out: str, **overrides) -> DistillConfig:
    cfg = DistillConfig(
        target=root / "target",
        data=(root / "data.txt",),
        steps=6,
        out=root / out,
        draft_config=root / "draft.json",
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        eval_prompts=2,
        eval_tokens=4,
        checkpoint_every=100,
    )
    return replace(cfg, **overrides)


# ---------------------------------------------------------------------------------------------------------
# The loss


def test_kl_is_zero_for_the_same_logits_and_positive_otherwise():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    assert float(forward_kl(logits, logits)) == pytest.approx(0.0, abs=1e-6)
    assert float(forward_kl(logits.flip(-1), logits)) > 0.1


def test_kl_matches_the_definition_and_scales_by_t_squared():
    # p is one-hot-like (±10 logits), q is uniform: KL(p ‖ q) = Σ p log p + log V.
    target = torch.full((1, 1, 4), -10.0)
    target[..., 2] = 10.0
    draft = torch.zeros(1, 1, 4)
    p = torch.softmax(target[0, 0], dim=-1)
    expected = float((p * p.log()).sum()) + math.log(4)
    assert float(forward_kl(draft, target)) == pytest.approx(expected, rel=1e-5)
    # At temperature T both are softened, and the result is multiplied by T².
    p_t = torch.softmax(target[0, 0] / 2.0, dim=-1)
    assert float(forward_kl(draft, target, 2.0)) == pytest.approx(4 * (float((p_t * p_t.log()).sum()) + math.log(4)))


def test_kl_is_forward_not_reverse():
    # KL(p ‖ q) and KL(q ‖ p) differ for these; swapping the arguments must change the value.
    p_logits, q_logits = torch.tensor([[[4.0, 0.0, 0.0]]]), torch.tensor([[[1.0, 1.0, 0.0]]])
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    assert float(forward_kl(q_logits, p_logits)) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)
    assert float(forward_kl(q_logits, p_logits)) != pytest.approx(float(forward_kl(p_logits, q_logits)))


def test_gradient_reaches_the_draft_only():
    draft = torch.randn(1, 2, 5, requires_grad=True)
    target = torch.randn(1, 2, 5, requires_grad=True)
    forward_kl(draft, target).backward()
    assert draft.grad is not None and draft.grad.abs().sum() > 0
    assert target.grad is None


def test_top1_agreement_counts_equal_argmaxes():
    draft = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])
    target = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]])
    assert float(top1_agreement(draft, target)) == 0.5


# ---------------------------------------------------------------------------------------------------------
# Data and schedule


def test_documents_from_text_paragraphs_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first para\nstill first\n\n\nsecond\n  \nthird\n")
    (tmp_path / "b.jsonl").write_text('{"text": "from text"}\n\n{"prompt": "from prompt"}\n{"text": "second"}\n')
    documents = read_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    # Paragraphs split at blank lines (even whitespace-only ones); the duplicate "second" is dropped.
    assert documents == ["first para\nstill first", "second", "third", "from text", "from prompt"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "b.jsonl:1: not a JSON line"),  # the line number says where to look
        ('{"text": "ok"}\n{"title": "x"}\n', 'b.jsonl:2: expected an object with a "text"'),
        ('{"text": 3}\n', 'b.jsonl:1: expected an object with a "text"'),
        ("\n\n", "no text in the data files"),
    ],
)
def test_bad_jsonl_is_refused_with_file_and_line(tmp_path, content, message):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        read_documents([tmp_path / "b.jsonl"])


def test_split_is_deterministic_disjoint_and_order_free():
    documents = [f"document {i}" for i in range(50)]
    split = split_documents(documents, seed=0, heldout_fraction=0.1)
    assert len(split.heldout) == 5 and len(split.train) == 45
    assert set(split.train).isdisjoint(split.heldout)
    assert split == split_documents(documents, seed=0, heldout_fraction=0.1)
    assert set(split_documents(documents[::-1], 0, 0.1).heldout) == set(split.heldout)  # ranked by hash
    assert set(split_documents(documents, 1, 0.1).heldout) != set(split.heldout)  # the seed matters


def test_split_keeps_one_document_on_each_side_and_refuses_one():
    split = split_documents(["a", "b"], seed=0, heldout_fraction=0.1)
    assert len(split.train) == 1 and len(split.heldout) == 1
    with pytest.raises(DataError, match="at least 2 documents"):
        split_documents(["only"], seed=0, heldout_fraction=0.1)


def test_learning_rate_warms_up_then_decays_to_the_floor(tmp_path):
    cfg = DistillConfig(target=tmp_path, data=(tmp_path,), steps=100, out=tmp_path, init_draft=tmp_path, lr=1.0)
    assert cfg.warmup == 5
    assert learning_rate(0, cfg) == pytest.approx(0.2)  # (step + 1) / warmup
    assert learning_rate(4, cfg) == pytest.approx(1.0)
    assert learning_rate(5, cfg) == pytest.approx(1.0)  # the cosine starts at the peak
    assert learning_rate(100, cfg) == pytest.approx(0.1)  # ... and ends at lr * min_lr_ratio


def test_greedy_self_generated_continuation_matches_full_recompute(workspace):
    # The cached batched loop must pick the argmax a full forward over the whole prefix picks.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workspace / "target").eval()
    prompts = torch.randint(0, 300, (3, 5), generator=torch.Generator().manual_seed(0))
    out = continue_with_target(model, prompts, 6, 0.0, torch.Generator())
    assert out.shape == (3, 11) and torch.equal(out[:, :5], prompts)
    with torch.no_grad():
        for t in range(5, 11):
            assert torch.equal(out[:, t], model(input_ids=out[:, :t]).logits[:, -1].argmax(-1))


def test_a_draft_identical_to_the_target_scores_perfectly(workspace):
    # α 1, KL 0 and agreement 1 by construction: checks the evaluation's plumbing, not the training.
    target = load_model(workspace / "target", torch.device("cpu"), torch.float32)
    stream = pack([python_docs(3)], target.tokenizer)
    score = evaluate(target, copy.deepcopy(target.model), held_out(stream, 3, 32), eval_tokens=12)
    assert score.alpha == 1.0 and score.agreement == 1.0
    assert score.kl == pytest.approx(0.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Distillation end to end, in process


def test_distillation_raises_alpha_of_a_fresh_draft(workspace):
    cfg = small_config(
        workspace, "raise", steps=100, batch_size=8, seq_len=64, eval_prompts=24, eval_tokens=32, self_generated=0.25
    )
    report = distill(cfg, progress=Progress(cfg.steps, 0, use_tqdm=False))
    assert report is not None
    print(json.dumps(report.to_json()))
    # A random draft agrees with the trained target by chance only (measured: α 0.00, top-1 0.003, KL 1.81)...
    assert report.before.alpha < 0.1 and report.before.agreement < 0.1
    # ... and after 100 steps it predicts most of its greedy tokens (measured: α 0.95, top-1 0.88, KL 0.03).
    # The margins hold for every one of 3 target seeds x 4 distillation seeds tried (worst: α 0.33, top-1 0.52,
    # KL / 10); greedy α is the noisiest of the three, since one missed loop in a prompt costs all its rounds.
    assert report.after.alpha > report.before.alpha + 0.25
    assert report.after.agreement > report.before.agreement + 0.4
    assert report.after.kl < report.before.kl / 4


class StopAfter(StopRequest):
    """Asks the loop to stop once it has checked ``steps`` times (once per step)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.checks_left = steps

    @property  # type: ignore[override]
    def requested(self) -> bool:
        self.checks_left -= 1
        return self.checks_left < 0

    @requested.setter
    def requested(self, value: bool) -> None:
        pass


def test_resume_gives_the_weights_of_an_uninterrupted_run(workspace):
    quiet = Progress(6, 0, use_tqdm=False)
    # self_generated covers the target's sampled continuations, seeded by the step.
    straight = small_config(workspace, "straight", self_generated=0.5)
    assert distill(straight, progress=quiet) is not None

    interrupted = small_config(workspace, "interrupted", self_generated=0.5)
    assert distill(interrupted, stop=StopAfter(3), progress=quiet) is None
    assert (interrupted.checkpoint_dir / "state.pt").is_file()
    with pytest.raises(UsageError, match="pass --resume"):
        distill(interrupted, progress=quiet)
    resumed = distill(replace(interrupted, resume=True), progress=quiet)
    assert resumed is not None and resumed.steps == 6

    a, b = load_file(straight.out / "model.safetensors"), load_file(interrupted.out / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_resume_refuses_changed_batch_settings(workspace):
    cfg = small_config(workspace, "locked")
    assert distill(cfg, stop=StopAfter(2), progress=Progress(6, 0, use_tqdm=False)) is None
    with pytest.raises(UsageError, match="seq_len 32 -> 16"):
        distill(replace(cfg, resume=True, seq_len=16))


def test_draft_config_with_another_vocab_size_is_refused(workspace, tmp_path):
    (tmp_path / "draft.yaml").write_text("model_type: llama\nvocab_size: 1000\nhidden_size: 32\n")
    with pytest.raises(TokenizerMismatchError, match="vocab_size 1000"):
        distill(small_config(workspace, "vocab", draft_config=tmp_path / "draft.yaml"))


# ---------------------------------------------------------------------------------------------------------
# Through the command line


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specd", "distill", *args], capture_output=True, text=True, timeout=180
    )


def cli_args(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        *("--target", str(root / "target"), "--draft-config", str(root / "draft.json")),
        *("--data", str(root / "data.txt"), "--out", str(out), "--steps", str(steps)),
        *("--batch-size", "4", "--seq-len", "32", "--eval-prompts", "2", "--eval-tokens", "4", "--threads", "1"),
        *extra,
    ]


def test_cli_writes_a_loadable_draft_and_report_and_resumes(workspace, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    first = specd(*cli_args(workspace, out, 4, "--checkpoint-every", "2"))
    assert first.returncode == 0, first.stderr
    assert "α (greedy, K=4)" in first.stdout
    report = json.loads((out / "distill_report.json").read_text())
    for key in ("alpha_before", "alpha_after", "kl_before", "kl_after", "agreement_before", "agreement_after"):
        assert 0 <= report[key] < math.inf, key
    assert report["steps"] == 4 and report["tokens"] == 4 * 4 * 32 and report["seconds"] > 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(out))
    assert (out / "checkpoint" / "state.pt").is_file()

    more = specd(*cli_args(workspace, out, 6, "--resume"))
    assert more.returncode == 0, more.stderr
    assert "resumed from step 4" in more.stdout
    resumed = json.loads((out / "distill_report.json").read_text())
    assert resumed["steps"] == 6
    assert resumed["alpha_before"] == report["alpha_before"]  # measured once, on the draft as it started


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--target": "/no/such/model"}, "is not a directory"),
        ({"--data": "/no/such/data.txt"}, "data file '/no/such/data.txt' does not exist"),
        ({"--draft-config": None, "--init-draft": "{root}/other_draft"}, "tokenizer mismatch"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(workspace, tmp_path, change, message):
    args = cli_args(workspace, tmp_path / "out", 2)
    for flag, value in change.items():
        if flag in args:
            at = args.index(flag)
            del args[at : at + 2]
        if value is not None:
            args += [flag, value.format(root=workspace)]
    done = specd(*args)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--self-generated", "1.5"], "--self-generated must be in [0, 1]"),
        (["--temperature", "nan"], "--temperature must be a finite number > 0"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--init-draft", "x"], "not allowed with argument --draft-config"),
    ],
)
def test_bad_numbers_are_one_line_errors(workspace, tmp_path, capsys, extra, message):
    assert exit_code(["distill", *cli_args(workspace, tmp_path / "out", 2), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def exit_code(argv: list[str]) -> int:
    """``specd`` in process: argparse exits, handled errors return."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)
