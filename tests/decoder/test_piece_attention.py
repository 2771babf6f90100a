"""The pieces attention (decoder/runners/piece_attention.py) and the graphs pass that runs it.

On a CPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is
imported) in float32; ``SPECD_TEST_DEVICE=cuda`` runs them compiled on a GPU, in bfloat16 too. What is checked:

- the kernels compute attention: against the capacity attention (the graphs pass's other form) over lengths on both
  sides of piece boundaries, ragged widths, padding rows and grouped heads;
- a query's bits depend on its own position and its sequence's keys and values only: the same alone, verified among
  K+1, among other sequences of other lengths, whatever is cached after it;
- the graphs pass with it: transformers' logits, a token's bits the same alone / verified / batched, greedy
  speculative output equal to target-only output, one sequence and batched."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))
if DEVICE.type != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined: before the first import
pytest.importorskip("triton", reason="Triton is not installed (the dev extras bring it: pip install -e '.[dev]')")

from decoder.batch_engine import BatchEngine  # noqa: E402
from decoder.engine import SpeculativeDecoder  # noqa: E402
from decoder.kv_cache import open_sequence  # noqa: E402
from decoder.models import from_objects  # noqa: E402
from decoder.request_stop import StopConditions  # noqa: E402
from decoder.runners.capacity_attention import attend_sequences, visible_positions  # noqa: E402
from decoder.runners.graphed import GraphSettings  # noqa: E402
from decoder.runners.piece_attention import attend_pieces  # noqa: E402
from decoder.sampling import SamplingParams  # noqa: E402
from tests.decoder.test_graph_pass import bf16_pair, graph_pool, model_of, pass_of  # noqa: E402
from tests.decoder.test_native import VOCAB, assert_batched_equals_single  # noqa: E402

PIECE, BLOCK = 32, 16  # small pieces: several per sequence at test lengths
SLOTS, KV, CAPACITY, D, HEADS, Q = 6, 2, 100, 12, 6, 5  # D not a power of two: the head size is padded and masked


def store(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (SLOTS, KV, CAPACITY, D)
    return (
        torch.randn(shape, generator=generator).to(DEVICE, dtype),
        torch.randn(shape, generator=generator).to(DEVICE, dtype),
    )


def step_inputs(
    sequences: list[tuple[int, list[int]]], width: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot, query positions) per sequence -> q [R, heads, d], positions [R], slots [B]; a sequence with fewer
    positions than ``width`` gets padding rows at position 0, as the graphs pass loads them."""
    rows = len(sequences) * width + 3  # rows past B * W, as a tiled step has
    positions = torch.zeros(rows, dtype=torch.int32)
    for b, (_, wanted) in enumerate(sequences):
        positions[b * width : b * width + len(wanted)] = torch.tensor(wanted, dtype=torch.int32)
    q = torch.randn(rows, HEADS, D, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    slots = torch.tensor([slot for slot, _ in sequences], dtype=torch.int32, device=DEVICE)
    return q, positions.to(DEVICE), slots


def pieces(q, keys, values, slots, positions, width) -> torch.Tensor:
    return attend_pieces(q, keys, values, slots, positions, width, Q, 0.25, PIECE, BLOCK)


def reference(q, keys, values, slots, positions, width) -> torch.Tensor:
    batch = slots.shape[0]
    query_positions = torch.nn.functional.pad(positions[: batch * width].view(batch, width), (0, Q - width))
    visible = visible_positions(torch.arange(CAPACITY, dtype=torch.int32, device=DEVICE), query_positions)
    return attend_sequences(q, keys, values, slots, visible, width, 0.25)


def test_it_computes_attention_over_each_sequences_own_length():
    """Lengths 1, 31, 32, 33, 64, 65 and 100 (one piece, either side of one and two piece boundaries, the capacity);
    widths 1, 3 and 5; a sequence with padding rows; 3 query heads per key-value head."""
    keys, values = store(0)
    for width, sequences in (
        (1, [(0, [0]), (3, [30]), (5, [31]), (1, [99])]),
        (3, [(2, [30, 31, 32]), (4, [62, 63, 64]), (0, [97, 98, 99])]),
        (5, [(1, [10, 11]), (3, [60, 61, 62, 63, 64]), (5, [0, 1, 2, 3, 4])]),
    ):
        q, positions, slots = step_inputs(sequences, width, seed=width)
        got = pieces(q, keys, values, slots, positions, width)
        want = reference(q, keys, values, slots, positions, width)
        real = len(sequences) * width
        torch.testing.assert_close(got[:real], want[:real], rtol=0, atol=2e-6, msg=f"width {width}")
        assert not got[real:].any(), "rows past the step's sequences stay zero"


def test_a_querys_bits_do_not_depend_on_what_shares_the_step():
    """A token at position 70 of slot 3: decoded alone (1 x 1), verified as the first of 5 (1 x 5), last of 3 among
    four other sequences of other lengths (5 x 3). The same bits each time."""
    keys, values = store(1)
    q_alone, positions, slots = step_inputs([(3, [70])], 1, seed=7)
    alone = pieces(q_alone, keys, values, slots, positions, 1)[0]

    q, positions, slots = step_inputs([(3, [70, 71, 72, 73, 74])], 5, seed=8)
    q[0] = q_alone[0]
    verified = pieces(q, keys, values, slots, positions, 5)[0]

    others = [(0, [5, 6, 7]), (1, [97, 98, 99]), (3, [68, 69, 70]), (4, [30, 31]), (5, [32, 33, 34])]
    q, positions, slots = step_inputs(others, 3, seed=9)
    q[2 * 3 + 2] = q_alone[0]
    batched = pieces(q, keys, values, slots, positions, 3)[2 * 3 + 2]
    assert torch.equal(verified, alone) and torch.equal(batched, alone)


def test_a_query_sees_no_position_after_its_own():
    """What is cached after a query's position (its own later rows, stale positions past the length) changes
    nothing for it, bit for bit; its own last position does."""
    keys, values = store(2)
    q, positions, slots = step_inputs([(1, [40, 41, 42, 43])], 4, seed=3)
    before = pieces(q, keys, values, slots, positions, 4)
    keys[1, :, 41:] += 5.0
    values[1, :, 41:] -= 5.0
    after = pieces(q, keys, values, slots, positions, 4)
    assert torch.equal(after[0], before[0])
    assert not torch.allclose(after[1], before[1])


def test_a_step_it_cannot_run_is_refused():
    keys, values = store(3)
    q, positions, slots = step_inputs([(0, [3])], 1, seed=1)
    for width, piece in ((0, PIECE), (Q + 1, PIECE), (1, PIECE + 1)):
        with pytest.raises(ValueError, match="attend_pieces"):
            attend_pieces(q, keys, values, slots, positions, width, Q, 0.25, piece, BLOCK)


# -- the graphs pass with it -----------------------------------------------------------------------------------------


@pytest.fixture
def pieces_pass(monkeypatch):
    monkeypatch.setenv("SPECD_GRAPH_ATTENTION", "pieces")
    monkeypatch.setenv("SPECD_GRAPH_PIECE", "64")  # capacity 256: four pieces


def test_the_setting_is_validated_and_auto_picks_pieces_on_a_gpu_only(monkeypatch):
    assert GraphSettings.from_environ({}).attention_on(torch.device("cpu")) == "capacity"
    assert GraphSettings.from_environ({}).attention_on(torch.device("cuda")) == "pieces"
    for bad in ({"SPECD_GRAPH_ATTENTION": "flash"}, {"SPECD_GRAPH_PIECE": "100"}, {"SPECD_GRAPH_PIECE": "8192"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GraphSettings.from_environ(bad)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        GraphSettings(attention="pieces").attention_on(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_computes_the_model(pieces_pass, dtype):
    """Against transformers in float64, over a prefill, decode steps, a rollback and a verification: to float32
    rounding in float32; in bfloat16 no further off, over the steps, than transformers' own bfloat16 forward."""
    pool = graph_pool(model_of(dtype), slots=1)
    assert pass_of(pool).attention == "pieces"
    ours = pool.open()
    same_dtype = open_sequence(from_objects(model_of(dtype), None, "theirs", runner="transformers"))
    exact = open_sequence(from_objects(model_of(torch.float64), None, "exact", runner="transformers"))
    generator = torch.Generator().manual_seed(1)
    ours_off = theirs_off = 0.0
    for i, n in enumerate((70, 1, 6, 1, 9)):
        if i == 3:  # roll back 4 tokens first
            for seq in (ours, same_dtype, exact):
                seq.truncate(seq.length - 4)
        tokens = torch.randint(0, VOCAB, (n,), generator=generator)
        got, theirs, want = ours.forward(tokens).double(), same_dtype.forward(tokens).double(), exact.forward(tokens)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4, msg=f"step {i}")
        ours_off, theirs_off = max(ours_off, (got - want).abs().max()), max(theirs_off, (theirs - want).abs().max())
    assert ours_off <= 1.25 * theirs_off + 1e-3, f"{ours_off:.3f} off, transformers {theirs_off:.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tokens_logits_are_the_same_bits_alone_verified_and_batched(pieces_pass, dtype):
    """8 tokens decoded one step at a time (1 x 1), verified in one row (1 x 8), and again among 7 other sequences
    of other lengths and widths (8 x 1, 8 x 9): the same bits; lengths cross the 64-position pieces."""
    pool = graph_pool(model_of(dtype), slots=10)
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


def test_speculative_and_batched_greedy_equal_target_only_in_bfloat16(monkeypatch, tokenizer):
    """Greedy output with the draft (K 3) and with prompt lookup (K 4, on a prompt that holds its continuation) is
    target-only output token for token, one sequence and four batched with K varying per round. (One piece per
    sequence here: the interpreter runs every program of a step, and a step's cost is the test's.)"""
    monkeypatch.setenv("SPECD_GRAPH_ATTENTION", "pieces")
    rules = StopConditions(max_new_tokens=16)
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
    assert engine.target_pool.forward_pass.attention == "pieces"  # type: ignore[attr-defined]
    assert_batched_equals_single(engine, rules, len(tokenizer))


def test_auto_serves_with_the_pieces_attention_only_where_its_check_passes(monkeypatch):
    """``auto`` checks the kernels at the model's shape on its device when the pass is made: where they compile and
    agree with the capacity attention it runs them, else the capacity attention, saying why."""
    from decoder.runners import piece_attention

    graphs = pass_of(graph_pool(model_of(torch.bfloat16), slots=1))
    assert graphs._checked_pieces(graphs.model, DEVICE) == ("pieces", "")

    def wrong(q, *args, **kwargs):
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)

    monkeypatch.setattr(piece_attention, "attend_pieces", wrong)
    attention, why = graphs._checked_pieces(graphs.model, DEVICE)
    assert attention == "capacity" and "off the capacity attention" in why

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(piece_attention, "attend_pieces", broken)
    assert graphs._checked_pieces(graphs.model, DEVICE) == ("capacity", "RuntimeError: PTX assembly failed")
