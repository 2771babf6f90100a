"""The shipped reference pair (models/reference) loads offline, matches, fits its budget, and decodes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder.engine import SpeculativeDecoder
from decoder.models import check_pair, load_model
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams

REFERENCE = Path(__file__).resolve().parent.parent / "models" / "reference"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    # float64 so that a 1-token and a (K+1)-token pass cannot round an argmax differently
    return load_model(REFERENCE / "target", CPU, torch.float64), load_model(REFERENCE / "draft", CPU, torch.float64)


def test_loads_offline_and_the_tokenizers_match(pair, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, draft = pair
    check_pair(target, draft)
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()


def test_sizes_are_as_specified(pair):
    target, draft = (sum(p.numel() for p in lm.model.parameters()) for lm in pair)
    assert target >= 15_000_000
    assert 5 <= target / draft <= 15
    shipped = sum(f.stat().st_size for f in REFERENCE.rglob("*") if f.is_file())
    assert shipped < 60 * 1024 * 1024
    assert (REFERENCE / "README.md").is_file()


@pytest.mark.parametrize("drafter", ["draft", "prompt_lookup"])
def test_speculative_greedy_equals_target_only(pair, drafter):
    target, draft = pair
    torch.set_num_threads(1)
    decoder = SpeculativeDecoder(target, draft)
    prompt = decoder.encode("def read_config(path):\n    with open(path) as f:\n")
    rules = StopConditions(24, target.eos_token_ids)
    expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules)
    got = decoder.generate(prompt, drafter, 4, SamplingParams(), rules)
    assert got.token_ids == expected.token_ids
    assert expected.text.strip(), "the target produced no text"


def test_the_shipped_head_loads_for_the_target_and_drafts_what_it_accepts(pair):
    from decoder.heads import load_head

    target, _ = pair
    torch.set_num_threads(1)
    head = load_head(REFERENCE / "eagle", target)
    decoder = SpeculativeDecoder(target, head=head)
    prompt = decoder.encode("def read_config(path):\n    with open(path) as f:\n")
    rules = StopConditions(32, target.eos_token_ids)
    expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules)
    got = decoder.generate(prompt, "eagle", 3, SamplingParams(), rules)
    assert got.token_ids == expected.token_ids
    assert got.stats.alpha is not None and got.stats.alpha > 0.3, got.stats.alpha  # trained: it agrees often
