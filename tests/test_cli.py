"""`specd generate` through a real subprocess: JSON fields, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from decoder.tiny import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("cli"), "llama")


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=120)


def test_generate_json_has_the_documented_fields(pair):
    target, draft = pair
    done = specd(
        "generate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--k",
        "3",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "def f(x):",
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    for field in (
        "text",
        "token_ids",
        "num_rounds",
        "num_drafted",
        "num_accepted",
        "alpha",
        "mean_accepted_length",
        "target_forward_passes",
        "tokens_per_second",
    ):
        assert field in record, field
    assert len(record["token_ids"]) == 12
    assert record["target_forward_passes"] == record["num_rounds"] + 1


def test_plain_output_matches_json_text(pair):
    target, _ = pair
    args = ("generate", "--target", str(target), "--max-new-tokens", "8", "--ignore-eos", "hello")
    assert specd(*args).stdout.rstrip("\n") == json.loads(specd(*args, "--json").stdout)["text"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "/no/such/model", "x"], "is not a directory"),
        (["--target", "{target}", "--k", "abc", "x"], "invalid int value"),
        (["--target", "{target}", "--drafter", "bogus", "x"], "invalid choice"),
        (["--target", "{target}", "--k", "-2", "x"], "--k must be >= 0"),
        (["--target", "{target}", "--temperature", "nan", "x"], "temperature"),
        (["--target", "{target}", "--drafter", "draft", "x"], "needs --draft"),
        (["--target", "{target}", "--draft", "{other}", "x"], "tokenizer mismatch"),
        (["--target", "{target}", "--max-new-tokens", "0", "x"], "max_new_tokens"),
    ],
)
def test_errors_are_one_line_without_traceback(pair, tmp_path, args, message):
    target, _ = pair
    other = tmp_path / "other"
    if "{other}" in args:
        from decoder.tiny import build_model, build_tokenizer

        tok = build_tokenizer(vocab_size=300)
        build_model("llama", len(tok), seed=1).save_pretrained(other)
        tok.save_pretrained(other)
    done = specd("generate", *(a.format(target=target, other=other) for a in args))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
