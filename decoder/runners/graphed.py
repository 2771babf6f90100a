"""The CUDA-graph pass (runner ``graphs``; what ``auto`` runs for a plain Llama model on a GPU): static shapes,
one captured graph per bucket, batch-invariant in any dtype.

On a GPU an eager decode step of a small model is launch-bound (922 kernels per 1-token step, 12-22 ms for a
1.1B model whose weights stream in 0.77 ms), and cuDNN's attention builds a plan per new KV length. This
pass runs every step in a bounded set of fixed shapes, so that each can be captured once and replayed:

- **a fixed-capacity store** (``GraphStore``): every slot holds ``capacity`` positions, set when the pool is made
  (at least the model's ``max_position_embeddings``) and never reallocated: graphs hold its addresses. A pass that
  would need more is refused with a ValueError naming both figures (the engine's budgets stop at the model's
  context, so a served request never meets it). One extra slot, the scratch slot, takes the keys and values of the
  padding rows, so every step writes the same number of rows;
- **static inputs**: token ids, positions, each row's slot and each sequence's slot live in one int32 table the
  step reads (``GraphStore.table``), filled by one copy per step; logits go to a static buffer;
- **buckets** (decoder/runners/buckets.py): batch 1..64 in powers of two x width 1..K_max+1; a pass outside them (a
  prefill, more than 64 rows) runs as several bucket-shaped steps, counted by reason (``outside_buckets``, exported
  in the worker's /metrics);
- **the graph manager** (decoder/runners/graph_manager.py): one ``torch.cuda.CUDAGraph`` per bucket, captured at
  first use or all at start-up (``capture_all``); on a CPU the same step runs eagerly over the same buffers;
- **attention** in one of two forms (``SPECD_GRAPH_ATTENTION``), both batch-invariant and capturable: ``pieces``,
  every sequence over its own length in one Triton kernel per layer (decoder/runners/piece_attention.py); or
  ``capacity``, each sequence over its slot's whole capacity, masked by position, one fixed-shape call per sequence
  (decoder/runners/capacity_attention.py, which says why not SDPA). ``auto`` (the default) takes ``pieces`` on CUDA
  where Triton imports, else ``capacity``.

Exact by default: every row-wise step (norms, rotary embedding, projections, MLP, LM head) runs on tiles of exactly
``TILE`` rows (the invariant pass's idea, decoder/runners/invariant.py), and attention in one shape per sequence, so
the bucket a token lands in, and what shares it, cannot change its bits: alone, verified among 8, batched among 64.
``TILE`` is 16, not the invariant pass's 8: a verification of K = 8 drafts (9 rows) then reads the weights once.

Settings (environment, read once when the pass is made; ``GraphSettings.from_environ``):
``SPECD_GRAPH_K_MAX`` (default 8: widths 1..9), ``SPECD_GRAPH_CAPTURE`` (default 1: capture on CUDA; 0 runs the
eager stand-in there too, to compare), ``SPECD_GRAPH_COMPILE`` (default 0; 1, CUDA only: ``torch.compile`` of the
per-tile layer steps to fuse RMSNorm, rotary and SiLU x mul. Untested on a CPU machine: it needs a GPU session to
check it compiles once per layer and keeps the bits invariant), ``SPECD_GRAPH_ATTENTION`` (``auto``, ``pieces`` or
``capacity``; ``pieces`` on a CPU runs under Triton's interpreter only, ``TRITON_INTERPRET=1``: the tests' way),
``SPECD_GRAPH_PIECE`` (positions per piece of the ``pieces`` attention, a multiple of 64 in 64..4096; default 256).

Shapes: ``B``/``W`` a bucket's sequences and width, ``R`` its token rows (``B * W`` padded to whole tiles),
``Q`` = K_max+1 the query rows attention pads each sequence to, ``C`` the capacity, ``T`` one tile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decoder.runners.base import KVStore, PassNotApplicable, RaggedRows
from decoder.runners.buckets import (
    BATCH_BUCKETS,
    DEFAULT_K_MAX,
    OUTSIDE_REASONS,
    Bucket,
    Step,
    all_buckets,
    batch_bucket,
    outside_reasons,
    plan_steps,
)
from decoder.runners.capacity_attention import attend_sequences, visible_positions
from decoder.runners.graph_manager import BucketGraphs
from decoder.runners.invariant import by_tiles, output_and_mlp, project_qkv
from decoder.runners.kv import LlamaTensorPass, SlotTensors, why_not_plain_llama

TILE = 16  # rows per call of every row-wise step
ATTENTIONS = ("auto", "pieces", "capacity")
PIECE = 256  # positions per piece of the pieces attention (decoder/runners/piece_attention.py)
IDS, POSITIONS, ROW_SLOTS, SEQ_SLOTS = range(4)  # the rows of GraphStore.table


@dataclass(frozen=True)
class GraphSettings:
    """How the graphs pass runs (module docstring, "Settings")."""

    k_max: int = DEFAULT_K_MAX
    capture: bool = True  # on CUDA; a CPU always runs the eager stand-in
    compile: bool = False
    attention: str = "auto"  # one of ATTENTIONS
    piece: int = PIECE

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GraphSettings:
        def flag(name: str, default: bool) -> bool:
            value = environ.get(name, "1" if default else "0")
            if value not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {value[:20]!r}")
            return value == "1"

        raw = environ.get("SPECD_GRAPH_K_MAX", str(DEFAULT_K_MAX))
        if not raw.isdigit() or not 1 <= int(raw) <= 32:
            raise ValueError(f"SPECD_GRAPH_K_MAX must be a whole number in 1..32, got {raw[:20]!r}")
        attention = environ.get("SPECD_GRAPH_ATTENTION", "auto")
        if attention not in ATTENTIONS:
            raise ValueError(f"SPECD_GRAPH_ATTENTION must be one of {', '.join(ATTENTIONS)}, got {attention[:20]!r}")
        piece = environ.get("SPECD_GRAPH_PIECE", str(PIECE))
        if not piece.isdigit() or not 64 <= int(piece) <= 4096 or int(piece) % 64:
            raise ValueError(f"SPECD_GRAPH_PIECE must be a multiple of 64 in 64..4096, got {piece[:20]!r}")
        return cls(
            int(raw), flag("SPECD_GRAPH_CAPTURE", True), flag("SPECD_GRAPH_COMPILE", False), attention, int(piece)
        )

    def attention_on(self, device: torch.device) -> str:
        """The attention this pass runs on ``device``: ``auto`` resolved, a choice that cannot run refused."""
        triton_missing = triton_import_error()
        if self.attention == "auto":
            return "pieces" if device.type == "cuda" and not triton_missing else "capacity"
        if self.attention == "pieces":
            if triton_missing:
                raise ValueError(f"SPECD_GRAPH_ATTENTION=pieces needs Triton: {triton_missing}")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    f"SPECD_GRAPH_ATTENTION=pieces runs on {device.type} only under Triton's interpreter "
                    "(TRITON_INTERPRET=1, set before Triton is imported)"
                )
        return self.attention


def triton_import_error() -> str:
    """Why Triton cannot be imported here ("" when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as error:  # the CPU wheel of torch does not bring it
        return str(error)
    return ""


def tiles(step: Callable[[slice], torch.Tensor], rows: int) -> torch.Tensor:
    """``step`` on each ``TILE``-row slice of ``rows`` (a multiple of TILE), concatenated. # -> [rows, ...]"""
    return by_tiles(step, rows, TILE)


class GraphStore(SlotTensors):
    """Fixed-capacity keys and values for ``num_slots`` sequences plus the scratch slot, and the static buffers
    every step reads and writes. Nothing here is reallocated after it is made."""

    def __init__(self, pass_: GraphPass, num_slots: int, capacity: int) -> None:
        model, k_max = pass_.model, pass_.settings.k_max
        super().__init__(model, num_slots + 1, capacity)
        self.scratch = num_slots  # padding rows write here; no sequence ever reads it
        self.k_max = k_max
        largest = batch_bucket(min(num_slots, BATCH_BUCKETS[-1])) or BATCH_BUCKETS[-1]
        self.max_rows = Bucket(largest, k_max + 1).rows(TILE)
        device = self.device
        self.table = torch.zeros(4, self.max_rows, dtype=torch.int32, device=device)  # IDS, POSITIONS, ...
        self._staging = torch.zeros(4, self.max_rows, dtype=torch.int32)  # filled on the host, copied at once
        self.capacity_index = torch.arange(capacity, dtype=torch.int32, device=device)  # [C]
        # transformers' rotary function at every position, once: cos/sin of one position do not depend on others
        probe = torch.zeros(1, dtype=self.dtype, device=device)
        cos, sin = model.model.rotary_emb(probe, torch.arange(capacity, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [C, d]
        self.logits = torch.zeros(self.max_rows, pass_.vocab_size, dtype=self.dtype, device=device)  # [R max, vocab]
        self.graphs = BucketGraphs(
            lambda bucket: pass_.step(self, bucket),
            self.aim_at_scratch,
            device,
            capture=pass_.settings.capture and device.type == "cuda",
        )

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def reserve(self, needed: int, lengths: Sequence[int]) -> None:
        """Refuse what does not fit: graphs hold this store's addresses, so it never grows."""
        if needed > self.capacity:
            raise ValueError(
                f"the graphs pass holds {self.capacity} positions per sequence (fixed when its pool was made: its "
                f"captured graphs read the KV store's addresses); this pass needs {needed}"
            )

    def aim_at_scratch(self, bucket: Bucket) -> None:
        """Every row of ``bucket`` a padding row: token 0 at position 0 of the scratch slot (before a capture)."""
        self._padding_on_host(bucket)
        n = bucket.rows(TILE)
        self.table[:, :n].copy_(self._staging[:, :n])

    def load(self, step: Step, rows: RaggedRows) -> None:
        """One step's inputs into the static table, in one copy: piece b's tokens in rows b * W..., padding (the
        scratch slot) in the rest."""
        self._padding_on_host(step.bucket)
        staging, width = self._staging, step.bucket.width
        for b, piece in enumerate(step.pieces):
            span = slice(b * width, b * width + piece.count)
            slot = rows.slots[piece.row]
            position = rows.starts[piece.row] + piece.first
            staging[IDS, span] = rows.inputs[piece.row][piece.first : piece.first + piece.count]
            staging[POSITIONS, span] = torch.arange(position, position + piece.count, dtype=torch.int32)
            staging[ROW_SLOTS, span] = slot
            staging[SEQ_SLOTS, b] = slot
        n = step.bucket.rows(TILE)
        self.table[:, :n].copy_(staging[:, :n])

    def _padding_on_host(self, bucket: Bucket) -> None:
        n = bucket.rows(TILE)
        self._staging[:, :n] = 0
        self._staging[ROW_SLOTS, :n] = self.scratch
        self._staging[SEQ_SLOTS, :n] = self.scratch


class GraphPass(LlamaTensorPass):
    """A plain Llama model's forward in bucketed fixed shapes over a ``GraphStore``, captured per bucket on CUDA."""

    name = "graphs"

    def __init__(self, model: Any, device: Any, settings: GraphSettings | None = None) -> None:
        super().__init__(model, device)
        self.settings = settings or GraphSettings()
        if self.settings.compile and torch.device(device).type != "cuda":
            raise ValueError(f"SPECD_GRAPH_COMPILE=1 compiles for CUDA only, not for {device}")
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self.attention = self.settings.attention_on(torch.device(device))
        self.attention_fallback = ""  # why ``auto`` did not get the pieces attention it picked, if it did not
        if self.attention == "pieces" and self.settings.attention == "auto":
            self.attention, self.attention_fallback = self._checked_pieces(model, torch.device(device))
        self.project: Callable[..., torch.Tensor] = project_qkv
        self.finish: Callable[..., torch.Tensor] = output_and_mlp
        if self.settings.compile:  # fuse RMSNorm, rotary and SiLU x mul per tile (untested here: module docstring)
            self.project = torch.compile(project_qkv, dynamic=False)
            self.finish = torch.compile(output_and_mlp, dynamic=False)
        # passes outside the buckets, run as several bucket-shaped steps, by reason (buckets.OUTSIDE_REASONS)
        self.outside_buckets: dict[str, int] = dict.fromkeys(OUTSIDE_REASONS, 0)

    @classmethod
    def create(cls, model: Any, device: Any) -> GraphPass:
        reason = why_not_plain_llama(model)
        if reason:
            raise PassNotApplicable(f"the graphs pass does not apply: {reason}")
        return cls(model, device, GraphSettings.from_environ(os.environ))

    def new_store(self, num_slots: int, capacity: int) -> GraphStore:
        context = getattr(self.model.config, "max_position_embeddings", None) or 0
        return GraphStore(self, num_slots, max(capacity, int(context)))

    @torch.inference_mode()
    def capture_all(self, store: KVStore) -> int:
        """Capture every bucket ``store``'s pool can use not captured yet (start-up, before serving: a capture while
        serving stalls its step); the number captured now (none on a CPU, where the eager stand-in runs)."""
        assert isinstance(store, GraphStore)
        if not store.graphs.capturing:
            return 0
        missing = [b for b in all_buckets(self.settings.k_max, store.num_slots - 1) if b not in store.graphs.captured]
        for bucket in reversed(missing):  # the largest first, as vLLM does: later ones fit in its memory
            store.graphs.ready(bucket)
        return len(missing)

    @torch.inference_mode()
    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        assert isinstance(store, GraphStore) and store.k_max == self.settings.k_max
        for reason in outside_reasons(rows.counts, self.settings.k_max):
            self.outside_buckets[reason] += 1
        kept = rows.kept(logits_to_keep)
        parts: list[list[torch.Tensor]] = [[] for _ in rows.counts]  # each row's kept logits, piece by piece
        for step in plan_steps(rows.counts, self.settings.k_max):
            store.graphs.ready(step.bucket)
            store.load(step, rows)
            store.graphs.run(step.bucket)
            wanted: list[int] = []  # the rows of store.logits to return, piece after piece
            per_piece = []
            for b, piece in enumerate(step.pieces):
                first_kept = max(piece.first, rows.counts[piece.row] - kept[piece.row])  # of the row's tokens
                wanted.extend(
                    range(b * step.bucket.width + first_kept - piece.first, b * step.bucket.width + piece.count)
                )
                per_piece.append(max(piece.first + piece.count - first_kept, 0))
            logits = store.logits.index_select(0, torch.tensor(wanted, dtype=torch.long).to(store.device))
            for piece, got in zip(step.pieces, logits.split(per_piece), strict=True):  # [kept of the piece, vocab]
                parts[piece.row].append(got)
        return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]

    def step(self, store: GraphStore, bucket: Bucket) -> torch.Tensor:
        """One bucket's step over the static buffers: append each row's token, write each row's logits to
        ``store.logits``. Only fixed shapes, no host synchronisation: what a CUDA graph captures.
        # -> store.logits[:R]: [R, vocab]"""
        model = self.model.model
        rows, batch, width = bucket.rows(TILE), bucket.batch, bucket.width
        table = store.table
        ids, positions, row_slots, seq_slots = (
            table[IDS, :rows],
            table[POSITIONS, :rows],
            table[ROW_SLOTS, :rows],
            table[SEQ_SLOTS, :batch],
        )
        x = model.embed_tokens(ids)  # [R, hidden]
        cos = store.cos.index_select(0, positions)[None]  # [1, R, d]
        sin = store.sin.index_select(0, positions)[None]
        attend = self._attention(store, positions, seq_slots, width)
        heads, kv = self.shape.heads, self.shape.kv_heads
        for i, layer in enumerate(model.layers):
            # (each lambda runs inside tiles(), within its iteration: B023's late binding cannot bite)
            projected = tiles(lambda t: self.project(self, layer, x[t], cos[:, t], sin[:, t]), rows)  # noqa: B023
            q, k, v = projected.split([heads, kv, kv], dim=1)  # [R, heads | kv | kv, d]
            store.keys[i][row_slots, :, positions] = k
            store.values[i][row_slots, :, positions] = v
            attended = attend(q, store.keys[i], store.values[i], layer.self_attn.scaling)  # [R, heads * d]
            x = tiles(lambda t: self.finish(layer, x[t], attended[t]), rows)  # noqa: B023  [R, hidden]
        head = self.model.lm_head
        logits = tiles(lambda t: head(model.norm(x[t])), rows)  # [R, vocab]
        store.logits[:rows].copy_(logits)
        return store.logits[:rows]

    def _checked_pieces(self, model: Any, device: torch.device) -> tuple[str, str]:
        """("pieces", "") where the kernels compile here and agree with the capacity attention, else ("capacity",
        why): ``auto`` never serves with an attention that did not pass its check on this machine."""
        from decoder.runners.piece_attention import self_check

        dtype = next(model.parameters()).dtype
        shape, query_rows = self.shape, self.settings.k_max + 1
        try:
            self_check(shape.heads, shape.kv_heads, shape.head_dim, query_rows, self.settings.piece, dtype, device)
        except Exception as error:  # a compiler's error has no one type: any failure means the other attention
            why = f"{type(error).__name__}: {str(error)[:300]}"
            logging.getLogger(__name__).warning("graphs pass: the capacity attention, not pieces (%s)", why)
            return "capacity", why
        return "pieces", ""

    def _attention(
        self, store: GraphStore, positions: torch.Tensor, seq_slots: torch.Tensor, width: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """One step's attention, the same for every layer: (q, keys, values, scaling) -> [R, heads * d]."""
        padded_width = self.settings.k_max + 1
        if self.attention == "pieces":
            from decoder.runners.piece_attention import attend_pieces  # Triton: imported where it runs

            piece = self.settings.piece
            return lambda q, keys, values, scaling: attend_pieces(
                q, keys, values, seq_slots, positions, width, padded_width, scaling, piece
            )
        batch = seq_slots.shape[0]
        query_positions = torch.nn.functional.pad(
            positions[: batch * width].view(batch, width), (0, padded_width - width)
        )
        visible = visible_positions(store.capacity_index, query_positions)  # [B, Q, C]
        return lambda q, keys, values, scaling: attend_sequences(q, keys, values, seq_slots, visible, width, scaling)
