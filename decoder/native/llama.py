"""The native Llama pass (``llama_step.c``) behind decoder/runners/native.py: weights packed once, one call per pass.

``NativeLlama.create(model, why)`` returns ``None`` (and appends the reason to ``why``) for anything the kernel
does not cover (the native pass then says why, and ``auto`` runs the lean pass). Covered: a plain float32
``LlamaForCausalLM`` on a CPU with AVX2 and FMA, SiLU MLP, no biases, a rotary embedding whose tables depend on the
position only.

Weights are packed into panels of 16 outputs (``pack_panels``), as bfloat16 when every value of every matrix is
exactly a bfloat16 (the shipped reference pair is: it is stored in bf16 and loaded as float32), else as float32.
With the AVX2 build the arithmetic is float32, on the same values the model holds. With the AVX512-BF16 build
(``build.selected_isa()``) bfloat16 weights are packed by input pairs (``pack_pair_panels``) and each product
rounds its input tokens to bfloat16 first: float32 accumulation of bfloat16 products, the logits within bf16
rounding of the AVX2 build's, and batch-invariant within the build (``NativeLlama.isa`` names the one running).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from decoder.native import build

STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # cos/sin depend on the position alone
MAX_HEAD_DIM = 512  # llama_step.c's rotary scratch


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("wqkv", "wo", "wgu", "wdown", "ln1", "ln2")]


class _Model(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab")],
        ("bf16", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layer", ctypes.POINTER(_Layer)),
        *[(name, ctypes.c_void_p) for name in ("embed", "norm", "head", "cos", "sin", "keys", "values")],
        ("slots", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
    ]


# per model, per ISA build: the weights' signature when packed, and the packed copy
_PACKED: weakref.WeakKeyDictionary[Any, dict[str, tuple[tuple[tuple[int, int, float], ...], NativeLlama]]] = (
    weakref.WeakKeyDictionary()
)
_PACKED_LOCK = threading.Lock()


def _signature(model: Any) -> tuple[tuple[int, int, float], ...]:
    """Per parameter: where it lives, its version counter, and a sum over a strided sample of it (1 in 997)."""
    with torch.no_grad():
        return tuple((p.data_ptr(), p._version, float(p.reshape(-1)[::997].sum())) for p in model.parameters())


def forget(model: Any) -> None:
    """Drop the packed copy of ``model``'s weights: the next pool packs them again."""
    with _PACKED_LOCK:
        _PACKED.pop(model, None)


def _unsupported(model: Any) -> str:
    """Why the kernel does not cover ``model``; empty when it does."""
    config = model.config
    weight = model.lm_head.weight
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}).get(
        "rope_type", "default"
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    checks = [
        (weight.device.type == "cpu", f"on {weight.device}, not a CPU"),
        (weight.dtype == torch.float32, f"{weight.dtype}, not float32"),
        (getattr(config, "hidden_act", "") == "silu", f"activation {getattr(config, 'hidden_act', None)!r}"),
        (not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False), "biases"),
        (model.lm_head.bias is None, "an LM head bias"),
        (rope in STATIC_ROPE_TYPES, f"rope type {rope!r}"),
        (head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} (a multiple of 8 up to 512)"),
        (config.hidden_size % 8 == 0, f"hidden_size {config.hidden_size} (a multiple of 8)"),
        (config.intermediate_size % 8 == 0, f"intermediate_size {config.intermediate_size} (a multiple of 8)"),
        (config.num_attention_heads % config.num_key_value_heads == 0, "heads not a multiple of kv heads"),
    ]
    return next((reason for ok, reason in checks if not ok), "")


PANEL = 16  # llama_step.c's panel width
# In a bfloat16 panel the 16 outputs of one input position are stored in this order (llama_step.c's unpack)
BF16_PANEL_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def pack_panels(weight: torch.Tensor, bf16: bool) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panels of 16 outputs, input-major, zero-padded (llama_step.c)."""
    out, width = weight.shape
    padded = -(-out // PANEL) * PANEL
    if padded != out:
        weight = torch.cat([weight, weight.new_zeros(padded - out, width)])
    panels = weight.reshape(padded // PANEL, PANEL, width)
    if bf16:
        panels = panels[:, BF16_PANEL_ORDER].to(torch.bfloat16)
    return panels.transpose(1, 2).contiguous()


def pack_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in / 2, 16, 2] bfloat16: panels of 16 outputs by input pairs, zero-padded (the
    AVX512-BF16 products in llama_step.c: one ``vdpbf16ps`` takes pair q of all 16 outputs). ``in`` is even."""
    out, width = weight.shape
    padded = -(-out // PANEL) * PANEL
    if padded != out:
        weight = torch.cat([weight, weight.new_zeros(padded - out, width)])
    panels = weight.reshape(padded // PANEL, PANEL, width // 2, 2).to(torch.bfloat16)
    return panels.permute(0, 2, 1, 3).contiguous()


def _exactly_bf16(tensors: list[torch.Tensor]) -> bool:
    return all(torch.equal(t, t.to(torch.bfloat16).to(t.dtype)) for t in tensors)


@dataclass(frozen=True)
class CacheBinding:
    """A pool's cache as the kernel sees it: the pass's parameters pointing at that cache, and what they point
    into (the rotary tables it was made with; ``keys`` to tell when the pool has reallocated)."""

    model: _Model
    tables: tuple[torch.Tensor, torch.Tensor]
    keys: torch.Tensor


class NativeLlama:
    """A Llama model's weights in the kernel's layout, and its forward over a pool's cache."""

    def __init__(self, library: ctypes.CDLL, model: Any) -> None:
        config = model.config
        inner = model.model
        self._lib = library
        self._forward_rows = library.specd_llama_forward_rows
        self._forward_rows.restype = ctypes.c_int
        self._forward_rows.argtypes = [
            ctypes.POINTER(_Model), ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        ]  # fmt: skip
        self._weight_bytes = library.specd_llama_weight_bytes
        self._weight_bytes.restype = ctypes.c_int64
        self._weight_bytes.argtypes = [ctypes.POINTER(_Model)]
        built_with_dot_products = library.specd_llama_isa() == 1

        def fused(layer: Any) -> list[torch.Tensor]:
            attn, mlp = layer.self_attn, layer.mlp
            return [
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.o_proj.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight,
            ]

        with torch.inference_mode():
            matrices = [fused(layer) for layer in inner.layers]
            head = model.lm_head.weight.detach()
            self.bf16 = _exactly_bf16([m for group in matrices for m in group] + [head])
            # the dot-product build runs bfloat16 panels only; float32 panels take its AVX2 products
            self.isa = "avx512bf16" if built_with_dot_products and self.bf16 else "avx2"
            pack = pack_pair_panels if self.isa == "avx512bf16" else lambda m: pack_panels(m, self.bf16)
            self._keep: list[torch.Tensor] = []  # every buffer the kernel points into, alive as long as self
            layers = (_Layer * len(matrices))()
            for i, (layer, group) in enumerate(zip(inner.layers, matrices, strict=True)):
                wqkv, wo, wgu, wdown = (self._hold(pack(m)) for m in group)
                ln1 = self._hold(layer.input_layernorm.weight.detach().float())
                ln2 = self._hold(layer.post_attention_layernorm.weight.detach().float())
                layers[i] = _Layer(wqkv, wo, wgu, wdown, ln1, ln2)
            self._layers = layers
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self._model = _Model(
                layers=len(matrices),
                hidden=config.hidden_size,
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=head_dim,
                inter=config.intermediate_size,
                vocab=int(head.shape[0]),
                bf16=int(self.bf16),
                eps=float(config.rms_norm_eps),
                scale=float(inner.layers[0].self_attn.scaling),
                layer=layers,
                embed=self._hold(inner.embed_tokens.weight.detach().float()),
                norm=self._hold(inner.norm.weight.detach().float()),
                head=self._hold(pack(head)),
            )
        self._rotary = inner.rotary_emb
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hidden, self.vocab, self.layers = config.hidden_size, int(head.shape[0]), len(inner.layers)

    @classmethod
    def create(cls, model: Any, why: list[str] | None = None, isa: str | None = None) -> NativeLlama | None:
        """The packed weights of ``model``, shared by every pool of it (packing the shipped target takes ~30 ms,
        once, not once per request). They are repacked when a weight was replaced, written in place (torch's
        version counter), or changed where ``_signature`` samples it: a fused optimizer step (``specd distill``
        trains the draft with fused AdamW) writes the weights without moving the version counter. Code that edits
        weights in place some other way calls ``forget(model)``. ``isa``: which build (default
        ``build.selected_isa()``, the best this CPU runs or ``SPECD_NATIVE_ISA``)."""
        library = build.load(isa)
        reason = build.why_not(isa) if library is None else _unsupported(model)
        if reason or library is None:
            if why is not None:
                why.append(reason)
            return None
        signature = _signature(model)
        name = isa or build.selected_isa()
        with _PACKED_LOCK:
            per_isa = _PACKED.setdefault(model, {})
            held = per_isa.get(name)
            if held is None or held[0] != signature:
                held = (signature, cls(library, model))
                per_isa[name] = held
            return held[1]

    def _hold(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one pass reads (every matrix once; the embedding rows are negligible)."""
        return int(self._weight_bytes(ctypes.byref(self._model)))

    def bind_cache(self, keys: torch.Tensor, values: torch.Tensor) -> CacheBinding:
        """The kernel's view of one pool's cache (made again when the pool reallocates it), with rotary tables for
        every position it can hold. The packed weights are shared by every pool of a model; a binding is the
        pool's own, so two pools of one model (a target that is its own draft, a worker beside ``generate()``)
        never write into each other's cache. The pool keeps ``keys`` and ``values`` alive.

        # keys, values: [layers, slots, kv, capacity, d] float32, contiguous
        """
        assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == torch.float32
        capacity = int(keys.shape[3])
        if self._tables is None or self._tables[0].shape[0] < capacity:  # transformers' own cos/sin, bit for bit
            probe = torch.zeros(1, 1, self.hidden)
            with torch.inference_mode():
                cos, sin = self._rotary(probe, torch.arange(capacity).unsqueeze(0))
            self._tables = (cos[0].float().contiguous(), sin[0].float().contiguous())
        m = _Model.from_buffer_copy(self._model)
        m.cos, m.sin = self._tables[0].data_ptr(), self._tables[1].data_ptr()
        m.keys, m.values = keys.data_ptr(), values.data_ptr()
        m.slots, m.capacity = int(keys.shape[1]), capacity
        return CacheBinding(m, self._tables, keys)

    def forward(
        self,
        binding: CacheBinding,
        rows: list[tuple[int, int, int, int]],
        tokens: torch.Tensor,
        threads: int,
        parents: list[int] | None = None,
        tap_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append each row's tokens to its slot of the bound cache; return the logits of each row's last ``kept``,
        and every token's states entering ``tap_layers`` (None when there are none). ``parents`` (None: every row a
        chain): per token, its parent's index within its row, -1 for a row's root (a draft tree's row: each token at
        its depth's position, seeing its ancestors; llama_step.c).

        # rows[i]: (slot, start, count, kept); tokens: [sum(count)] int64, contiguous
        #   ->  [sum(kept), vocab], [sum(count), len(tap_layers) * hidden] | None
        """
        flat = [value for row in rows for value in row]
        logits = torch.empty(sum(row[3] for row in rows), self.vocab)
        tree = None if parents is None else (ctypes.c_int64 * len(parents))(*parents)
        layers = (ctypes.c_int64 * len(tap_layers))(*tap_layers) if tap_layers else None
        features = torch.empty(int(tokens.shape[0]), len(tap_layers) * self.hidden) if tap_layers else None
        status = self._forward_rows(
            ctypes.byref(binding.model),
            len(rows),
            (ctypes.c_int64 * len(flat))(*flat),
            tokens.data_ptr(),
            ctypes.cast(tree, ctypes.c_void_p) if tree is not None else None,
            logits.data_ptr(),
            ctypes.cast(layers, ctypes.c_void_p) if layers is not None else None,
            len(tap_layers),
            features.data_ptr() if features is not None else None,
            max(1, threads),
        )
        if status == -2:
            raise ValueError(f"a token id outside the vocabulary (0..{self.vocab - 1}): {tokens.tolist()[:16]}")
        if status == -3:
            raise ValueError(f"a row outside the KV cache: {rows}")
        if status == -4:
            raise ValueError(f"a token's parent is not an earlier token of its row: {(parents or [])[:64]}")
        if status == -5:
            raise ValueError(f"a tapped layer outside the model's {self.layers} layers: {list(tap_layers)}")
        if status != 0:
            raise MemoryError("the native Llama pass could not allocate its scratch memory")
        return logits, features
