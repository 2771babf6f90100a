"""Loading from a local folder through transformers, and refusing a draft with another vocabulary."""

from __future__ import annotations

import pytest
import torch

from decoder.models import check_pair, load_model, resolve_device
from decoder.tiny import build_model, build_tokenizer, save_tiny_pair
from specd_api.errors import ModelLoadError, TokenizerMismatchError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    save_tiny_pair(out, "llama")
    return out


def test_loads_saved_pair_and_accepts_it(pair_dir):
    target = load_model(pair_dir / "target", CPU, torch.float32)
    draft = load_model(pair_dir / "draft", CPU, torch.float32)
    check_pair(target, draft)
    assert target.max_context == 512
    assert target.eos_token_ids == {0}


def test_refuses_a_draft_with_another_tokenizer(pair_dir, tmp_path):
    other_tokenizer = build_tokenizer(vocab_size=300)
    build_model("llama", len(other_tokenizer), seed=3).save_pretrained(tmp_path / "other")
    other_tokenizer.save_pretrained(tmp_path / "other")
    target = load_model(pair_dir / "target", CPU, torch.float32)
    other = load_model(tmp_path / "other", CPU, torch.float32)
    with pytest.raises(TokenizerMismatchError) as e:
        check_pair(target, other)
    assert str(pair_dir / "target") in str(e.value) and str(tmp_path / "other") in str(e.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "is not a directory"),
        (lambda tmp: tmp, "no config.json"),
    ],
)
def test_bad_paths_give_clear_errors(tmp_path, make, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(make(tmp_path), CPU, torch.float32)


def test_corrupt_config_gives_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(tmp_path, CPU, torch.float32)


@pytest.mark.parametrize("name", ["cuda", "auto", None])
def test_a_cuda_device_carries_its_index(monkeypatch, name):
    # Tensors report "cuda:0"; a bare "cuda" compares unequal to it, and the draft/target device check then
    # refused every pair loaded with --device cuda (seen on an H100: "target is on cuda and draft on cuda:0").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(name) == torch.device("cuda", 0)


def test_an_explicit_cuda_index_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
