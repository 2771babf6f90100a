"""Draft trees (decoder/tree.py): the shape, the verification pass through transformers, and acceptance.

The pass: every row of a tree verified in one forward over the cache gives the logits of the chain from the root to
its node. Acceptance: greedy follows the target's argmax; sampling emits the target's own distribution, checked by a
chi-square against the exact distribution of the first tokens, for children drawn from q and for children chosen
by the drafter, and a planted bug shows the test notices a wrong residual.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

import decoder.tree
from decoder.acceptance import greedy_accept
from decoder.tiny import build_model
from decoder.tree import ROOT, DraftTree, greedy_path, offered_along, sample_path
from tests.decoder.distribution import REJECT_BELOW, chi_square_pvalue, residual_is_p

# node: 0   1   2   3        row: 0 root, node i at row i + 1
# token 5   6   2   8        0 and 1 below the root; 2 and 3 below node 0
HAND = DraftTree((5, 6, 2, 8), (ROOT, ROOT, 0, 0))


def test_a_tree_refuses_a_parent_that_comes_after_its_child_or_a_missing_parent():
    with pytest.raises(ValueError, match="node 1's parent 1"):
        DraftTree((1, 2), (ROOT, 1))
    with pytest.raises(ValueError, match="node 0's parent -2"):
        DraftTree((1,), (-2,))
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        DraftTree((1, 2), (ROOT,))


def test_the_mask_positions_and_kept_rows_of_a_hand_built_tree():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0],  # node 0
            [1, 0, 1, 0, 0],  # node 1: not its sibling
            [1, 1, 0, 1, 0],  # node 2: its parent, node 0
            [1, 1, 0, 0, 1],  # node 3: node 0, not node 2
        ],
        dtype=torch.bool,
    )
    assert torch.equal(HAND.attention_mask(), expected)
    assert torch.equal(HAND.visible(3), torch.cat([torch.ones(5, 3, dtype=torch.bool), expected], dim=1))
    assert HAND.positions(10).tolist() == [10, 11, 11, 12, 12]
    assert HAND.children(ROOT) == (0, 1) and HAND.children(0) == (2, 3) and HAND.children(3) == ()
    assert [HAND.path_to(node) for node in (ROOT, 0, 1, 2, 3)] == [(), (0,), (1,), (0, 2), (0, 3)]
    assert HAND.kept_rows([0, 3]) == [0, 1, 4] and HAND.kept_rows([]) == [0]
    assert HAND.tokens_of([0, 3]) == [5, 8]
    with pytest.raises(ValueError, match="not a path"):
        HAND.kept_rows([1, 2])


def test_a_chain_is_a_tree_whose_nodes_each_hang_from_the_one_before():
    chain = DraftTree.chain([4, 4, 9])
    assert chain.parents == (ROOT, 0, 1)
    assert chain.attention_mask().equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert chain.positions(7).tolist() == [7, 8, 9, 10]


def test_greedy_follows_the_branch_the_target_chooses():
    # the target wants 5 after the root, then 8, then 1: node 0, then node 3, then the bonus token 1
    assert greedy_path(HAND, torch.tensor([5, 8, 0, 0, 1])) == decoder.tree.TreeVerdict((0, 3), 1)
    assert greedy_path(HAND, torch.tensor([6, 0, 3, 0, 0])) == decoder.tree.TreeVerdict((1,), 3)
    assert greedy_path(HAND, torch.tensor([7, 8, 0, 0, 1])) == decoder.tree.TreeVerdict((), 7)


def test_the_positions_a_round_verified_along_its_path():
    """A path's nodes, and one position more where its last node has children (all rejected): node 3 is a leaf,
    node 0 and the root have children, node 1 is a leaf."""
    assert [offered_along(HAND, path) for path in [(0, 3), (0,), (), (1,)]] == [2, 2, 1, 1]
    assert offered_along(DraftTree.chain([4, 5, 6]), (0,)) == 2  # a chain: what greedy_accept's prefix rule counts


def test_branches_merge_their_shared_prefixes_in_the_order_given():
    tree = DraftTree.of_branches([[4, 0], [1, 3], [1, 2], [4, 0, 9]])
    assert tree == DraftTree((4, 0, 1, 3, 2, 9), (ROOT, 0, ROOT, 2, 2, 1))
    assert DraftTree.of_branches([[5, 6, 7]]) == DraftTree.chain([5, 6, 7])


def test_greedy_on_a_chain_is_greedy_accept():
    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        k = int(torch.randint(0, 6, (), generator=generator))
        draft = torch.randint(0, 3, (k,), generator=generator)
        argmax = torch.randint(0, 3, (k + 1,), generator=generator)
        verdict = greedy_path(DraftTree.chain(draft.tolist()), argmax)
        expected = greedy_accept(draft, argmax)
        assert (verdict.num_accepted, verdict.next_token) == (expected.num_accepted, expected.next_token)
        assert verdict.path == tuple(range(expected.num_accepted))


def test_each_row_of_one_pass_over_the_cache_gives_its_chains_logits():
    """A tiny Llama (float64): the context cached, then the tree's rows in one forward with ``visible`` and
    ``positions``; each row against a plain causal forward over the context and the path to its node."""
    model = build_model("llama", 32, seed=5, hidden=64, layers=2).double().eval()
    context = [3, 7, 1, 9, 4, 11]  # its last token is the root
    tree = DraftTree((5, 6, 2, 8, 30, 5), (ROOT, ROOT, 0, 0, 3, 1))
    cached = len(context) - 1
    with torch.no_grad():
        past = model(torch.tensor([context[:-1]]), use_cache=True).past_key_values
        rows = model(
            torch.tensor([[context[-1], *tree.tokens]]),
            past_key_values=past,
            attention_mask=tree.visible(cached)[None, None],
            position_ids=tree.positions(cached)[None],
        ).logits[0]  # [n + 1, vocab]
        for row in range(tree.size + 1):
            chain = model(torch.tensor([context + tree.tokens_of(tree.path_to(row - 1))])).logits[0, -1]
            torch.testing.assert_close(rows[row], chain, rtol=0, atol=1e-10, msg=f"row {row}")


# ---- sampling: the emitted tokens are the target's ----------------------------------------------------------------

VOCAB, LENGTH, SAMPLES = 4, 3, 4000
Table = Callable[[tuple[int, ...]], torch.Tensor]


def conditional(seed: int, sharpness: float) -> Table:
    """A next-token distribution for every context over VOCAB tokens: random logits fixed by the context."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(context: tuple[int, ...]) -> torch.Tensor:
        if context not in cache:
            key = seed * 1_000_003 + sum((token + 1) * 5**i for i, token in enumerate(context))
            logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(key), dtype=torch.float64)
            cache[context] = torch.softmax(sharpness * logits, dim=0)
        return cache[context]

    return probs


TARGET = conditional(seed=1, sharpness=1.5)
DRAFT = conditional(seed=2, sharpness=1.0)


def exact() -> dict[tuple[int, ...], float]:
    return {
        seq: math.prod(float(TARGET(seq[:i])[seq[i]]) for i in range(LENGTH))
        for seq in itertools.product(range(VOCAB), repeat=LENGTH)
    }


def grow(context: tuple[int, ...], drawn: bool, generator: torch.Generator) -> DraftTree:
    """Two children of the root, one below each: drawn from q (``drawn``), else q's top choices."""
    if drawn:
        first = torch.multinomial(DRAFT(context), 2, replacement=True, generator=generator).tolist()
    else:
        first = torch.topk(DRAFT(context), 2).indices.tolist()
    second = []
    for token in first:
        q = DRAFT((*context, token))
        pick = torch.multinomial(q, 1, generator=generator) if drawn else torch.topk(q, 1).indices
        second.append(int(pick))
    return DraftTree((*first, *second), (ROOT, ROOT, 0, 1))


def row_contexts(tree: DraftTree, context: tuple[int, ...]) -> list[tuple[int, ...]]:
    rows = [context]
    for node, parent in enumerate(tree.parents):
        rows.append((*rows[parent + 1], tree.tokens[node]))
    return rows


def sampled_outcomes(drawn: bool, seed: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    outcomes = []
    for _ in range(SAMPLES):
        out: tuple[int, ...] = ()
        while len(out) < LENGTH:
            tree = grow(out, drawn, generator)
            contexts = row_contexts(tree, out)
            target = torch.stack([TARGET(c) for c in contexts])
            draft = torch.stack([DRAFT(c) for c in contexts]) if drawn else None
            verdict = sample_path(tree, draft, target, generator)
            out = (*out, *tree.tokens_of(verdict.path), verdict.next_token)
        outcomes.append(out[:LENGTH])
    return outcomes


@pytest.mark.parametrize("drawn", [True, False], ids=["children-drawn-from-q", "children-chosen"])
def test_sampling_down_a_tree_emits_the_targets_distribution(drawn):
    assert chi_square_pvalue(sampled_outcomes(drawn, seed=11), exact()) > REJECT_BELOW


@pytest.mark.parametrize("drawn", [True, False], ids=["children-drawn-from-q", "children-chosen"])
def test_a_residual_left_as_p_after_a_rejected_child_is_noticed(monkeypatch, drawn):
    monkeypatch.setattr(decoder.tree, "residual_distribution", residual_is_p)
    assert chi_square_pvalue(sampled_outcomes(drawn, seed=11), exact()) < REJECT_BELOW
