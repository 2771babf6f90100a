"""Rounds that verify a tree (prompt lookup with ``branches``): exact greedy and sampled, alone and batched.

Prompt lookup with ``branches`` 3 proposes the continuations of up to three earlier matches as one tree. Greedy,
the output is target-only's token for token on every pass that verifies trees (native, lean, invariant,
transformers), one sequence at a time and in a batch; sampled, the tokens after the first are distributed as the
target's (chi-square against the exact distribution by enumeration), and fail with a planted residual bug. A pass
that runs chains only (graphs) gets chains.
"""

from __future__ import annotations

import random

import pytest
import torch

import decoder.tree
from decoder.batch_engine import BatchEngine
from decoder.drafters import EMPTY_TOKENS, Draft, Drafter, PromptLookupConfig, PromptLookupDrafter
from decoder.engine import SpeculativeDecoder
from decoder.models import LoadedModel, from_objects
from decoder.request_stop import StopConditions
from decoder.runners import PooledSequence
from decoder.sampling import SamplingParams
from decoder.tiny import build_model, build_tokenizer
from decoder.tree import DraftTree
from specd_api.plan import requested
from tests.decoder.distribution import (
    REJECT_BELOW,
    chi_square_pvalue,
    exact_after_first,
    residual_is_p,
    small_vocab_lm,
    small_vocab_tokenizer,
)

BRANCHES = PromptLookupConfig(branches=3)
TREE_PASSES = ("native", "lean", "invariant", "transformers")
RULES = StopConditions(max_new_tokens=24)


def lm(runner: str) -> LoadedModel:
    tokenizer = build_tokenizer()
    model = build_model("llama", len(tokenizer), seed=2, hidden=64, layers=2).eval()
    if runner != "native":  # the kernel runs float32 models
        model = model.double()
    return from_objects(model, tokenizer, f"tiny-{runner}", runner=runner)


def prompts(target: LoadedModel) -> list[list[int]]:
    """Prompts whose n-grams recur with different followers, and one that holds its own greedy continuation twice
    over with a detour between (lookup's matches: the continuation, and the detour)."""
    rng = random.Random(7)
    found = [[rng.randrange(1, 6) for _ in range(rng.randint(12, 30))] for _ in range(3)]
    plain = SpeculativeDecoder(target)
    head = found[0][:6]
    out = plain.generate(head, "none", 0, SamplingParams(), RULES).token_ids
    found.append(head + out[:8] + head + [7, 9, 11] + head + out + head)
    return found


def test_lookup_proposes_the_matches_as_one_tree_merging_shared_prefixes():
    drafter = PromptLookupDrafter(PromptLookupConfig(min_ngram=1, max_ngram=1, branches=3), trees=True)
    # 7 followed by 1 2 (at 0), by 1 3 (at 3) and by 4 (at 6); the latest match first
    draft = drafter.propose(torch.tensor([7, 1, 2, 7, 1, 3, 7, 4, 0, 7]), 2)
    assert draft.tree == DraftTree((4, 0, 1, 3, 2), (-1, 0, -1, 2, 2))
    assert draft.tokens.tolist() == [4, 0, 1, 3, 2]
    chain_only = PromptLookupDrafter(PromptLookupConfig(min_ngram=1, max_ngram=1, branches=3), trees=False)
    assert chain_only.propose(torch.tensor([7, 1, 2, 7, 1, 3, 7, 4, 0, 7]), 2).tree is None


@pytest.fixture
def tree_rounds(monkeypatch) -> list[int]:
    """Counts the rounds that kept a tree's path (``PooledSequence.keep_path``), by the number of rows kept."""
    kept: list[int] = []
    keep_path = PooledSequence.keep_path

    def counted(self, root_entry, rows):
        kept.append(len(rows))
        keep_path(self, root_entry, rows)

    monkeypatch.setattr(PooledSequence, "keep_path", counted)
    return kept


@pytest.mark.parametrize("runner", TREE_PASSES)
def test_greedy_tree_rounds_emit_target_only_output(runner, tree_rounds):
    target = lm(runner)
    if runner == "native" and BatchEngine(target, max_batch=1).target_pool.forward_pass.name != "native":
        pytest.skip("the native pass does not run here (no gcc or no AVX2)")
    alone = SpeculativeDecoder(target, prompt_lookup=BRANCHES)
    batched = BatchEngine(target, prompt_lookup=BRANCHES, max_batch=4)
    cases = prompts(target)
    expected = [alone.generate(p, "none", 0, SamplingParams(), RULES).token_ids for p in cases]
    for k in (2, 5):
        for prompt, want in zip(cases, expected, strict=True):
            got = alone.generate(prompt, "prompt_lookup", k, SamplingParams(), RULES)
            assert got.token_ids == want, f"{runner} K={k} prompt={prompt}"
        alone_trees, tree_rounds[:] = list(tree_rounds), []
        sessions = [batched.open(p, SamplingParams(), RULES, requested("prompt_lookup", k)) for p in cases]
        while any(s.finish_reason is None for s in sessions):
            batched.step([s for s in sessions if s.finish_reason is None])
        assert [s.generated for s in sessions] == expected, f"{runner} K={k}, batched"
        for s in sessions:
            batched.close(s)
        # trees were verified alone and in the batch, and some kept more than the root (a node accepted)
        assert max(alone_trees, default=0) > 1 and max(tree_rounds, default=0) > 1, (k, alone_trees, tree_rounds)
        tree_rounds[:] = []


class SecondBranchOracle(Drafter):
    """Proposes two branches each round: a wrong one first, then the target's own greedy continuation (known in
    advance), so every accepted token lies on a tree's second branch."""

    name = "prompt_lookup"

    def __init__(self, prompt_length: int, continuation: list[int], vocab: int) -> None:
        self.prompt_length, self.continuation, self.vocab = prompt_length, continuation, vocab

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        done = int(context.shape[0]) - self.prompt_length
        right = self.continuation[done : done + k]
        if not right:
            return Draft(EMPTY_TOKENS)
        tree = DraftTree.of_branches([[(t + 1) % self.vocab for t in right], right])
        return Draft(torch.tensor(tree.tokens), tree=tree)


@pytest.mark.parametrize("runner", TREE_PASSES)
def test_paths_down_a_later_branch_are_verified_and_kept(runner):
    """Alone and in a batch of three: the output is target-only's, and the rounds accepted along second branches
    (a pass that verified the tree as one chain would give those nodes the first branch's context)."""
    target = lm(runner)
    if runner == "native" and BatchEngine(target, max_batch=1).target_pool.forward_pass.name != "native":
        pytest.skip("the native pass does not run here (no gcc or no AVX2)")
    vocab = len(target.tokenizer)
    cases = prompts(target)[:3]
    plain = SpeculativeDecoder(target)
    expected = [plain.generate(p, "none", 0, SamplingParams(), RULES).token_ids for p in cases]
    alone = SpeculativeDecoder(target, prompt_lookup=BRANCHES)
    batched = BatchEngine(target, prompt_lookup=BRANCHES, max_batch=3)
    sessions = [batched.open(p, SamplingParams(), RULES, requested("prompt_lookup", 4)) for p in cases]
    for prompt, want, s in zip(cases, expected, sessions, strict=True):
        s.policy.drafter = SecondBranchOracle(len(prompt), want, vocab)
    while any(s.finish_reason is None for s in sessions):
        batched.step([s for s in sessions if s.finish_reason is None])
    assert [s.generated for s in sessions] == expected, f"{runner}, batched"
    assert all(s.stats.num_accepted > 0 for s in sessions)
    for prompt, want in zip(cases, expected, strict=True):
        session = alone.session(prompt, SamplingParams(), RULES, requested("prompt_lookup", 4))
        session.policy.drafter = SecondBranchOracle(len(prompt), want, vocab)
        session.prefill()
        while session.finish_reason is None:
            session.step()
        assert session.generated == want and session.stats.num_accepted > 0, f"{runner}, alone"


def test_a_pass_of_chains_only_gets_chains():
    engine = SpeculativeDecoder(lm("graphs"), prompt_lookup=BRANCHES)
    session = engine.session([1, 2, 3, 1, 4, 1], SamplingParams(), RULES, requested("prompt_lookup", 4))
    assert isinstance(session.drafter, PromptLookupDrafter) and session.drafter.branches == 1


# ---- sampled: the target's distribution ---------------------------------------------------------------------------

PROMPT = (1, 4, 2, 5, 1, 3, 2, 4, 5, 3, 1, 2, 0, 3)  # each token recurs with several followers: trees every round
SAMPLES = 1000


@pytest.fixture(scope="module")
def small_target() -> LoadedModel:
    return small_vocab_lm(small_vocab_tokenizer(), 0, "target")


def sampled(target: LoadedModel) -> list[tuple[int, ...]]:
    engine = SpeculativeDecoder(target, prompt_lookup=BRANCHES)
    rules = StopConditions(max_new_tokens=6)
    out = []
    for seed in range(SAMPLES):
        params = SamplingParams(temperature=1.0, seed=seed)
        out.append(tuple(engine.decode(list(PROMPT), params, rules, requested("prompt_lookup", 3)).token_ids[1:3]))
    return out


def test_sampled_tree_rounds_emit_the_targets_distribution(small_target):
    exact = exact_after_first(small_target, PROMPT, SamplingParams(temperature=1.0), 2)
    assert chi_square_pvalue(sampled(small_target), exact) > REJECT_BELOW


def test_a_residual_left_as_p_in_tree_rounds_is_noticed(small_target, monkeypatch):
    monkeypatch.setattr(decoder.tree, "residual_distribution", residual_is_p)
    exact = exact_after_first(small_target, PROMPT, SamplingParams(temperature=1.0), 2)
    assert chi_square_pvalue(sampled(small_target), exact) < REJECT_BELOW
