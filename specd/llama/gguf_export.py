"""A Llama-family Hugging Face folder as one GGUF file that llama.cpp loads: the weights in float32 (a bfloat16 or
float16 checkpoint widens exactly), the architecture's hyperparameters, and the tokenizer as a GPT-2-style byte-level
BPE (its vocabulary and merges as the folder's ``tokenizer.json`` holds them).

Written with the ``gguf`` package's writer, not llama.cpp's conversion script (which refuses a tokenizer it has no
hash for). The one layout change: llama.cpp applies the rotary embedding to adjacent pairs of a head's dimensions,
transformers to its two halves, so the query and key projections' rows are reordered per head to match (the model
computes the same function).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specd_api.errors import UsageError

ARCHITECTURE = "llama"
# tokenizer.json pre-tokenizers llama.cpp's "gpt-2" pre-tokenizer reproduces: byte-level, with GPT-2's split regex.
BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
NORMAL, CONTROL = 1, 3  # gguf's token types: a vocabulary token, a special one (never produced by the text split)


@dataclass(frozen=True)
class Shape:
    """The hyperparameters llama.cpp reads from a GGUF file's metadata."""

    vocab_size: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rms_eps: float
    rope_theta: float
    tied: bool  # the output projection is the embedding (tie_word_embeddings)

    @classmethod
    def of(cls, config: dict[str, Any], source: Path) -> Shape:
        if config.get("model_type") != "llama":
            raise UsageError(f"{source}: model_type {config.get('model_type')!r}: only 'llama' exports to GGUF")
        rope = config.get("rope_parameters") or {}
        if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
            raise UsageError(f"{source}: rope scaling is not exported (only the default rotary embedding)")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise UsageError(f"{source}: biases in attention or the MLP are not exported")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            context=int(config.get("max_position_embeddings") or 2048),
            rms_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            tied=bool(config.get("tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int | None
    eos: int
    adds_bos: bool  # the tokenizer puts bos before every text (its post-processor's template)


def pairs_interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """A projection's rows reordered per head from halves (dimension i with i + d/2) to adjacent pairs (2i, 2i+1):
    row 2i of a head is its old row i, row 2i+1 its old row i + d/2."""
    rows, cols = weight.shape
    d = rows // heads
    return weight.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def vocabulary(folder: Path, vocab_size: int, config: dict[str, Any]) -> Vocabulary:
    """The byte-level BPE of ``folder/tokenizer.json``, every id below ``vocab_size`` named (ids the tokenizer does not
    use become unused control tokens, as llama.cpp expects a full table)."""
    path = folder / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the tokenizer ({e})") from None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or any(pre.get(k) != v for k, v in BYTE_LEVEL.items()):
        raise UsageError(f"{path}: only a byte-level BPE tokenizer (GPT-2 style) exports to GGUF")
    if pre.get("add_prefix_space"):
        raise UsageError(f"{path}: pre_tokenizer.add_prefix_space is true; llama.cpp's gpt-2 split adds none")
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else NORMAL)
    if max(by_id) >= vocab_size:
        raise UsageError(f"{path}: token id {max(by_id)} is beyond the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, (f"[PAD{i}]", CONTROL))[0] for i in range(vocab_size)]
    types = [by_id.get(i, ("", CONTROL))[1] for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    special = _special_ids(folder, spec, config)
    if special.get("eos_token") is None:
        raise UsageError(f"{folder}: no end-of-text token (eos_token in tokenizer_config.json, eos_token_id in "
                         "config.json): llama.cpp would stop at an ordinary token")  # fmt: skip
    adds_bos = _template_adds(spec.get("post_processor") or {})
    bos = special.get("bos_token") if adds_bos is None else adds_bos
    return Vocabulary(tokens, types, merges, bos, special["eos_token"], adds_bos is not None)


def _special_ids(folder: Path, spec: dict[str, Any], config: dict[str, Any]) -> dict[str, int]:
    """bos/eos ids: the tokenizer config names them by content (found among the added tokens or the vocabulary),
    else the model config gives their ids."""
    ids = {**spec["model"]["vocab"], **{a["content"]: int(a["id"]) for a in spec.get("added_tokens") or []}}
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = {}
    found = {}
    for name in ("bos_token", "eos_token"):
        content = tokenizer_config.get(name)
        content = content.get("content") if isinstance(content, dict) else content
        given = config.get(f"{name}_id")
        if isinstance(content, str) and content in ids:
            found[name] = int(ids[content])
        elif isinstance(given, int):
            found[name] = given
    return found


def _template_adds(post_processor: dict[str, Any]) -> int | None:
    """The id a TemplateProcessing post-processor puts before a single text, or None (it adds nothing there)."""
    if post_processor.get("type") != "TemplateProcessing":
        return None
    single = post_processor.get("single") or []
    first = single[0].get("SpecialToken") if single and isinstance(single[0], dict) else None
    if not first:
        return None
    ids = (post_processor.get("special_tokens") or {}).get(first["id"], {}).get("ids") or []
    return int(ids[0]) if ids else None


def tensors(folder: Path, shape: Shape) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, in the order llama.cpp lists them."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{folder}: no .safetensors weights")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open is not a mapping)

    def read(name: str) -> np.ndarray:
        if name not in where:
            raise UsageError(f"{folder}: weight {name!r} is missing")
        return np.ascontiguousarray(where[name].get_tensor(name).float().numpy())

    yield "token_embd.weight", read("model.embed_tokens.weight")
    for i in range(shape.layers):
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        yield f"{blk}.attn_norm.weight", read(f"{hf}.input_layernorm.weight")
        yield f"{blk}.attn_q.weight", pairs_interleaved(read(f"{hf}.self_attn.q_proj.weight"), shape.heads)
        yield f"{blk}.attn_k.weight", pairs_interleaved(read(f"{hf}.self_attn.k_proj.weight"), shape.kv_heads)
        yield f"{blk}.attn_v.weight", read(f"{hf}.self_attn.v_proj.weight")
        yield f"{blk}.attn_output.weight", read(f"{hf}.self_attn.o_proj.weight")
        yield f"{blk}.ffn_norm.weight", read(f"{hf}.post_attention_layernorm.weight")
        yield f"{blk}.ffn_gate.weight", read(f"{hf}.mlp.gate_proj.weight")
        yield f"{blk}.ffn_up.weight", read(f"{hf}.mlp.up_proj.weight")
        yield f"{blk}.ffn_down.weight", read(f"{hf}.mlp.down_proj.weight")
    yield "output_norm.weight", read("model.norm.weight")
    yield "output.weight", read("model.embed_tokens.weight" if shape.tied else "lm_head.weight")


def export(folder: Path, out: Path, name: str | None = None) -> Path:
    """Write ``folder`` (a Llama-family Hugging Face model) to the GGUF file ``out``; returns ``out``."""
    import gguf

    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{config_path}: cannot read the model's config ({e})") from None
    shape = Shape.of(config, config_path)
    vocab = vocabulary(folder, shape.vocab_size, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), ARCHITECTURE)
    writer.add_name(name or folder.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(vocab.adds_bos)  # as transformers' tokenizer does (a byte-level post-processor: no)
    writer.add_add_eos_token(False)
    for tensor_name, data in tensors(folder, shape):
        writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
