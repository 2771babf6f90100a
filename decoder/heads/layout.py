"""Draft heads on disk, in the speculators layout: a folder with ``config.json`` and ``model.safetensors``.

``config.json`` holds the head's layer (``transformer_layer_config``: a Llama layer's sizes, ``vocab_size`` the
target's), ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``, the target layers it reads
(``eagle_aux_hidden_state_layer_ids``, vLLM's numbering) and ``speculators_config`` (``algorithm`` "eagle3", the
``verifier`` it was trained on: ``name_or_path`` and ``architectures``). A head loads only for its verifier: the
last part of the verifier's name must be the target folder's name, and its sizes the target's; anything else is
refused with the file, the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoder.heads.model import EagleHead, HeadShape
from decoder.models import LoadedModel
from specd_api.errors import ModelLoadError

ALGORITHM = "eagle3"
WEIGHTS = "model.safetensors"
EMBEDDINGS = "embed_tokens.weight"  # left out of a head that shares its verifier's: the target's are taken


@dataclass(frozen=True)
class LoadedHead:
    """A draft head ready to draft for its target: its weights in eval mode, and where it came from."""

    head: EagleHead
    verifier: str  # the verifier's name_or_path it was trained on
    name: str  # the folder it came from, for messages

    @property
    def shape(self) -> HeadShape:
        return self.head.shape


def default_aux_layers(target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none: a low, a middle and a late one (vLLM's
    default, 2, L // 2, L - 3), each kept inside the model."""
    return tuple(min(max(layer, 0), target_layers - 1) for layer in (2, target_layers // 2, target_layers - 3))


def head_config(shape: HeadShape, verifier: str, architectures: list[str], k: int = 5) -> dict[str, Any]:
    """The ``config.json`` of a head of ``shape`` trained on ``verifier``."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": ALGORITHM,
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": shape.hidden,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate,
            "rms_norm_eps": shape.rms_eps,
            "rope_theta": shape.rope_theta,
            "vocab_size": shape.vocab,
            "num_hidden_layers": 1,
        },
        "draft_vocab_size": shape.draft_vocab,
        "target_hidden_size": shape.target_hidden,
        "norm_before_residual": shape.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(shape.aux_layers),
        "speculators_config": {
            "algorithm": ALGORITHM,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
    }


def save_head(
    head: EagleHead, folder: Path, verifier: str, architectures: list[str], shares_embeddings: bool = False
) -> None:
    """Write ``head`` into ``folder`` in the speculators layout, its weights in bfloat16 (as the targets ship);
    ``shares_embeddings``: its embeddings are the verifier's own, left out (a loader takes the target's)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = head_config(head.shape, verifier, architectures)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {
        name: (value.bfloat16() if value.is_floating_point() else value).detach().contiguous().cpu()
        for name, value in head.state_dict().items()
        if not (shares_embeddings and name == EMBEDDINGS)
    }
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})


def load_head(folder: str | Path, target: LoadedModel) -> LoadedHead:
    """The head in ``folder``, checked against ``target`` and placed on its device in float32 (its weights'
    own dtype on a GPU). Raises ModelLoadError naming the file, the field and the reason."""
    path = Path(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"head {str(path)!r}: no config.json (not a speculators-layout folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_file}: not JSON: {e}") from None
    shape, verifier = parse_config(config, config_file, target.num_layers)
    check_verifier(shape, verifier, target, config_file)
    head = EagleHead(shape)
    load_weights(head, path / WEIGHTS, target)
    dtype = torch.float32 if target.device.type == "cpu" else next(target.model.parameters()).dtype
    head = head.to(device=target.device, dtype=dtype).eval()
    return LoadedHead(head, verifier, str(path))


def parse_config(config: Any, where: Path, target_layers: int) -> tuple[HeadShape, str]:
    """The head's shape and verifier name from its ``config.json`` (``where``, for messages)."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: the top level must be an object")
    spec = _field(config, "speculators_config", dict, where)
    algorithm = spec.get("algorithm")
    if algorithm != ALGORITHM:
        raise ModelLoadError(f"{where}: field speculators_config.algorithm: {algorithm!r} is not {ALGORITHM!r}")
    verifier = _field(_field(spec, "verifier", dict, where, "speculators_config."), "name_or_path", str, where,
                      "speculators_config.verifier.")  # fmt: skip
    layer = _field(config, "transformer_layer_config", dict, where)
    prefix = "transformer_layer_config."
    hidden = _positive(layer, "hidden_size", where, prefix)
    heads = _positive(layer, "num_attention_heads", where, prefix)
    rope = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else layer
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = default_aux_layers(target_layers)
    elif not (isinstance(aux, list) and aux and all(type(a) is int and a >= 0 for a in aux)):
        raise ModelLoadError(f"{where}: field eagle_aux_hidden_state_layer_ids: not a list of layer numbers")
    shape = HeadShape(
        hidden=hidden,
        heads=heads,
        kv_heads=_positive(layer, "num_key_value_heads", where, prefix),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate=_positive(layer, "intermediate_size", where, prefix),
        vocab=_positive(layer, "vocab_size", where, prefix),
        draft_vocab=_positive(config, "draft_vocab_size", where),
        target_hidden=int(config.get("target_hidden_size") or hidden),
        aux_layers=tuple(aux),
        rms_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )
    if shape.draft_vocab > shape.vocab:
        raise ModelLoadError(f"{where}: field draft_vocab_size: {shape.draft_vocab} is over the vocabulary's "
                             f"{shape.vocab}")  # fmt: skip
    return shape, verifier


def check_verifier(shape: HeadShape, verifier: str, target: LoadedModel, where: Path) -> None:
    """Refuse a head trained for another model: by the verifier's name, then by the sizes it reads."""
    wanted, have = _last_part(verifier), _last_part(target.name)
    if wanted != have:
        raise ModelLoadError(
            f"{where}: field speculators_config.verifier.name_or_path: the head was trained for {verifier!r}, "
            f"not for the target {target.name!r}"
        )
    mismatches: list[tuple[str, object, object]] = [
        (field, ours, theirs)
        for field, ours, theirs in (
            ("target_hidden_size", shape.target_hidden, target.hidden_size),
            ("transformer_layer_config.vocab_size", shape.vocab, target.vocab_size),
        )
        if ours != theirs
    ]
    if any(layer >= target.num_layers for layer in shape.aux_layers):
        mismatches.append(("eagle_aux_hidden_state_layer_ids", list(shape.aux_layers), target.num_layers))
    if mismatches:
        field, ours, theirs = mismatches[0]
        raise ModelLoadError(f"{where}: field {field}: the head has {ours}, the target {target.name!r} {theirs}")


def load_weights(head: EagleHead, file: Path, target: LoadedModel) -> None:
    """Fill ``head`` from ``file``: every weight it has, of its shape; a missing or misshapen one is named. Missing
    embeddings are the target's (a head of the target's width shares them)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"{file}: cannot read the weights: {e}") from None
    own = head.state_dict()
    if EMBEDDINGS not in state and head.shape.hidden == target.hidden_size:
        state[EMBEDDINGS] = target.model.get_input_embeddings().weight.detach().float().cpu()
    for name, value in own.items():
        if name not in state:
            raise ModelLoadError(f"{file}: tensor {name!r} is missing")
        if tuple(state[name].shape) != tuple(value.shape):
            raise ModelLoadError(f"{file}: tensor {name!r} is {list(state[name].shape)}, the config says "
                                 f"{list(value.shape)}")  # fmt: skip
    head.load_state_dict({name: state[name] for name in own}, strict=True)


def _last_part(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _field(mapping: dict[str, Any], name: str, kind: type, where: Path, prefix: str = "") -> Any:
    value = mapping.get(name)
    if not isinstance(value, kind):
        raise ModelLoadError(f"{where}: field {prefix}{name}: missing or not a {kind.__name__}")
    return value


def _positive(mapping: dict[str, Any], name: str, where: Path, prefix: str = "") -> int:
    value = mapping.get(name)
    if type(value) is not int or value < 1:
        raise ModelLoadError(f"{where}: field {prefix}{name}: {value!r} is not a positive integer")
    return value
