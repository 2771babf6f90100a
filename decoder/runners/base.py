"""What every forward pass does: the ``ForwardPass`` interface, the ragged rows it runs, and the KV storage it keeps.

A pass runs one model step for several pooled sequences at once (decoder.runners.pool): each row appends its own
tokens to its own slot at its own position, and gets back its next-token logits. Where the keys and values live is
the pass's business (``new_store``): the Llama passes share ``SlotTensors`` (decoder/runners/kv.py), transformers'
keeps one ``DynamicCache`` per slot. The pool owns the slots and their lengths; a rollback is a length change, and
a pass reads each row's start from the pool, never from its own storage.

Shapes in the notation of ``decoder/__init__.py`` (``n_i`` row i's new tokens, ``vocab`` the logits' width).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decoder.tree import DraftTree


class PassNotApplicable(ValueError):
    """A runner was asked for that cannot run this model here; the message says why."""


@dataclass
class FeatureTap:
    """A pass's hidden states, asked for alongside its logits (what a draft head reads, decoder/heads): at every token
    of every row, the states entering each of ``layers``, in vLLM's numbering (0: the embeddings; j: layer j - 1's
    output, before the next layer's norm; each below the model's layer count). The pass fills ``rows``: per row
    [n_i, len(layers) * hidden] float32 on the model's device, its layers side by side in ``layers``' order."""

    layers: tuple[int, ...]
    rows: list[torch.Tensor] | None = None

    def fill(self, states: list[torch.Tensor]) -> None:
        """Keep the pass's states ([n_i, len(layers) * hidden] per row) as float32."""
        self.rows = [state.float() for state in states]


@dataclass(frozen=True)
class RaggedRows:
    """One pass's rows: row i appends ``inputs[i]`` ([n_i] int64) to slot ``slots[i]`` from cache entry
    ``starts[i]`` on. A row's tokens are a chain (token j at position ``starts[i] + j``, seeing those before it), or,
    where ``trees`` gives one, a root and a draft tree's nodes below it (decoder/tree.py: each token at the root's
    position plus its depth, seeing the cache and its own ancestors only; a pass takes them where ``trees`` is
    true)."""

    slots: list[int]
    inputs: list[torch.Tensor]
    starts: list[int]
    counts: list[int]  # n_i
    trees: list[DraftTree | None] | None = None  # per row; None: every row a chain
    tap: FeatureTap | None = None  # the hidden states asked for; None: logits only

    def kept(self, logits_to_keep: int) -> list[int]:
        """The logits rows each row returns: all its tokens', or its last ``logits_to_keep``."""
        return [min(n, logits_to_keep) if logits_to_keep else n for n in self.counts]

    def tree(self, row: int) -> DraftTree | None:
        """Row ``row``'s draft tree (its tokens after the first), or None for a chain."""
        return self.trees[row] if self.trees is not None else None

    def positions(self, row: int) -> list[int]:
        """Row ``row``'s tokens' positions: consecutive from its start for a chain, by depth for a tree."""
        tree, start = self.tree(row), self.starts[row]
        return list(range(start, start + self.counts[row])) if tree is None else tree.positions(start).tolist()


class KVStore(Protocol):
    """A pass's keys and values for every slot of a pool."""

    def reserve(self, needed: int, lengths: Sequence[int]) -> None:
        """Room for ``needed`` positions per slot, the first ``lengths[slot]`` of each kept."""
        ...

    def cached_keys(self, slot: int, length: int) -> list[torch.Tensor]:
        """Per layer: the first ``length`` keys ``slot`` holds, [1, kv_heads, length, head_dim]."""
        ...

    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Move entry ``start + rows[j]`` of ``slot`` to ``start + j``, for ascending ``rows`` (a tree's accepted
        path: ``DraftTree.kept_rows``); the pool sets the slot's length after it."""
        ...


class ForwardPass(Protocol):
    """How one model step runs (the glossary's "forward pass"): chosen by ``decoder.runners.select_pass``."""

    @property
    def name(self) -> str:
        """The runner that names it (decoder.choices.RUNNER_NAMES, never "auto"): what the worker's listening line
        and the benchmarks print."""
        ...

    @property
    def dtype_name(self) -> str:
        """The dtype its arithmetic runs in, as the config files name it ("float32", "bfloat16", ...)."""
        ...

    @property
    def kernel(self) -> str:
        """What runs its matrix products: "torch" (PyTorch's own), or the native build's instruction set ("avx2",
        "avx512bf16": decoder/native/build.py). Named in the listening line, /metrics and the benchmarks."""
        ...

    @property
    def trees(self) -> bool:
        """Whether ``forward`` takes rows with draft trees (``RaggedRows.trees``); the pool refuses them elsewhere."""
        ...

    @property
    def features(self) -> bool:
        """Whether ``forward`` fills a ``RaggedRows.tap`` (the hidden states a draft head reads); the pool refuses a
        tap elsewhere."""
        ...

    def new_store(self, num_slots: int, capacity: int) -> KVStore:
        """Empty KV storage for ``num_slots`` sequences of up to ``capacity`` positions (it may grow)."""
        ...

    def forward(self, store: KVStore, rows: RaggedRows, logits_to_keep: int) -> list[torch.Tensor]:
        """Append each row's tokens to its slot of ``store``; return each row's logits, [kept_i, vocab]."""
        ...

    def capture_all(self, store: KVStore) -> int:
        """Capture every step shape ``store``'s pool can run, before serving (the graphs pass's CUDA graphs on a GPU);
        the number captured now: 0 for a pass that captures nothing, and on a CPU."""
        ...
