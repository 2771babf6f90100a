"""The graphs pass with its Triton forms (decoder/runners/graphed.py, ``SPECD_GRAPH_ATTENTION=pieces``,
``SPECD_GRAPH_ROWS=triton``): what ``auto`` runs on a GPU. The kernels themselves: tests/decoder/
test_piece_attention.py and test_row_kernels.py.

On a CPU the kernels run under Triton's interpreter (tests/conftest.py); ``SPECD_TEST_DEVICE=cuda`` compiles them.
What is checked, for each Triton form alone and both together: the pass computes the model (transformers' logits), a
token's logits are the same bits alone, verified and batched among sequences of other lengths, and greedy speculative
output equals target-only output, one sequence and batched; the settings are validated, and ``auto`` serves with a
Triton form only where its start-up check passed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extras bring it: pip install -e '.[dev]')")

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.request_stop import StopConditions
from decoder.runners.graphed import GraphSettings
from decoder.sampling import SamplingParams
from tests.decoder.test_graph_pass import beside_transformers, bf16_pair, graph_pool, model_of, pass_of
from tests.decoder.test_native import VOCAB, assert_batched_equals_single

FORMS = {  # the Triton forms, alone and together: (attention, rows)
    "pieces": ("pieces", "tiles"),
    "triton-rows": ("capacity", "triton"),
    "both": ("pieces", "triton"),
}


@pytest.fixture(params=sorted(FORMS))
def forms(request, monkeypatch) -> tuple[str, str]:
    attention, rows = FORMS[request.param]
    monkeypatch.setenv("SPECD_GRAPH_ATTENTION", attention)
    monkeypatch.setenv("SPECD_GRAPH_ROWS", rows)
    monkeypatch.setenv("SPECD_GRAPH_PIECE", "64")  # capacity 256: four pieces
    # the largest blocks: still 2 column tiles and 2 K steps in the MLP, and the fewest programs for the interpreter
    # to run one after another (small blocks: tests/decoder/test_row_kernels.py)
    monkeypatch.setenv("SPECD_GRAPH_LINEAR_BLOCKS", "16,256,256")
    return attention, rows


def test_the_settings_are_validated_and_auto_picks_the_triton_forms_on_a_gpu_only(monkeypatch):
    settings = GraphSettings.from_environ({})
    assert (settings.form_on("attention", torch.device("cpu")), settings.form_on("rows", torch.device("cpu"))) == (
        "capacity",
        "tiles",
    )
    assert (settings.form_on("attention", torch.device("cuda")), settings.form_on("rows", torch.device("cuda"))) == (
        "pieces",
        "triton",
    )
    compiled = GraphSettings.from_environ({"SPECD_GRAPH_COMPILE": "1"})
    assert compiled.form_on("rows", torch.device("cuda")) == "tiles"  # the compile option fuses the tiles
    with pytest.raises(ValueError, match="exclude each other"):
        GraphSettings(compile=True, rows="triton").form_on("rows", torch.device("cuda"))
    assert GraphSettings.from_environ({"SPECD_GRAPH_LINEAR_BLOCKS": "32,64,128"}).linear_blocks == (32, 64, 128)
    for bad in (
        {"SPECD_GRAPH_ATTENTION": "flash"},
        {"SPECD_GRAPH_ROWS": "cublas"},
        {"SPECD_GRAPH_PIECE": "100"},
        {"SPECD_GRAPH_PIECE": "8192"},
        {"SPECD_GRAPH_LINEAR_BLOCKS": "16,64"},
        {"SPECD_GRAPH_LINEAR_BLOCKS": "16,48,64"},
        {"SPECD_GRAPH_LINEAR_BLOCKS": "8,64,64"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GraphSettings.from_environ(bad)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for what, form in (("attention", "pieces"), ("rows", "triton")):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            GraphSettings(**{what: form}).form_on(what, torch.device("cpu"))


def test_auto_serves_with_a_triton_form_only_where_its_check_passes():
    """``auto`` checks each Triton form at the model's shape on its device when the pass is made: where the kernels
    compile and agree with PyTorch's it serves with them, else with the PyTorch form, saying why. (The check is
    handed in: ``auto`` picks a Triton form on CUDA only, which this CPU is not.)"""
    graphs = pass_of(graph_pool(model_of(torch.float32), slots=1))
    cuda = torch.device("cuda")
    assert graphs._checked("attention", cuda, lambda: None) == "pieces"
    assert graphs._checked("rows", cuda, lambda: None) == "triton"
    assert graphs.fallbacks == {}

    def broken() -> None:
        raise RuntimeError("PTX assembly failed")

    assert graphs._checked("attention", cuda, broken) == "capacity"
    assert graphs._checked("rows", cuda, broken) == "tiles"
    assert graphs.fallbacks == {
        "attention": "RuntimeError: PTX assembly failed",
        "rows": "RuntimeError: PTX assembly failed",
    }
    assert graphs._checked("rows", torch.device("cpu"), broken) == "tiles"  # auto on a CPU: nothing to check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_computes_the_model(forms, dtype):
    """Against transformers in float64, over a prefill, decode steps, a rollback and a verification: to float32
    rounding in float32; in bfloat16 no further off, over the steps, than transformers' own bfloat16 forward."""
    pool = graph_pool(model_of(dtype), slots=1)
    assert (pass_of(pool).attention, pass_of(pool).rows) == forms
    ours_off = theirs_off = 0.0
    for i, (got, theirs, want) in enumerate(beside_transformers(pool, dtype, 70)):  # 70: across two pieces
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4, msg=f"step {i}")
        ours_off, theirs_off = max(ours_off, (got - want).abs().max()), max(theirs_off, (theirs - want).abs().max())
    assert ours_off <= 1.25 * theirs_off + 1e-3, f"{ours_off:.3f} off, transformers {theirs_off:.3f}"


def test_a_tokens_logits_are_the_same_bits_alone_verified_and_batched(forms):
    """8 tokens decoded one step at a time (1 x 1), verified in one row (1 x 8), and again among 7 other sequences
    of other lengths and widths (8 x 1, 8 x 9): the same bits, in bfloat16; lengths cross the 64-position pieces.
    Both Triton forms together, as a GPU serves (each kernel's bits alone and among others: its own tests)."""
    if forms != FORMS["both"]:
        pytest.skip("run with both Triton forms only (the interpreter's time)")
    pool = graph_pool(model_of(torch.bfloat16), slots=10)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (60,), generator=generator)
    tokens = torch.randint(0, VOCAB, (8,), generator=generator)
    alone_seq, twin, third = pool.open(), pool.open(), pool.open()
    others = [pool.open() for _ in range(7)]
    pool.forward_many([(alone_seq, prompt), (twin, prompt), (third, prompt)])
    pool.forward_many(
        [(seq, torch.randint(0, VOCAB, (3 + 20 * i,), generator=generator)) for i, seq in enumerate(others)]
    )
    alone = torch.cat([alone_seq.forward(tokens[i : i + 1]) for i in range(8)])
    assert torch.equal(twin.forward(tokens), alone)

    def among_others(count: int, widths: list[int]) -> torch.Tensor:
        rows = [
            (seq, torch.randint(0, VOCAB, (w,), generator=generator)) for seq, w in zip(others, widths, strict=True)
        ]
        done = third.length - len(prompt)
        return pool.forward_many([*rows, (third, tokens[done : done + count])])[-1]

    batched = torch.cat(
        [among_others(1, [1] * 7), among_others(2, [1 + i for i in range(7)]), among_others(5, [9] * 7)]
    )
    assert torch.equal(batched, alone), (batched - alone).abs().max()


def test_speculative_and_batched_greedy_equal_target_only_in_bfloat16(forms, monkeypatch, tokenizer):
    """Greedy output with the draft (K 3) and with prompt lookup (K 4, on a prompt that holds its continuation) is
    target-only output token for token, one sequence and four batched with K varying per round. Both Triton forms
    together, as a GPU serves (each form's bits: the tests above), one piece per sequence: the interpreter runs every
    program of a step one after another, and a step's cost is the test's."""
    if forms != FORMS["both"]:
        pytest.skip("run with both Triton forms only (the interpreter's time)")
    monkeypatch.setenv("SPECD_GRAPH_PIECE", "256")
    rules = StopConditions(max_new_tokens=10)
    target, draft = bf16_pair(tokenizer, seed=4)
    decoder = SpeculativeDecoder(target, draft)
    prompt = [5, 9, 13, 2, 7, 11]
    expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules).token_ids
    echo = prompt + expected + prompt
    accepted = 0
    for drafter, k, asked in (("draft", 3, prompt), ("prompt_lookup", 4, echo)):
        want = expected if asked is prompt else decoder.generate(asked, "none", 0, SamplingParams(), rules).token_ids
        got = decoder.generate(asked, drafter, k, SamplingParams(), rules)
        assert got.token_ids == want, drafter
        accepted += got.stats.num_accepted
    assert accepted > 0
    target, draft = bf16_pair(tokenizer, seed=8)
    engine = BatchEngine(target, draft, max_batch=4)
    forward = engine.target_pool.forward_pass
    assert (forward.attention, forward.rows) == forms  # type: ignore[attr-defined]
    assert_batched_equals_single(engine, rules, len(tokenizer))
