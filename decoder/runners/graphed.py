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
- **two forms of each reduction**, both batch-invariant and capturable, a Triton one and a PyTorch one. Attention
  (``SPECD_GRAPH_ATTENTION``): ``pieces``, every sequence over its own length in one Triton kernel per layer
  (decoder/runners/piece_attention.py), or ``capacity``, each sequence over its slot's whole capacity, masked by
  position, one fixed-shape call per sequence (decoder/runners/capacity_attention.py, which says why not SDPA). The
  row-wise steps (``SPECD_GRAPH_ROWS``): ``triton``, every matrix product and RMSNorm over all of a step's rows in one
  launch whose sums do not follow the row count, q/k/v in one launch and the rotary embedding with the KV write in
  another (decoder/runners/row_kernels.py: the weights read about once per step), or ``tiles``, PyTorch's modules
  on tiles of exactly ``TILE`` rows (the invariant pass's idea, decoder/runners/invariant.py; ``TILE`` is 16, not the
  invariant pass's 8: a verification of K = 8 drafts, 9 rows, then reads the weights once). ``auto`` (the default
  for both) takes the Triton form on CUDA where Triton imports and its kernels pass a check against the PyTorch form
  when the pass is made (``GraphPass._checked``; a failure is logged and kept in ``fallbacks``), else the PyTorch
  form.

Exact by default: in either form a row's reductions are summed in an order its own values and the model's shape
fix, and elementwise steps (rotary embedding, SiLU x mul, residual adds) do not mix rows, so the bucket a token lands
in, and what shares it, cannot change its bits: alone, verified among 8, batched among 64.

Settings (environment, read once when the pass is made; ``GraphSettings.from_environ``):
``SPECD_GRAPH_K_MAX`` (default 8: widths 1..9), ``SPECD_GRAPH_CAPTURE`` (default 1: capture on CUDA; 0 runs the
eager stand-in there too, to compare), ``SPECD_GRAPH_COMPILE`` (default 0; 1, CUDA only: ``torch.compile`` of the
per-tile layer steps to fuse RMSNorm, rotary and SiLU x mul; with it ``auto`` keeps the tiles. Untested on a CPU
machine: it needs a GPU session to check it compiles once per layer and keeps the bits invariant),
``SPECD_GRAPH_ATTENTION`` (``auto``, ``pieces`` or ``capacity``), ``SPECD_GRAPH_ROWS`` (``auto``, ``triton`` or
``tiles``); a Triton form on a CPU runs under Triton's interpreter only (``TRITON_INTERPRET=1``: the tests' way);
``SPECD_GRAPH_PIECE`` (positions per piece of the ``pieces`` attention, a multiple of 64 in 64..4096; default 256),
``SPECD_GRAPH_LINEAR_BLOCKS`` (the Triton matrix product's program, ``M,N,K``, powers of two in 16..256; default
16,64,64).

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
from decoder.runners.invariant import MODULES, RowOps, by_tiles, output_and_mlp, project_qkv
from decoder.runners.kv import LlamaTensorPass, SlotTensors, why_not_plain_llama

TILE = 16  # rows per call of every row-wise step (the tiles form), and every step's row count a multiple of it
PIECE = 256  # positions per piece of the pieces attention (decoder/runners/piece_attention.py)
LINEAR_BLOCKS = (16, 64, 64)  # the Triton matrix product's program: M rows x N outputs, K per step of the sum
# each choice of the pass: its Triton form (what auto takes on CUDA) and the PyTorch form
FORMS = {"attention": ("pieces", "capacity"), "rows": ("triton", "tiles")}
IDS, POSITIONS, ROW_SLOTS, SEQ_SLOTS = range(4)  # the rows of GraphStore.table


@dataclass(frozen=True)
class GraphSettings:
    """How the graphs pass runs (module docstring, "Settings")."""

    k_max: int = DEFAULT_K_MAX
    capture: bool = True  # on CUDA; a CPU always runs the eager stand-in
    compile: bool = False
    attention: str = "auto"  # auto, or one of FORMS["attention"]
    piece: int = PIECE
    rows: str = "auto"  # auto, or one of FORMS["rows"]
    linear_blocks: tuple[int, int, int] = LINEAR_BLOCKS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GraphSettings:
        def flag(name: str, default: bool) -> bool:
            value = environ.get(name, "1" if default else "0")
            if value not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {value[:20]!r}")
            return value == "1"

        def form(what: str) -> str:
            name, value = f"SPECD_GRAPH_{what.upper()}", environ.get(f"SPECD_GRAPH_{what.upper()}", "auto")
            if value not in ("auto", *FORMS[what]):
                raise ValueError(f"{name} must be one of auto, {', '.join(FORMS[what])}, got {value[:20]!r}")
            return value

        raw = environ.get("SPECD_GRAPH_K_MAX", str(DEFAULT_K_MAX))
        if not raw.isdigit() or not 1 <= int(raw) <= 32:
            raise ValueError(f"SPECD_GRAPH_K_MAX must be a whole number in 1..32, got {raw[:20]!r}")
        piece = environ.get("SPECD_GRAPH_PIECE", str(PIECE))
        if not piece.isdigit() or not 64 <= int(piece) <= 4096 or int(piece) % 64:
            raise ValueError(f"SPECD_GRAPH_PIECE must be a multiple of 64 in 64..4096, got {piece[:20]!r}")
        blocks = environ.get("SPECD_GRAPH_LINEAR_BLOCKS", ",".join(map(str, LINEAR_BLOCKS)))
        sizes = [int(b) for b in blocks.split(",") if b.isdigit()]
        if len(sizes) != 3 or blocks.count(",") != 2 or any(not 16 <= b <= 256 or b & (b - 1) for b in sizes):
            raise ValueError(f"SPECD_GRAPH_LINEAR_BLOCKS must be M,N,K, powers of two in 16..256, got {blocks[:30]!r}")
        return cls(
            int(raw),
            flag("SPECD_GRAPH_CAPTURE", True),
            flag("SPECD_GRAPH_COMPILE", False),
            form("attention"),
            int(piece),
            form("rows"),
            (sizes[0], sizes[1], sizes[2]),
        )

    def form_on(self, what: str, device: torch.device) -> str:
        """The form of ``what`` (a key of FORMS) this pass runs on ``device``: ``auto`` resolved (the Triton form on
        CUDA where Triton imports; the compile option keeps the tiles it compiles), a choice that cannot run refused."""
        chosen, (fast, slow) = getattr(self, what), FORMS[what]
        triton_missing = triton_import_error()
        if chosen == "auto":
            compiled = what == "rows" and self.compile
            return fast if device.type == "cuda" and not triton_missing and not compiled else slow
        if chosen == fast:
            name = f"SPECD_GRAPH_{what.upper()}={fast}"
            if triton_missing:
                raise ValueError(f"{name} needs Triton: {triton_missing}")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    f"{name} runs on {device.type} only under Triton's interpreter "
                    "(TRITON_INTERPRET=1, set before Triton is imported)"
                )
            if what == "rows" and self.compile:
                raise ValueError(f"{name} and SPECD_GRAPH_COMPILE=1 exclude each other: the compile fuses the tiles")
        return chosen


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
        on = torch.device(device)
        dtype = next(model.parameters()).dtype
        shape, blocks = self.shape, self.settings.linear_blocks
        self.fallbacks: dict[str, str] = {}  # why auto did not get a Triton form it picked, by choice
        self.attention = self._checked(
            "attention",
            on,
            lambda: piece_self_check(
                shape.heads, shape.kv_heads, shape.head_dim, self.settings.k_max + 1, self.settings.piece, dtype, on
            ),
        )
        self.rows = self._checked("rows", on, lambda: row_self_check(int(model.config.hidden_size), dtype, on, blocks))
        self.ops = MODULES if self.rows == "tiles" else triton_row_ops(blocks)
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
        if self.rows == "tiles":  # (the Triton form reads the tables at each row's position itself)
            cos = store.cos.index_select(0, positions)[None]  # [1, R, d]
            sin = store.sin.index_select(0, positions)[None]
        attend = self._attention(store, positions, seq_slots, width)
        heads, kv = self.shape.heads, self.shape.kv_heads
        ops, by_rows = self.ops, self._by_rows
        for i, layer in enumerate(model.layers):
            if self.rows == "triton":  # norm, q/k/v in one launch, rotary embedding and the cache write in another
                q = self._project_and_store(layer, x, store, i, positions, row_slots)  # [R, heads, d]
            else:
                # (each lambda runs inside tiles(), within its iteration: B023's late binding cannot bite)
                projected = tiles(lambda t: self.project(self, layer, x[t], cos[:, t], sin[:, t]), rows)  # noqa: B023
                q, k, v = projected.split([heads, kv, kv], dim=1)  # [R, heads | kv | kv, d]
                store.keys[i][row_slots, :, positions] = k
                store.values[i][row_slots, :, positions] = v
            attended = attend(q, store.keys[i], store.values[i], layer.self_attn.scaling)  # [R, heads * d]
            x = by_rows(lambda t: self.finish(layer, x[t], attended[t], ops), rows)  # noqa: B023  [R, hidden]
        head = self.model.lm_head
        logits = by_rows(lambda t: ops.linear(head, ops.norm(model.norm, x[t])), rows)  # [R, vocab]
        store.logits[:rows].copy_(logits)
        return store.logits[:rows]

    def _project_and_store(
        self,
        layer: Any,
        x: torch.Tensor,
        store: GraphStore,
        i: int,
        positions: torch.Tensor,
        row_slots: torch.Tensor,
    ) -> torch.Tensor:
        """The Triton form of ``project_qkv`` and the cache write: the rotated queries; the keys and values written.
        # x: [R, hidden] -> [R, heads, d]"""
        from decoder.runners.row_kernels import linear_group, rope_and_store

        attn = layer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        h = self.ops.norm(layer.input_layernorm, x)
        qkv = linear_group(
            h, [m.weight for m in projections], [m.bias for m in projections], self.settings.linear_blocks
        )  # [R, (heads + 2 kv) * d]
        return rope_and_store(
            qkv, store.cos, store.sin, positions, row_slots, store.keys[i], store.values[i], self.shape.heads
        )

    def _by_rows(self, step: Callable[[slice], torch.Tensor], rows: int) -> torch.Tensor:
        """A row-wise step over ``rows``: in TILE-row calls (the tiles form), or in one call over all of them (the
        Triton form, whose reductions do not depend on the row count)."""
        return tiles(step, rows) if self.rows == "tiles" else step(slice(0, rows))

    def _checked(self, what: str, device: torch.device, check: Callable[[], None]) -> str:
        """The form of ``what`` (a key of FORMS) to serve with. Where ``auto`` picked the Triton form, ``check``
        compiles and runs its kernels here against PyTorch's: on any failure the PyTorch form, and why in
        ``fallbacks`` and the log (``auto`` never serves with a kernel that failed its check on this machine)."""
        form = self.settings.form_on(what, device)
        if getattr(self.settings, what) != "auto" or form != FORMS[what][0]:
            return form
        try:
            check()
        except Exception as error:  # a compiler's error has no one type: any failure means the PyTorch form
            self.fallbacks[what] = f"{type(error).__name__}: {str(error)[:300]}"
            logging.getLogger(__name__).warning(
                "graphs pass: %s %s, not %s (%s)", what, FORMS[what][1], form, self.fallbacks[what]
            )
            return FORMS[what][1]
        return form

    def _attention(
        self, store: GraphStore, positions: torch.Tensor, seq_slots: torch.Tensor, width: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """One step's attention, the same for every layer: (q, keys, values, scaling) -> [R, heads * d]."""
        padded_width = self.settings.k_max + 1
        if self.attention == "pieces":
            from decoder.runners.piece_attention import attend_pieces  # Triton: imported where it runs (so below)

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


def piece_self_check(
    heads: int, kv: int, d: int, query_rows: int, piece: int, dtype: torch.dtype, device: torch.device
) -> None:
    from decoder.runners.piece_attention import self_check

    self_check(heads, kv, d, query_rows, piece, dtype, device)


def row_self_check(hidden: int, dtype: torch.dtype, device: torch.device, blocks: tuple[int, int, int]) -> None:
    from decoder.runners.row_kernels import self_check

    self_check(hidden, dtype, device, blocks)


def triton_row_ops(blocks: tuple[int, int, int]) -> RowOps:
    """The Triton form of a layer's row-wise reductions (decoder/runners/row_kernels.py), over all rows at once: q, k
    and v in one launch, gate and up with SiLU x mul in one, each residual add in its projection's launch."""
    from decoder.runners.row_kernels import linear, linear_group, rms_norm

    def linears(modules: Sequence[Any], x: torch.Tensor) -> list[torch.Tensor]:
        out = linear_group(x, [m.weight for m in modules], [m.bias for m in modules], blocks)
        return list(out.split([int(m.weight.shape[0]) for m in modules], dim=1))

    return RowOps(
        norm=lambda module, x: rms_norm(x, module.weight, module.variance_epsilon),
        linear=lambda module, x: linear(x, module.weight, module.bias, blocks),
        linears=linears,
        onto=lambda module, x, residual, ops: linear(x, module.weight, module.bias, blocks, residual),
        gated=triton_gated(blocks),
    )


def triton_gated(blocks: tuple[int, int, int]) -> Callable[[Any, torch.Tensor, RowOps], torch.Tensor]:
    """A LlamaMLP's ``act(gate(x)) * up(x)`` in one launch (``row_kernels.gated``) where its act is SiLU and its
    projections carry no bias; else the two products in one launch and PyTorch's act and mul."""
    from decoder.runners.row_kernels import gated

    def run(mlp: Any, x: torch.Tensor, ops: RowOps) -> torch.Tensor:
        gate, up = mlp.gate_proj, mlp.up_proj
        if (
            getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu"
            and gate.bias is None
            and up.bias is None
        ):
            return gated(x, gate.weight, up.weight, blocks)
        first, second = ops.linears((gate, up), x)
        return mlp.act_fn(first) * second

    return run
