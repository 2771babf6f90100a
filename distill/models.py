"""The frozen target, the draft being trained (from an existing draft or a fresh config), and saving it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from decoder.models import LoadedModel, check_pair, from_objects, load_model
from distill.config import EVAL_PROMPT_TOKENS, DistillConfig
from specd_api.errors import TokenizerMismatchError, UsageError

SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def load_target(cfg: DistillConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The target in ``dtype``, frozen: it is only ever run under no_grad."""
    target = load_model(cfg.target, device, dtype)
    target.model.requires_grad_(False)
    return target


def load_draft(cfg: DistillConfig, target: LoadedModel) -> LoadedModel:
    """The draft to train, in float32 on the target's device, sharing the target's tokenizer."""
    if cfg.init_draft is not None:
        draft = load_model(cfg.init_draft, target.device, torch.float32)
        check_pair(target, draft)
        return draft
    assert cfg.draft_config is not None
    config = read_draft_config(cfg.draft_config, target)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # whatever transformers raises here, the cause is the user's config file
        raise UsageError(f"--draft-config {cfg.draft_config}: cannot build a causal LM ({_reason(e)})") from None
    return from_objects(model.to(target.device), target.tokenizer, str(cfg.draft_config))


def read_draft_config(path: Path, target: LoadedModel) -> Any:
    """A Hugging Face config (JSON or YAML, with "model_type") for a fresh draft of the target's vocabulary.

    A missing ``vocab_size`` (and missing special token ids) are taken from the target; a different one is refused.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    values = _read_mapping(path)
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise UsageError(f'--draft-config {path}: needs a "model_type" (e.g. "llama")')
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"--draft-config {path}: unknown model_type {model_type!r} for this transformers version")
    vocab_size = values.setdefault("vocab_size", target.vocab_size)
    if vocab_size != target.vocab_size:
        raise TokenizerMismatchError(
            f"--draft-config {path} has vocab_size {vocab_size}, but the target {target.name!r} has "
            f"{target.vocab_size} logits; a draft must share the target's vocabulary"
        )
    for name in SPECIAL_TOKEN_FIELDS:
        if name not in values and getattr(target.model.config, name, None) is not None:
            values[name] = getattr(target.model.config, name)
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as e:  # ValueError, TypeError, or huggingface_hub's validation errors (no common base)
        raise UsageError(f"--draft-config {path}: {_reason(e)}") from None


def _reason(error: BaseException) -> str:
    """The first line of what went wrong, looking through a wrapping exception to its cause."""
    cause = error.__cause__ or error
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"--draft-config {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    values = _parse_yaml(path, text) if path.suffix in (".yaml", ".yml") else _parse_json(path, text)
    if not isinstance(values, dict):
        raise UsageError(f"--draft-config {path}: expected a mapping of config fields")
    return values


def _parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--draft-config {path}: not valid JSON ({e})") from None


def _parse_yaml(path: Path, text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise UsageError(f"--draft-config {path}: not valid YAML ({e.problem}{where})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--draft-config {path}: not valid YAML ({_reason(e)})") from None


def check_lengths(cfg: DistillConfig, target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse blocks or evaluation sequences longer than either model's context."""
    for lm in (target, draft):
        if lm.max_context is None:
            continue
        if cfg.seq_len > lm.max_context:
            raise UsageError(f"--seq-len {cfg.seq_len} exceeds the context of {lm.name!r} ({lm.max_context})")
        if EVAL_PROMPT_TOKENS + cfg.eval_tokens > lm.max_context:
            raise UsageError(
                f"--eval-tokens {cfg.eval_tokens} plus the {EVAL_PROMPT_TOKENS}-token evaluation prompt exceed "
                f"the context of {lm.name!r} ({lm.max_context})"
            )


def save_draft(model: Any, tokenizer: Any, out: Path, dtype: torch.dtype) -> None:
    """The trained draft as a Hugging Face folder in ``dtype``, with the tokenizer it shares with the target."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    export = copy.deepcopy(model).to(dtype).eval()
    export.save_pretrained(out)
    tokenizer.save_pretrained(out)
