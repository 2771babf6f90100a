"""How a head's layer runs for one sequence: in the native kernel (``specd_eagle_forward`` in
decoder/native/llama_step.c: one call per feed or drafting step) where it applies, else in PyTorch (``HeadCache``).

Both keep the sequence's cache of the head's layer (entry p at row p; a rollback is a length change) and answer the
same two calls: ``feed`` (entries from the target's states: projected by ``fc`` first) and ``step`` (one entry from
the head's own output), each returning the last entry's output and its draft-vocabulary logits. The native form
packs the weights like the target's (bfloat16 panels when every value is a bfloat16, as a stored head's are) and
covers float32 heads on a CPU with the native library, every size a multiple of 8.

Shapes in the notation of ``decoder/__init__.py``; ``f`` the target's features per token.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Protocol

import torch

from decoder.heads.model import EagleHead, HeadCache
from decoder.native import build
from decoder.native.llama import MAX_HEAD_DIM, _exactly_bf16, _signature, pack_pair_panels, pack_panels


class HeadRunner(Protocol):
    @property
    def length(self) -> int: ...

    def feed(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append entries from the target's states.  # features: [n, f], tokens: [n] -> [1, hidden], [1, draft]"""
        ...

    def step(self, out: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one entry from the head's own output.  # out: [1, hidden], token: [1] -> as ``feed``"""
        ...

    def truncate(self, length: int) -> None: ...


class TorchRunner:
    """The head's layer in PyTorch (any device and dtype)."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.cache = HeadCache(head)

    @property
    def length(self) -> int:
        return self.cache.length

    def feed(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.cache.forward(self.head.fc(features), tokens)[-1:]
        return out, self.head.draft_logits(out)

    def step(self, out: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.cache.forward(out, token)
        return out, self.head.draft_logits(out)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


class _Head(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "draft_vocab",
                                              "features", "bf16", "norm_before_residual")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("fc", "fc_bias", "wqkv", "wo", "wgu", "wdown", "ln_in", "ln_hidden",
                                               "ln_post", "norm", "head", "embed", "cos", "sin", "keys", "values")],
        ("capacity", ctypes.c_int64),
    ]  # fmt: skip


class NativeHead:
    """A head's weights packed for the kernel, shared by every sequence's ``NativeRunner``."""

    def __init__(self, library: ctypes.CDLL, head: EagleHead) -> None:
        s = head.shape
        layer = head.layer
        attn, mlp = layer.self_attn, layer.mlp
        self.head = head
        self._call = library.specd_eagle_forward
        self._call.restype = ctypes.c_int
        self._call.argtypes = [ctypes.POINTER(_Head), ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        with torch.inference_mode():
            matrices = [
                head.fc.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight,
                head.lm_head.weight,
            ]  # fmt: skip
            bf16 = _exactly_bf16([m.detach() for m in matrices])
            dot_products = library.specd_llama_isa() == 1 and bf16
            pack = pack_pair_panels if dot_products else lambda m: pack_panels(m, bf16)
            self._keep: list[torch.Tensor] = []
            fc, wqkv, wo, wgu, wdown, lm_head = (self._hold(pack(m.detach().float())) for m in matrices)
            self.weights = _Head(
                hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, inter=s.intermediate,
                draft_vocab=s.draft_vocab, features=s.features, bf16=int(bf16),
                norm_before_residual=int(s.norm_before_residual), eps=s.rms_eps, scale=s.head_dim**-0.5,
                fc=fc, fc_bias=self._hold(head.fc.bias.detach().float()), wqkv=wqkv, wo=wo, wgu=wgu, wdown=wdown,
                ln_in=self._hold(layer.input_layernorm.weight.detach().float()),
                ln_hidden=self._hold(layer.hidden_norm.weight.detach().float()),
                ln_post=self._hold(layer.post_attention_layernorm.weight.detach().float()),
                norm=self._hold(head.norm.weight.detach().float()), head=lm_head,
                embed=self._hold(head.embed_tokens.weight.detach().float()),
            )  # fmt: skip
        self.hidden, self.draft_vocab = s.hidden, s.draft_vocab

    @classmethod
    def create(cls, head: EagleHead) -> NativeHead | None:
        """The packed head, or None where the kernel does not cover it (not float32 on a CPU, sizes not multiples
        of 8, a head dim over the kernel's rotary scratch, no native library)."""
        s = head.shape
        weight = head.fc.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if any(size % 8 for size in (s.hidden, s.head_dim, s.intermediate, s.features)) or s.head_dim > MAX_HEAD_DIM:
            return None
        library = build.load()
        return None if library is None else cls(library, head)

    def _hold(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def forward(self, runner: NativeRunner, tokens: torch.Tensor, features: torch.Tensor | None,
                fused: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Append ``tokens``' entries to ``runner``'s cache; the last one's output and logits."""
        n = int(tokens.shape[0])
        runner.reserve(runner.length + n)
        tokens = tokens.to(torch.long).contiguous()
        given = features if features is not None else fused
        assert given is not None
        given = given.float().contiguous()
        out = torch.empty(n, self.hidden)
        logits = torch.empty(1, self.draft_vocab)
        status = self._call(
            ctypes.byref(runner.weights), n, tokens.data_ptr(),
            given.data_ptr() if features is not None else None, given.data_ptr() if fused is not None else None,
            runner.length, out.data_ptr(), logits.data_ptr(), max(1, torch.get_num_threads()),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the native head could not allocate its scratch memory")
        runner.length += n
        return out[-1:], logits


class NativeRunner:
    """One sequence's cache of the head's layer (a ``HeadCache``'s tensors), run by the kernel."""

    def __init__(self, native: NativeHead) -> None:
        self.native = native
        self.cache = HeadCache(native.head)
        self._bind()

    @property
    def length(self) -> int:
        return self.cache.length

    @length.setter
    def length(self, length: int) -> None:
        self.cache.length = length

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` entries; the kernel's arguments follow the cache when it grows."""
        if needed > self.cache.capacity:
            self.cache.reserve(needed)
            self._bind()

    def _bind(self) -> None:
        """The kernel's arguments: the shared weights, this sequence's cache and rotary tables for its capacity."""
        cache = self.cache
        cos, sin = self.native.head.rotary(torch.arange(cache.capacity))
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        weights = _Head.from_buffer_copy(self.native.weights)
        weights.cos, weights.sin = self.cos.data_ptr(), self.sin.data_ptr()
        weights.keys, weights.values = cache.keys.data_ptr(), cache.values.data_ptr()
        weights.capacity = cache.capacity
        self.weights = weights

    def feed(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.native.forward(self, tokens, features, None)

    def step(self, out: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.native.forward(self, token, None, out)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


# per head: its weights' signature when packed, and the packed copy (None: the kernel does not cover it)
_PACKED: weakref.WeakKeyDictionary[EagleHead, tuple[Any, NativeHead | None]] = weakref.WeakKeyDictionary()
_PACKED_LOCK = threading.Lock()


def runner_for(head: EagleHead) -> HeadRunner:
    """One sequence's runner: the kernel's where it covers the head (packed once per head, again when its weights
    changed, as a head in training does), else PyTorch's."""
    signature = _signature(head)
    with _PACKED_LOCK:
        held = _PACKED.get(head)
        if held is None or held[0] != signature:
            held = (signature, NativeHead.create(head))
            _PACKED[head] = held
    native = held[1]
    return NativeRunner(native) if native is not None else TorchRunner(head)
