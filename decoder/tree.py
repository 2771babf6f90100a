"""A round's draft as a tree of candidates: its shape, the one target pass that verifies it, the path it accepts.

A tree holds ``n`` nodes below its root, the last token already emitted. Node i carries a token and its parent (-1:
the root), and a parent comes before its children. The target verifies the whole tree in one pass over n + 1 rows:
row 0 is the root, row i + 1 node i; each row sees the context, its ancestors and itself only (``attention_mask``),
at the position its depth gives (``positions``). A row's logits are then those of the chain from the root to its
node, and the pass costs what n + 1 rows cost, whatever the tree's shape. A chain is the tree whose node i is the
child of node i - 1 (``DraftTree.chain``).

Acceptance walks one path down from the root, one row at a time:

- **greedy** (``greedy_path``): to the child whose token is the target's argmax at the current row, while there is
  one; the bonus token is the argmax at the last row reached. On a chain this is ``greedy_accept``'s verdict.
- **sampling** (``sample_path``): at the current row, with r the target's distribution there, the node's children
  are tried in order, each kept with probability min(1, r(x) / q(x)); after a rejection r becomes
  norm(max(0, r - q)) and the next child is tried. A kept child is where the walk goes next; when every child is
  rejected, or the node has none, the bonus token is drawn from r. q is the distribution the drafter drew that
  node's children from, independently (multi-draft speculative sampling, SpecInfer, Miao et al. 2024); for children
  the drafter chose as a function of the text (``draft_probs`` None: prompt lookup's matches, a head's top-k), q is
  one-hot at each child, so a child is kept with probability r(x) and a rejected token leaves r. Either way the
  emitted tokens are distributed exactly as the target samples them. On a chain this is ``rejection_sample``.

The accepted path's rows (``DraftTree.kept_rows``) are the ones whose keys and values stay in the cache, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoder.acceptance import residual_distribution

ROOT = -1  # a node's parent when it hangs from the root


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens in a tree: node i is ``tokens[i]`` below ``parents[i]`` (``ROOT``, or an earlier node)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    _children: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _paths: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        children: dict[int, list[int]] = {ROOT: []}
        paths: list[tuple[int, ...]] = []
        for node, parent in enumerate(self.parents):
            if not ROOT <= parent < node:
                raise ValueError(f"a draft tree: node {node}'s parent {parent} is neither the root (-1) nor earlier")
            children.setdefault(parent, []).append(node)
            children[node] = []
            paths.append((*(paths[parent] if parent != ROOT else ()), node))
        object.__setattr__(self, "_children", {node: tuple(kids) for node, kids in children.items()})
        object.__setattr__(self, "_paths", tuple(paths))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """The tree of a plain draft: each token below the one before it."""
        return cls(tuple(tokens), tuple(range(ROOT, len(tokens) - 1)))

    @classmethod
    def of_branches(cls, branches: Sequence[Sequence[int]]) -> DraftTree:
        """The tree whose paths from the root are ``branches``, shared prefixes merged: a node's children in the
        order their branches come (the first branch's first), so acceptance tries earlier branches first."""
        tokens: list[int] = []
        parents: list[int] = []
        below: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in branches:
            node = ROOT
            for token in branch:
                child = below.get((node, token))
                if child is None:
                    child = below[(node, token)] = len(tokens)
                    tokens.append(int(token))
                    parents.append(node)
                node = child
        return cls(tuple(tokens), tuple(parents))

    @property
    def size(self) -> int:
        """Nodes below the root: the pass verifies ``size + 1`` rows."""
        return len(self.tokens)

    def children(self, node: int) -> tuple[int, ...]:
        """``node``'s children (``ROOT``: the root's), in the order acceptance tries them."""
        return self._children[node]

    def depth(self, node: int) -> int:
        """Tokens from the root down to ``node``: 1 for the root's children."""
        return len(self._paths[node])

    def path_to(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to ``node`` (none for ``ROOT``): the ones its row sees."""
        return () if node == ROOT else self._paths[node]

    def attention_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Which of the pass's rows each row sees besides the context: itself and its ancestors, the root always.
        # -> [n + 1, n + 1] bool, row and column 0 the root"""
        sees = torch.eye(self.size + 1, dtype=torch.bool)
        sees[:, 0] = True
        for node, parent in enumerate(self.parents):
            sees[node + 1] |= sees[parent + 1]  # a parent's row is complete before its children's: parent < node
        return sees.to(device)

    def visible(self, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The verification pass's mask over the cache: ``context`` positions already cached (the root's excluded),
        seen by every row, then the tree's rows as ``attention_mask`` says. # -> [n + 1, context + n + 1] bool"""
        tree = self.attention_mask(device)
        return torch.cat([torch.ones(self.size + 1, context, dtype=torch.bool, device=device), tree], dim=1)

    def positions(self, root_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Each row's position: the root's, plus its node's depth. # -> [n + 1] int64"""
        return torch.tensor((root_position, *(root_position + len(p) for p in self._paths)), device=device)

    def kept_rows(self, path: Sequence[int]) -> list[int]:
        """The rows whose keys and values stay once ``path`` is accepted: the root's, then each node's on it."""
        node = ROOT
        for step in path:
            if step not in self.children(node):
                raise ValueError(f"a draft tree: node {step} is not a child of {node}: {list(path)} is not a path")
            node = step
        return [0, *(step + 1 for step in path)]

    def tokens_of(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[node] for node in path]


@dataclass(frozen=True, slots=True)
class TreeVerdict:
    """A verified tree's outcome: the accepted nodes, root's child first, and the bonus token after them."""

    path: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def offered_along(tree: DraftTree, path: Sequence[int]) -> int:
    """The draft positions a round verified along its accepted ``path``: the path's nodes, and one more where its
    last node has children (all rejected). What a chain of that many tokens with the same verdict counts, so α per
    position reads a tree's round as it reads a chain's."""
    return len(path) + bool(tree.children(path[-1] if path else ROOT))


def greedy_path(tree: DraftTree, target_argmax: torch.Tensor) -> TreeVerdict:
    """Down the children that equal the target's argmax. # target_argmax: [n + 1] int64, one per row"""
    assert target_argmax.shape == (tree.size + 1,), f"{tuple(target_argmax.shape)} != ({tree.size + 1},)"
    argmax = target_argmax.tolist()
    node, path = ROOT, list[int]()
    while True:
        wanted = argmax[node + 1]
        found = next((child for child in tree.children(node) if tree.tokens[child] == wanted), None)
        if found is None:
            return TreeVerdict(tuple(path), wanted)
        path.append(found)
        node = found


def sample_path(
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeVerdict:
    """Recursive rejection sampling down the tree: the emitted tokens are distributed exactly as the target's.

    # draft_probs:  [n + 1, vocab] the q each row's children were drawn from, or None (children chosen, one-hot q)
    # target_probs: [n + 1, vocab] the target's p at each row, after the same temperature / top-k / top-p
    """
    rows = tree.size + 1
    assert target_probs.dim() == 2 and target_probs.shape[0] == rows, tuple(target_probs.shape)
    if draft_probs is not None:
        assert draft_probs.shape == target_probs.shape, f"{tuple(draft_probs.shape)} != {tuple(target_probs.shape)}"
    node, path = ROOT, list[int]()
    while True:
        residual = target_probs[node + 1]
        q = draft_probs[node + 1] if draft_probs is not None else None
        kept = None
        for child in tree.children(node):
            token = tree.tokens[child]
            q_token = float(q[token]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator, device=target_probs.device))
            if u * q_token < float(residual[token]):  # u < r(x) / q(x), with no division by zero
                kept = child
                break
            residual = residual_distribution(residual, q, token)
        if kept is None:
            return TreeVerdict(tuple(path), int(torch.multinomial(residual, num_samples=1, generator=generator)))
        path.append(kept)
        node = kept
