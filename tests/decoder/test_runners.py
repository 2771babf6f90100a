"""One interface for forward passes (decoder/runners): each runner name runs the pass it names (one sequence, the
batch engine, the command line's choices); ``auto`` picks native > lean > transformers; a pass that cannot run a
model is refused with the reason; every pass computes transformers' logits on the same weights, ragged batches and
rollbacks included; and with every pass greedy speculative output equals greedy target-only output.

Which pass ran is observed, not only named: transformers' pass calls the model's own forward, the lean pass its
embedding on the tokens as given, the invariant pass its embedding on tiles of ``TILE`` rows, the graphs pass its
embedding on its static int32 table of token ids, the native pass none of the model's modules (it reads its packed
copy of the weights)."""

from __future__ import annotations

import argparse
import ast
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from decoder import generate_cli
from decoder.batch_engine import BatchEngine
from decoder.choices import RUNNER_NAMES
from decoder.engine import SpeculativeDecoder
from decoder.kv_cache import open_sequence
from decoder.models import LoadedModel, from_objects
from decoder.native import build
from decoder.request_stop import StopConditions
from decoder.runners import KVPool, PassNotApplicable, select_pass
from decoder.runners.graphed import GraphPass
from decoder.runners.hf import TransformersPass
from decoder.runners.invariant import TILE, InvariantPass
from decoder.runners.lean import LeanPass
from decoder.runners.native import NativePass
from decoder.runners.select import AUTO, AUTO_CUDA, PASSES
from decoder.sampling import SamplingParams
from decoder.tiny import build_model
from specd_api.plan import requested
from tests.decoder.test_native import VOCAB, assert_batched_equals_single, llama, perturbed

CPU = torch.device("cpu")
NAMED = [name for name in RUNNER_NAMES if name != "auto"]
CLASSES = {"native": NativePass, "lean": LeanPass, "invariant": InvariantPass, "graphs": GraphPass,
           "transformers": TransformersPass}  # fmt: skip
HAS_NATIVE = build.load() is not None


def gpt2() -> torch.nn.Module:
    return build_model("gpt2", VOCAB, 0)


def skip_native_without_kernel(runner: str) -> None:
    if runner == "native" and not HAS_NATIVE:
        pytest.skip(f"no native pass here: {build.why_not()}")


@contextmanager
def observed(model: torch.nn.Module) -> Iterator[list[str]]:
    """The passes the model's modules saw running while inside, by the marks each pass leaves (module docstring)."""
    seen: list[str] = []

    def embedded(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if inputs[0].dtype == torch.int32:
            seen.append("graphs")
        else:
            seen.append("invariant" if inputs[0].dim() == 1 and inputs[0].shape[0] == TILE else "lean")

    hooks = [
        model.register_forward_pre_hook(lambda *_: seen.append("transformers")),  # before its embedding runs
        model.get_input_embeddings().register_forward_hook(embedded),
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def pass_that_ran(lm: LoadedModel, run) -> str:
    """Which pass ``run()`` ran for ``lm``: "native" when none of the model's modules did."""
    with observed(lm.model) as seen:
        run()
    return seen[0] if seen else "native"


# -- selection ------------------------------------------------------------------------------------------------------


def test_the_selector_offers_every_runner_the_command_line_and_the_worker_do():
    assert {"auto", *PASSES} == set(RUNNER_NAMES)
    for order in (AUTO, AUTO_CUDA):
        assert set(order) <= set(PASSES) and order[-1] == "transformers", "auto ends with the pass that runs anything"
    parser = argparse.ArgumentParser()
    generate_cli.add_parser(parser.add_subparsers())
    generate = parser._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    runner = next(action for action in generate._actions if action.dest == "runner")
    assert tuple(runner.choices) == RUNNER_NAMES
    # the worker's YAML: tests/worker/test_runner.py (the worker package is not imported here)


def runner_comparisons(root: Path) -> list[str]:
    """Every comparison with a name or attribute called ``runner`` in the project's code: a decision on it."""
    found = []
    for package in ("decoder", "specd", "specd_api", "controller", "benchmarks"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Compare) and any(
                    (isinstance(side, ast.Name) and side.id == "runner")
                    or (isinstance(side, ast.Attribute) and side.attr == "runner")
                    for side in (node.left, *node.comparators)
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_selector_decides_on_the_runner_name():
    """Every decision on the runner string is in decoder/runners/select.py: read in several places (the
    one-sequence cache, the pool, its forward), the worker's could run another pass than the engine's."""
    root = Path(__file__).resolve().parents[2]
    decisions = runner_comparisons(root)
    assert decisions and all(where.startswith("decoder/runners/select.py:") for where in decisions), decisions


@pytest.mark.parametrize("runner", NAMED)
def test_each_runner_runs_the_pass_it_names(runner, tokenizer):
    """A float32 Llama on a CPU, which every pass can run: the name asked for is the pass that runs, in the
    selector, one sequence (SpeculativeDecoder) and the batch engine (target and draft pools)."""
    skip_native_without_kernel(runner)
    model = llama(vocab_size=len(tokenizer))
    lm = from_objects(model, tokenizer, "m", runner=runner)
    step = select_pass(model, runner, CPU)
    assert isinstance(step, CLASSES[runner]) and step.name == runner and step.dtype_name == "float32"
    tokens = torch.arange(1, 6)
    assert pass_that_ran(lm, lambda: open_sequence(lm).forward(tokens)) == runner

    session = SpeculativeDecoder(lm, lm).session([5, 6, 7], SamplingParams(), StopConditions(4), requested("draft", 2))
    assert pass_that_ran(lm, session.prefill) == runner
    engine = BatchEngine(lm, lm, max_batch=2)
    assert engine.draft_pool is not None
    assert engine.target_pool.forward_pass.name == engine.draft_pool.forward_pass.name == runner
    opened = engine.open([5, 6, 7], SamplingParams(), StopConditions(max_new_tokens=4), requested("draft", 2))
    assert pass_that_ran(lm, lambda: engine.step([opened])) == runner


@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        (lambda: llama(), torch.float32, "native" if HAS_NATIVE else "lean"),
        (lambda: llama(), torch.float64, "lean"),  # the kernel computes in float32 only
        (lambda: llama(), torch.bfloat16, "lean"),
        (gpt2, torch.float32, "transformers"),
    ],
    ids=["llama-float32", "llama-float64", "llama-bfloat16", "gpt2"],
)
def test_auto_runs_the_fastest_pass_that_applies(model, dtype, expected):
    built = model().to(dtype)
    assert select_pass(built, "auto", CPU).name == expected
    lm = from_objects(built, None, "m")
    assert KVPool(lm, 1).forward_pass.name == expected
    assert pass_that_ran(lm, lambda: open_sequence(lm).forward(torch.arange(1, 4))) == expected


def mistral() -> torch.nn.Module:
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=16)  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("runner", "model", "device", "reason"),
    [
        ("native", lambda: llama().double(), CPU, "the native pass does not apply: torch.float64, not float32"),
        ("native", lambda: llama(), torch.device("cuda"), "the native pass does not apply: it runs on a CPU, not on"),
        ("native", gpt2, CPU, "the native pass does not apply: GPT2LMHeadModel is not a plain Llama model"),
        ("lean", gpt2, CPU, "the lean pass does not apply: GPT2LMHeadModel is not a plain Llama model"),
        ("invariant", gpt2, CPU, "the invariant pass does not apply: GPT2LMHeadModel is not a plain Llama"),
        ("graphs", gpt2, CPU, "the graphs pass does not apply: GPT2LMHeadModel is not a plain Llama"),
        ("lean", mistral, CPU, r"the lean pass does not apply: MistralForCausalLM is not a plain Llama"),
        ("fast", lambda: llama(), CPU, r"unknown runner 'fast'; choose one of auto, native, lean, invariant, g"),
    ],
    ids=[
        "native-float64",
        "native-gpu",
        "native-gpt2",
        "lean-gpt2",
        "invariant-gpt2",
        "graphs-gpt2",
        "lean-mistral",
        "unknown",
    ],
)
def test_a_pass_that_cannot_run_a_model_is_refused_with_the_reason(runner, model, device, reason):
    if runner == "native" and "float64" in reason and not HAS_NATIVE:
        reason = "the native pass does not apply: "  # the kernel's absence is the first reason then
    built = model()
    with pytest.raises(PassNotApplicable, match=reason):
        select_pass(built, runner, device)
    if device == CPU:  # where the request names the model, so does the refusal
        with pytest.raises(ValueError, match=f"^tiny-model: {reason}"):
            open_sequence(from_objects(built, None, "tiny-model", runner=runner))


# -- every pass computes the model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", NAMED)
def test_every_pass_gives_transformers_logits_through_ragged_passes_and_rollback(runner):
    """Against transformers' pass on the same float32 weights: prefill, decode, K-token verifications of two
    sequences in one ragged pass, a rollback, a single row and a kept tail. Float32 sums in another order differ in
    the last bits (5e-6 seen on logits of magnitude ~10); the native pass within its tests' tolerance."""
    skip_native_without_kernel(runner)
    model = llama()
    ours = KVPool(from_objects(model, None, runner, runner=runner), 2)
    theirs = KVPool(from_objects(model, None, "theirs", runner="transformers"), 2)
    assert ours.forward_pass.name == runner and theirs.forward_pass.name == "transformers"
    a, b, ta, tb = ours.open(), ours.open(), theirs.open(), theirs.open()
    atol = 2e-4 if runner == "native" else 5e-5
    generator = torch.Generator().manual_seed(1)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (n,), generator=generator)

    def same(rows: list[tuple[int, torch.Tensor]], logits_to_keep: int = 0) -> None:
        got = ours.forward_many([((a, b)[i], ids) for i, ids in rows], logits_to_keep)
        want = theirs.forward_many([((ta, tb)[i], ids) for i, ids in rows], logits_to_keep)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=atol)

    same([(0, tokens(37)), (1, tokens(11))])  # two prefills in one pass
    for n in (1, 6, 3):  # decode, then verifications of ragged widths
        same([(0, tokens(n)), (1, tokens(n + 2))])
    for seq in (a, ta):
        seq.truncate(seq.length - 4)
    same([(0, tokens(5))])
    same([(1, tokens(4)), (0, tokens(7))], logits_to_keep=2)
    assert ours.lengths == theirs.lengths
    for slot in (0, 1):
        for got, want in zip(ours.cached_keys(slot), theirs.cached_keys(slot), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=atol)


# -- every pass keeps greedy output exact ---------------------------------------------------------------------------


def pair(tokenizer, runner: str) -> tuple[LoadedModel, LoadedModel]:
    """A target and a draft that agrees with it sometimes; float32 for the native pass (the only dtype it runs and
    it is batch-invariant there), float64 for the others (no rounding near-tie flips an argmax)."""
    dtype = torch.float32 if runner == "native" else torch.float64
    target = llama(seed=8, vocab_size=len(tokenizer)).to(dtype)
    draft = perturbed(llama(seed=8, vocab_size=len(tokenizer)), 9).to(dtype)
    return from_objects(target, tokenizer, "t", runner=runner), from_objects(draft, tokenizer, "d", runner=runner)


@pytest.mark.parametrize("runner", NAMED)
def test_greedy_speculative_output_equals_target_only_with_every_pass(runner, tokenizer):
    skip_native_without_kernel(runner)
    target, draft = pair(tokenizer, runner)
    decoder = SpeculativeDecoder(target, draft)
    rules = StopConditions(max_new_tokens=16)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, len(tokenizer)) for _ in range(rng.randint(2, 15))] for _ in range(3)]
    echo = prompts[0] + decoder.generate(prompts[0], "none", 0, SamplingParams(), rules).token_ids + prompts[0]
    prompts.append(echo)  # holds its own continuation: prompt lookup proposes it
    accepted = dict.fromkeys(("draft", "prompt_lookup"), 0)
    for prompt in prompts:
        expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules).token_ids
        for drafter in accepted:
            for k in (1, 4):
                got = decoder.generate(prompt, drafter, k, SamplingParams(), rules)
                assert got.token_ids == expected, f"{runner} {drafter} K={k} prompt={prompt}"
                accepted[drafter] += got.stats.num_accepted
    assert accepted["draft"] > 0 and accepted["prompt_lookup"] > 0, accepted
    engine = BatchEngine(target, draft, max_batch=4)
    assert engine.target_pool.forward_pass.name == runner
    assert_batched_equals_single(engine, rules, len(tokenizer))
