"""Shared fixtures: tiny models built from configs (float64, so float rounding cannot flip an argmax)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

# Triton's kernels (the graphs pass's Triton forms) run on a CPU under its interpreter, which Triton reads when a
# kernel is defined: set before anything imports them. SPECD_TEST_DEVICE=cuda compiles them instead.
if os.environ.get("SPECD_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from decoder.models import LoadedModel, from_objects
from decoder.tiny import build_model, build_tokenizer

if TYPE_CHECKING:
    from tests.otlp_receiver import OtlpReceiver

# Tiny models gain nothing from intra-op threads, and lose a lot when another process holds the cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def tiny_lm(arch: str, tokenizer, seed: int, hidden: int = 64, layers: int = 2) -> LoadedModel:
    """``arch`` is "llama" (the lean Llama runner), "llama/transformers" (transformers' forward) or "gpt2"."""
    family, _, runner = arch.partition("/")
    model = build_model(family, len(tokenizer), seed, hidden=hidden, layers=layers).double()
    return from_objects(model, tokenizer, f"tiny-{arch}-{seed}", runner=runner or "auto")


def perturbed_copy(lm: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """The target with noise on its weights: agrees with it often, not always."""
    model = copy.deepcopy(lm.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale * param.std())
    return from_objects(model, lm.tokenizer, f"{lm.name}-perturbed", runner=lm.runner)


@pytest.fixture(scope="session", params=["llama", "llama/transformers", "gpt2"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def target(arch, tokenizer) -> LoadedModel:
    return tiny_lm(arch, tokenizer, seed=0)


@pytest.fixture(scope="session")
def embedded_redis_url(tmp_path_factory) -> Iterator[str]:
    """The embedded Redis-protocol server (what a controller starts when no redis_url is given), once per run."""
    from controller.storage.redis_conn import start_embedded

    server, url = start_embedded(tmp_path_factory.mktemp("valkey"))
    yield url
    server.stop()


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A started OTLP/gRPC trace receiver of this test's own (tests/otlp_receiver.py): send to ``.endpoint``.
    Imported here, not at the top: tests/decoder runs where only torch and transformers are (a GPU machine)."""
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver
