"""The graphs pass's attention on a GPU: every sequence of a step in one Triton kernel per layer, over its own
length (not the capacity), in pieces of a fixed number of positions.

The rule that keeps it exact: a query's result depends on its own position and its sequence's keys and values only,
never on what shares the step (the batch, the bucket's width, other sequences' lengths). So:

- **pieces of a fixed size, not a fixed count.** A sequence's positions ``0..length`` are split at multiples of
  ``piece`` (the graphs pass's ``SPECD_GRAPH_PIECE``; and, within a piece, of ``BLOCK_N``): the split is the same
  whoever else is in the step. One program per (sequence, key-value head, piece) computes a piece's partial softmax
  (its maximum, its sum and its weighted values, in float32); a second kernel folds a sequence's pieces in order, 0,
  1, ..., up to its own last piece. Pieces past a sequence's length do no work and are never read;
- **positions past a query's own are masked to exact zeros.** A block (or a piece) with no visible position leaves a
  row's running maximum, sum and values unchanged bit for bit (its weights are exp(-inf) = 0, its rescale exp(0) =
  1), so the loop running further for a later row of the same sequence changes nothing for an earlier one: a token's
  bits are the same decoded alone (width 1) and verified among K+1 (width K+1);
- **one tile shape per model**: each program holds ``BLOCK_M`` query rows (the sequence's up to ``Q`` = K_max+1
  tokens times the query heads sharing its key-value head, padded to a power of two, at least 16), whatever the
  step's width, so a row's dot products run the same instructions in every bucket.

Capturable: the lengths are read on the device from the step's positions (a sequence's length is its last query's
position + 1), the slots from the step's table; the grid depends on the bucket and the capacity only.

Arithmetic: keys and values are read in the store's dtype; scores, the softmax and the weighted sum accumulate in
float32. A bfloat16 or float16 store on a GPU takes the query-key dot product on the
tensor cores in that dtype with float32 accumulation (each product is exact in float32); elsewhere both dot products
run in float32 (IEEE, not TF32). Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the same kernels on a CPU
for the tests, in float32.

Shapes: ``B`` sequences of the step, ``W`` the bucket's width (query rows per sequence), ``R`` the step's rows (>=
``B * W``), ``heads``/``kv``/``d`` query heads, key-value heads and head size, ``G`` = heads / kv, ``C`` capacity,
``P`` = ceil(C / piece) pieces, ``M`` = BLOCK_M rows per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decoder.runners.row_kernels import dot_f32, round_to

BLOCK_N = 64  # positions per block within a piece (a piece is a whole number of blocks)


def rows_per_program(query_rows: int, group: int) -> int:
    """``BLOCK_M``: ``query_rows`` tokens x ``group`` heads, padded to a power of two, at least 16 (tl.dot's least)."""
    return max(16, triton.next_power_of_2(query_rows * group))


@triton.jit
def _sequence_rows(pos_ptr, b, width, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's rows for sequence ``b``: each row's query token (``GROUP`` heads per token), whether it is one of
    the step's, its position, and the sequence's length (its last query's position + 1)."""
    token = tl.arange(0, BLOCK_M) // GROUP
    real = token < width
    query_pos = tl.load(pos_ptr + b * width + token, mask=real, other=-1)  # [M]
    return token, real, query_pos, tl.max(query_pos, axis=0) + 1


@triton.jit
def _piece_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    pos_ptr,
    part_acc_ptr,
    part_ml_ptr,
    width,
    scaling,
    stride_qr,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_kc,
    stride_vs,
    stride_vh,
    stride_vc,
    pieces_per_sequence,
    KV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    BLOCK_POS: tl.constexpr,
    QK_LOW: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """One piece of one sequence's positions for one key-value head: partial maximum, sum and weighted values."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    piece = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token, real, query_pos, length = _sequence_rows(pos_ptr, b, width, GROUP, BLOCK_M)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    d_ok = offs_d < HEAD_DIM

    q_rows = (b * width + token).to(tl.int64) * stride_qr + (h * GROUP + offs_m % GROUP) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=real[:, None] & d_ok[None, :], other=0.0)
    if not QK_LOW:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = piece * PIECE_SIZE
    end = tl.minimum(start + PIECE_SIZE, length)
    k_base = k_ptr + slot * stride_ks + h * stride_kh
    v_base = v_ptr + slot * stride_vs + h * stride_vh
    for first in range(start, end, BLOCK_POS):
        pos = first + tl.arange(0, BLOCK_POS)
        in_range = pos < end
        keys_t = tl.load(
            k_base + pos[None, :].to(tl.int64) * stride_kc + offs_d[:, None],
            mask=in_range[None, :] & d_ok[:, None],
            other=0.0,
        )  # [D, N]
        if QK_LOW:
            scores = tl.dot(q, keys_t, out_dtype=tl.float32)
        else:
            scores = dot_f32(q, keys_t, tl.zeros([BLOCK_M, BLOCK_POS], tl.float32), ORDERED)
        scores = scores * scaling
        visible = (pos[None, :] <= query_pos[:, None]) & in_range[None, :]
        scores = tl.where(visible, scores, float("-inf"))  # [M, N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        weights = tl.exp(scores - m_safe[:, None])  # a hidden position: exactly 0
        rescale = tl.exp(m_i - m_safe)  # unchanged maximum: exactly 1; no maximum yet: 0
        values = tl.load(
            v_base + pos[:, None].to(tl.int64) * stride_vc + offs_d[None, :],
            mask=in_range[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [N, D]
        l_i = l_i * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + dot_f32(weights, values, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), ORDERED)
        m_i = m_new

    part = (b * KV + h) * pieces_per_sequence + piece
    tl.store(part_acc_ptr + part.to(tl.int64) * BLOCK_M * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :], acc)
    tl.store(part_ml_ptr + part.to(tl.int64) * 2 * BLOCK_M + offs_m, m_i)
    tl.store(part_ml_ptr + part.to(tl.int64) * 2 * BLOCK_M + BLOCK_M + offs_m, l_i)


@triton.jit
def _fold_kernel(
    pos_ptr,
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    width,
    stride_or,
    pieces_per_sequence,
    KV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
):
    """A sequence's pieces for one key-value head folded in order, 0 up to its own last piece; the rows written."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token, real, _, length = _sequence_rows(pos_ptr, b, width, GROUP, BLOCK_M)
    pieces = (length + PIECE_SIZE - 1) // PIECE_SIZE

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for piece in range(0, pieces):
        part = ((b * KV + h) * pieces_per_sequence + piece).to(tl.int64)
        m_p = tl.load(part_ml_ptr + part * 2 * BLOCK_M + offs_m)
        l_p = tl.load(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + offs_m)
        acc_p = tl.load(part_acc_ptr + part * BLOCK_M * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_i, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        mine = tl.exp(m_i - m_safe)
        theirs = tl.exp(m_p - m_safe)  # a piece with nothing visible to a row: exactly 0
        l_i = l_i * mine + l_p * theirs
        acc = acc * mine[:, None] + acc_p * theirs[:, None]
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rows = (b * width + token).to(tl.int64) * stride_or + (h * GROUP + offs_m % GROUP) * HEAD_DIM
    tl.store(
        out_ptr + rows[:, None] + offs_d[None, :],
        round_to(out, out_ptr.dtype.element_ty),
        mask=real[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


def attend_pieces(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_slots: torch.Tensor,
    positions: torch.Tensor,
    width: int,
    query_rows: int,
    scaling: float,
    piece: int,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Every sequence of a step over its own slot and length: two kernel launches, whatever the batch.
    Sequence b's token j is row b * W + j of ``q`` and ``positions``; ``query_rows`` (>= W) fixes the tile.
    # q: [R, heads, d]; keys, values: [slots, kv, C, d]; seq_slots: [B] int; positions: [R] int
    # -> [R, heads * d] (rows past B * W zero)"""
    rows, heads, d = q.shape
    batch = seq_slots.shape[0]
    kv, capacity = keys.shape[1], keys.shape[2]
    if not 1 <= width <= query_rows or heads % kv or piece % block_n:
        raise ValueError(
            f"attend_pieces: width {width} must be in 1..{query_rows}, heads {heads} a multiple of kv {kv}, "
            f"piece {piece} a multiple of block_n {block_n}"
        )
    if keys.stride(3) != 1 or values.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("attend_pieces reads a head's d values contiguously")
    group = heads // kv
    block_m = rows_per_program(query_rows, group)
    block_d = max(16, triton.next_power_of_2(d))
    pieces = triton.cdiv(capacity, piece)
    part_acc = torch.empty(batch * kv * pieces * block_m * block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * kv * pieces * 2 * block_m, dtype=torch.float32, device=q.device)
    out = torch.zeros(rows, heads * d, dtype=q.dtype, device=q.device)
    qk_low = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and keys.dtype == q.dtype
    _piece_kernel[(batch, kv, pieces)](
        q,
        keys,
        values,
        seq_slots,
        positions,
        part_acc,
        part_ml,
        width,
        scaling,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        pieces,
        KV=kv,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        PIECE_SIZE=piece,
        BLOCK_POS=block_n,
        QK_LOW=qk_low,
        ORDERED=not q.is_cuda,
    )
    _fold_kernel[(batch, kv)](
        positions,
        part_acc,
        part_ml,
        out,
        width,
        out.stride(0),
        pieces,
        KV=kv,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        PIECE_SIZE=piece,
    )
    return out


def self_check(
    heads: int, kv: int, d: int, query_rows: int, piece: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Compile and run the kernels for a model's shape on ``device`` and compare them with the capacity attention:
    a ValueError (or the compiler's own error) where they cannot run or do not agree. Two sequences, three pieces
    long, widths 1 and ``query_rows``."""
    from decoder.runners.capacity_attention import attend_sequences, visible_positions

    generator = torch.Generator().manual_seed(0)
    capacity = 3 * piece
    keys = torch.randn(3, kv, capacity, d, generator=generator).to(device, dtype)
    values = torch.randn(3, kv, capacity, d, generator=generator).to(device, dtype)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for width in sorted({1, query_rows}):
        q = torch.randn(2 * width, heads, d, generator=generator).to(device, dtype)
        ends = (capacity - 1, piece + width)  # the last query's position of each sequence
        positions = torch.tensor(
            [end - width + 1 + j for end in ends for j in range(width)], dtype=torch.int32, device=device
        )
        got = attend_pieces(q, keys, values, slots, positions, width, query_rows, d**-0.5, piece)
        query_positions = torch.nn.functional.pad(positions.view(2, width), (0, query_rows - width))
        visible = visible_positions(torch.arange(capacity, dtype=torch.int32, device=device), query_positions)
        want = attend_sequences(q, keys, values, slots, visible, width, d**-0.5)
        off = float((got.float() - want.float()).abs().max())
        if not off <= tolerance:
            raise ValueError(f"the pieces attention is {off:.3g} off the capacity attention (width {width})")
