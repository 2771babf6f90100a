"""Draft trees through the pool (decoder/runners): one pass verifies a tree, the accepted path is kept.

For each pass that verifies trees (native, lean, invariant, transformers), over a tiny Llama: every row of a tree's
pass gives the logits of the chain from the root to its node, alone and beside other rows in a ragged pass; after
``keep_path`` the cache holds exactly the path, so the next step's logits are the chain's. The batch-invariant
passes (native in float32, invariant in float64) give the chain's very bits; the others (float64) agree to 1e-10.
A pass that runs chains only (graphs) refuses a tree by name.
"""

from __future__ import annotations

import pytest
import torch

from decoder.models import LoadedModel, from_objects
from decoder.runners import KVPool, PooledSequence
from decoder.runners.pool import TreesNotVerified
from decoder.tiny import build_model
from decoder.tree import ROOT, DraftTree

PROMPT = [3, 7, 1, 9, 4, 11, 2]  # its last token is the root: the prefix is cached first
TREE = DraftTree((5, 6, 2, 8, 30, 5, 7), (ROOT, ROOT, 0, 0, 3, 1, 4))  # depths 1, 1, 2, 2, 3, 2, 4
TREE_PASSES = ("native", "lean", "invariant", "transformers")
TOLERANCE = {"native": 0.0, "invariant": 0.0, "lean": 1e-10, "transformers": 1e-10}  # 0: the chain's bits


def lm(runner: str, vocab: int = 32, seed: int = 5, layers: int = 2) -> LoadedModel:
    """A tiny Llama for ``runner`` (float64 but on the native kernel, which runs float32); skipped where the native
    pass does not run."""
    model = build_model("llama", vocab, seed=seed, hidden=64, layers=layers).eval()
    if runner != "native":  # the kernel runs float32 models
        model = model.double()
    loaded = from_objects(model, None, f"tiny-{runner}", runner=runner)
    if runner == "native" and KVPool(loaded, 1).forward_pass.name != "native":
        pytest.skip("the native pass does not run here (no gcc or no AVX2)")
    return loaded


def assert_same(runner: str, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOLERANCE[runner], msg=f"{runner}, {what}")


def chain_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """The next-token logits after ``tokens``, from a fresh sequence of its own. # -> [vocab]"""
    pool = KVPool(model, 1)
    with torch.inference_mode():
        return pool.open().forward(torch.tensor(tokens))[-1]


def prefilled(pool: KVPool, prompt: list[int]) -> PooledSequence:
    seq = pool.open()
    seq.forward(torch.tensor(prompt[:-1]))
    return seq


def tree_input(tree: DraftTree, root: int) -> torch.Tensor:
    return torch.tensor([root, *tree.tokens])


@pytest.mark.parametrize("runner", TREE_PASSES)
def test_each_row_of_a_tree_pass_gives_its_chains_logits(runner):
    model = lm(runner)
    pool = KVPool(model, 1)
    seq = prefilled(pool, PROMPT)
    with torch.inference_mode():
        rows = pool.forward_many([(seq, tree_input(TREE, PROMPT[-1]))], trees=[TREE])[0]  # [n + 1, vocab]
    assert seq.length == len(PROMPT) + TREE.size
    for row in range(TREE.size + 1):
        expected = chain_logits(model, PROMPT + TREE.tokens_of(TREE.path_to(row - 1)))
        assert_same(runner, rows[row], expected, f"row {row}")


@pytest.mark.parametrize("runner", TREE_PASSES)
def test_a_tree_beside_chains_in_one_ragged_pass(runner):
    """Three sequences in one pass: a chain, the tree, a chain of another length; each gets what it gets alone."""
    model = lm(runner)
    pool = KVPool(model, 3)
    prompts = [[4, 4, 8, 1], PROMPT, [9, 2, 6, 6, 6, 3, 1, 0, 5]]
    seqs = [prefilled(pool, p) for p in prompts]
    inputs = [torch.tensor([prompts[0][-1], 12, 13]), tree_input(TREE, PROMPT[-1]), torch.tensor([prompts[2][-1]])]
    with torch.inference_mode():
        out = pool.forward_many(list(zip(seqs, inputs, strict=True)), trees=[None, TREE, None])
    for row in range(TREE.size + 1):
        expected = chain_logits(model, PROMPT + TREE.tokens_of(TREE.path_to(row - 1)))
        assert_same(runner, out[1][row], expected, f"tree row {row}")
    assert_same(runner, out[0][-1], chain_logits(model, [*prompts[0], 12, 13]), "the first chain")
    assert_same(runner, out[2][-1], chain_logits(model, prompts[2]), "the second chain")


@pytest.mark.parametrize("runner", TREE_PASSES)
@pytest.mark.parametrize("path", [(0, 3, 4, 6), (1, 5), ()], ids=["deep", "second-branch", "none"])
def test_keeping_the_accepted_path_leaves_the_chains_cache(runner, path):
    """After the pass, ``keep_path``; then one more token. Its logits are the chain's, so every kept entry holds
    the right key and value at the right place, and nothing of the other branches is seen."""
    model = lm(runner)
    pool = KVPool(model, 2)
    other = prefilled(pool, [8, 8, 1, 2, 3])  # a neighbour whose cache must not move: [8, 8, 1, 2] cached
    seq = prefilled(pool, PROMPT)
    root_entry = seq.length
    with torch.inference_mode():
        pool.forward_many([(seq, tree_input(TREE, PROMPT[-1]))], trees=[TREE])
        seq.keep_path(root_entry, TREE.kept_rows(path))
        assert seq.length == len(PROMPT) + len(path)
        after = seq.forward(torch.tensor([17]))[-1]
        neighbour = other.forward(torch.tensor([3]))[-1]
    chain = PROMPT + TREE.tokens_of(list(path))
    assert_same(runner, after, chain_logits(model, [*chain, 17]), "the token after the path")
    assert_same(runner, neighbour, chain_logits(model, [8, 8, 1, 2, 3]), "the neighbour")


def test_a_pass_of_chains_only_refuses_a_tree_by_name():
    pool = KVPool(lm("graphs"), 1)
    seq = prefilled(pool, PROMPT)
    with pytest.raises(TreesNotVerified, match="the graphs pass does not verify draft trees"):
        pool.forward_many([(seq, tree_input(TREE, PROMPT[-1]))], trees=[TREE])
    assert seq.length == len(PROMPT) - 1  # nothing was appended
