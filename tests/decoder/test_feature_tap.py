"""Hidden states from the forward passes (``FeatureTap``): what a draft head reads from the verification pass.

Each pass that fills a tap (native, lean, invariant, transformers) hands, at every token of every row, the states
entering the asked layers; over a tiny Llama they equal transformers' own ``hidden_states`` of a plain forward of
the same tokens (vLLM's numbering: entry j enters layer j), for a prompt, for a ragged pass of several rows at
their own positions, and for a draft tree's rows (each node's states are its chain's). A pass without features
(graphs) and a layer outside the model are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from decoder.models import LoadedModel, from_objects
from decoder.runners import KVPool
from decoder.runners.base import FeatureTap
from decoder.runners.pool import FeaturesNotTapped
from decoder.tree import ROOT, DraftTree
from tests.decoder.test_tree_pass import lm as tree_pass_lm

LAYERS = (0, 2, 3)  # the embeddings, and the states entering the last two of 4 layers
TAP_PASSES = ("native", "lean", "invariant", "transformers")


def lm(runner: str) -> LoadedModel:
    return tree_pass_lm(runner, vocab=48, seed=11, layers=4)


def reference(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """transformers' hidden states of a plain forward over ``tokens``, the tapped layers side by side.
    # -> [n, len(LAYERS) * hidden]"""
    with torch.inference_mode():
        out = model.model(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[j][0] for j in LAYERS], dim=-1).float()


def tolerance(runner: str) -> float:
    return 2e-5 if runner == "native" else 1e-6  # float32 kernel against a float64 reference; float64 elsewhere


@pytest.mark.parametrize("runner", TAP_PASSES)
def test_a_prompts_states_are_transformers_hidden_states(runner):
    model = lm(runner)
    seq = KVPool(model, 1).open()
    tap = FeatureTap(LAYERS)
    prompt = [3, 7, 1, 9, 4, 11, 2, 5]
    with torch.inference_mode():
        seq.forward(torch.tensor(prompt[:5]), logits_to_keep=1)
        seq.forward(torch.tensor(prompt[5:]), tap=tap)  # the states of tokens after a cached prefix
    assert tap.rows is not None and len(tap.rows) == 1
    expected = reference(model, prompt)[5:]
    assert tap.rows[0].dtype == torch.float32 and tap.rows[0].shape == expected.shape
    torch.testing.assert_close(tap.rows[0], expected, rtol=0, atol=tolerance(runner), msg=runner)


@pytest.mark.parametrize("runner", TAP_PASSES)
def test_a_ragged_pass_gives_each_row_its_own_states(runner):
    model = lm(runner)
    pool = KVPool(model, 3)
    prompts = [[4, 8, 15, 16], [23, 42], [1, 2, 3, 5, 8, 13]]
    seqs = [pool.open() for _ in prompts]
    with torch.inference_mode():
        pool.forward_many([(s, torch.tensor(p[:1])) for s, p in zip(seqs, prompts, strict=True)])
        tap = FeatureTap(LAYERS)
        rows = [(s, torch.tensor(p[1:])) for s, p in zip(seqs, prompts, strict=True)]  # 3, 1 and 5 tokens: padded
        pool.forward_many(rows, logits_to_keep=1, tap=tap)
    assert tap.rows is not None
    for row, prompt in enumerate(prompts):
        expected = reference(model, prompt)[1:]
        torch.testing.assert_close(tap.rows[row], expected, rtol=0, atol=tolerance(runner), msg=f"{runner} {row}")


@pytest.mark.parametrize("runner", TAP_PASSES)
def test_a_tree_nodes_states_are_its_chains(runner):
    model = lm(runner)
    seq = KVPool(model, 1).open()
    prompt = [3, 7, 1, 9]
    tree = DraftTree((5, 6, 2, 8), (ROOT, ROOT, 0, 1))
    tap = FeatureTap(LAYERS)
    with torch.inference_mode():
        seq.forward(torch.tensor(prompt[:-1]))
        seq.forward(torch.tensor([prompt[-1], *tree.tokens]), tree=tree, tap=tap)
    assert tap.rows is not None
    for node in range(tree.size):
        chain = prompt + tree.tokens_of(tree.path_to(node))
        expected = reference(model, chain)[-1]
        torch.testing.assert_close(tap.rows[0][node + 1], expected, rtol=0, atol=tolerance(runner), msg=f"{node}")


def test_a_pass_without_features_and_a_layer_outside_the_model_are_refused():
    model = lm("lean")
    pool = KVPool(model, 1)
    with pytest.raises(ValueError, match=r"feature layers \[4\] outside 0\.\.3"):
        pool.open().forward(torch.tensor([1, 2]), tap=FeatureTap((4,)))
    graphs = KVPool(from_objects(model.model, None, "tiny-graphs", runner="graphs"), 1)
    with pytest.raises(FeaturesNotTapped, match="the graphs pass hands no hidden states"):
        graphs.open().forward(torch.tensor([1, 2]), tap=FeatureTap(LAYERS))
