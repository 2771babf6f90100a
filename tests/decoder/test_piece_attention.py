"""The pieces attention's kernels (decoder/runners/piece_attention.py); the graphs pass that runs them:
tests/decoder/test_graph_triton.py.

On a CPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before
Triton is imported) in float32; ``SPECD_TEST_DEVICE=cuda`` runs them compiled on a GPU. What is checked:

- the kernels compute attention: against the capacity attention (the graphs pass's other form) over lengths on both
  sides of piece boundaries, ragged widths, padding rows and grouped heads;
- a query's bits depend on its own position and its sequence's keys and values only: the same alone, verified among
  K+1, among other sequences of other lengths, whatever is cached after it;
- the start-up check refuses kernels that do not agree with the capacity attention."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))  # a CPU: Triton's interpreter (tests/conftest.py)
pytest.importorskip("triton", reason="Triton is not installed (the dev extras bring it: pip install -e '.[dev]')")

from decoder.runners.capacity_attention import attend_sequences, visible_positions  # noqa: E402
from decoder.runners.piece_attention import attend_pieces  # noqa: E402

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


def test_the_start_up_check_refuses_a_kernel_that_does_not_compute_attention(monkeypatch):
    from decoder.runners import piece_attention

    piece_attention.self_check(HEADS, KV, D, Q, 64, torch.float32, DEVICE)  # the real kernels pass

    def wrong(q, *args, **kwargs):
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)

    monkeypatch.setattr(piece_attention, "attend_pieces", wrong)
    with pytest.raises(ValueError, match="off the capacity attention"):
        piece_attention.self_check(HEADS, KV, D, Q, 64, torch.float32, DEVICE)
