"""Loading causal LMs from local paths, choosing the device and dtype, and checking a draft/target pair."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd_api.errors import ModelLoadError, TokenizerMismatchError

DTYPES: dict[str, torch.dtype] = {  # keys: decoder.choices.DTYPE_NAMES
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # for exactness tests; never faster
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for decoding, with what the engine needs to know about it."""

    model: Any  # transformers.PreTrainedModel, in eval mode on `device`
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    name: str  # the path it came from, for messages
    device: torch.device
    runner: str = "auto"  # decoder.choices.RUNNER_NAMES; read by decoder.runners.select_pass alone

    @property
    def vocab_size(self) -> int:
        """Width of the logits the model produces."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as the config files name it: "float32", "bfloat16", ..."""
        return str(self.model.get_output_embeddings().weight.dtype).removeprefix("torch.")

    @property
    def num_layers(self) -> int:
        """The decoder layers the model runs (its config's ``num_hidden_layers``)."""
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """The width of its hidden states (its config's ``hidden_size``)."""
        return int(self.model.config.hidden_size)

    @property
    def max_context(self) -> int | None:
        """Longest sequence (prompt + generated) the model supports, if its config says."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(int(v) for v in value)
        return frozenset(ids)


def resolve_device(name: str | None) -> torch.device:
    """``None`` or "auto" picks CUDA when present, else CPU; a CUDA device always carries its index."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ModelLoadError(f"unknown device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} asked for, but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        # "cuda" and the "cuda:0" a tensor reports must compare equal (the draft/target check compares them)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def parse_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """A dtype by name; "auto" picks the fastest exact configuration for ``device`` (decoder.choices)."""
    if name == "auto":
        if device is not None and device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}") from None


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype, runner: str = "auto") -> LoadedModel:
    """Load a Hugging Face causal LM and its tokenizer from a local folder, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model path {str(path)!r} has no config.json (not a Hugging Face model folder)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load model from {str(path)!r}: {first_line}") from None
    model = model.to(device).eval()  # type: ignore[arg-type]
    return LoadedModel(model=model, tokenizer=tokenizer, name=str(path), device=device, runner=runner)


def from_objects(model: Any, tokenizer: Any, name: str, runner: str = "auto") -> LoadedModel:
    """Wrap an already built model (tests build tiny ones from a config)."""
    device = next(model.parameters()).device
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, name=name, device=device, runner=runner)


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else than the target's (the classic way to ruin α)."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(target_vocab.keys() - draft_vocab.keys())
        only_draft = len(draft_vocab.keys() - target_vocab.keys())
        differ = sum(1 for t, i in target_vocab.items() if draft_vocab.get(t, i) != i)
        raise TokenizerMismatchError(
            f"tokenizer mismatch: target {target.name!r} ({len(target_vocab)} tokens) and "
            f"draft {draft.name!r} ({len(draft_vocab)} tokens) differ: {only_target} only in target, "
            f"{only_draft} only in draft, {differ} with different ids"
        )
    if target.vocab_size != draft.vocab_size:
        raise TokenizerMismatchError(
            f"logit width mismatch: target {target.name!r} has {target.vocab_size} output rows, "
            f"draft {draft.name!r} has {draft.vocab_size}; speculative sampling needs the same vocabulary"
        )
    if target.device != draft.device:
        raise ModelLoadError(f"target is on {target.device} and draft on {draft.device}; put both on one device")
