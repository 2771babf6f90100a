"""The graphs pass's row-wise steps on a GPU, all of a step's rows in one launch each: a matrix product that reads
the weights once per step, RMSNorm, and the rotary embedding with the KV write. Batch-invariant by construction, not
by padding to a tile.

The rule: a row's result is summed in an order fixed by the weights' shape alone, never by the number of rows.

- **``linear``** (``y = x W^T + b``; ``linear_group``: up to three weights that read the same rows, such as q, k
  and v, in one launch, each weight's outputs the bits it gets alone): one fixed configuration per call site
  (``BLOCK_M`` x ``BLOCK_N`` output tiles, ``BLOCK_K`` columns at a time), no split of K: each output is its row's
  dot product accumulated in float32, K chunk after K chunk, in the same order whatever the step's rows; only the
  number of row tiles changes with them. The programs of one column tile are launched side by side (row tiles
  fastest), so a weight tile read from memory serves every row tile from the cache: a step of 64 sequences reads
  the weights about once, where 16-row calls read them once per 16 rows. vLLM's batch-invariant mode keeps BLOCK_K
  fixed per weight shape the same way;
- **``rms_norm``**: each row's sum of squares in float32 over one block of the hidden size, then transformers'
  rounding (the normalised row to the input's dtype, times the weight).

- **``rope_and_store``**: a layer's rotary embedding and its KV cache write in one launch, each row at its own
  position and slot, with transformers' arithmetic and roundings (bit for bit its apply_rotary_pos_emb).

A residual add runs in the epilogue of the product before it (``residual``: the attention's output projection and
the MLP's down projection), rounded as PyTorch rounds the add; **``gated``** computes a Llama MLP's gate and up
products for the same columns in one program and applies SiLU x mul in its epilogue, so neither product is written
out.

Arithmetic: a bfloat16 or float16 model on a GPU takes the products on the tensor cores in
that dtype with float32 accumulation (each product is exact in float32); elsewhere in float32 (IEEE, not TF32).
Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels on a CPU for the tests, in float32, each dot
summed k after k (``dot_f32``: numpy's matmul, the interpreter's own, sums a row by its place in the tile).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

DEFAULT_BLOCKS = (16, 64, 64)  # a matrix product's program: M rows x N outputs, K columns per step of the sum


@triton.jit
def round_to(x, DT: tl.constexpr):
    """float32 ``x`` in ``DT``, rounded to nearest, ties to even, as PyTorch and a GPU's conversion round (Triton's
    CPU interpreter truncates a plain cast to bfloat16: bfloat16 is rounded here on the bits, the same everywhere)."""
    if DT == tl.bfloat16:  # noqa: SIM300 (DT is the argument, tl.bfloat16 the constant)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(DT)
    else:
        return x.to(DT)


@triton.jit
def dot_f32(a, b, acc, ORDERED: tl.constexpr):
    """``acc + a @ b`` in float32 (IEEE): each output its row's products summed over k. ``ORDERED`` (Triton's
    interpreter) sums them k after k, the same for every row: the interpreter's own dot is numpy's matmul, and a BLAS
    may sum a row differently by its place in the tile (OpenBLAS on AVX-512 does): a row's bits would depend on
    the rows beside it. A GPU's dot sums each output in an order fixed by the shapes alone."""
    if ORDERED:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _rows_chunk(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xr):
    """The rows ``offs_m`` of ``x``, columns ``offs_k`` (0 outside ``m_ok`` x ``k_ok``). # -> [M, K]"""
    return tl.load(
        x_ptr + offs_m[:, None].to(tl.int64) * stride_xr + offs_k[None, :],
        mask=m_ok[:, None] & k_ok[None, :],
        other=0.0,
    )


@triton.jit
def _linear_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    r_ptr,
    y_ptr,
    rows,
    n0,
    n1,
    n2,
    n_in,
    stride_xr,
    stride_yr,
    stride_rr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LOW: tl.constexpr,
    ORDERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M`` x ``BLOCK_N`` tile of ``y``, of one of up to three weights (their outputs side by side in
    ``y``; each weight's column tiles start at its own first row): K chunk after K chunk, in order."""
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    pid_m = pid % row_tiles  # row tiles fastest: a column tile's weights are read by neighbouring programs
    pid_n = pid // row_tiles
    tiles0 = tl.cdiv(n0, BLOCK_N)
    tiles1 = tl.cdiv(n1, BLOCK_N)
    if pid_n < tiles0:
        w_ptr, b_ptr, n_out, first_col, tile = w0_ptr, b0_ptr, n0, 0, pid_n
    elif pid_n < tiles0 + tiles1:
        w_ptr, b_ptr, n_out, first_col, tile = w1_ptr, b1_ptr, n1, n0, pid_n - tiles0
    else:
        w_ptr, b_ptr, n_out, first_col, tile = w2_ptr, b2_ptr, n2, n0 + n1, pid_n - tiles0 - tiles1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # within this weight
    m_ok = offs_m < rows
    n_ok = offs_n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, n_in, BLOCK_K):
        offs_k = first + tl.arange(0, BLOCK_K)
        k_ok = offs_k < n_in
        a = _rows_chunk(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xr)  # [M, K]
        b = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * n_in + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [K, N]
        if LOW:  # noqa: SIM108 (a branch on a constexpr, resolved when the kernel compiles)
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        else:
            acc = dot_f32(a, b, acc, ORDERED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = round_to(acc, y_ptr.dtype.element_ty)
    if HAS_RESIDUAL:  # residual + the product, rounded once more: PyTorch's add of the two in the model's dtype
        r = tl.load(
            r_ptr + offs_m[:, None].to(tl.int64) * stride_rr + first_col + offs_n[None, :],
            mask=m_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        out = round_to(r.to(tl.float32) + out.to(tl.float32), y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_yr + first_col + offs_n[None, :],
        out,
        mask=m_ok[:, None] & n_ok[None, :],
    )


def linear_group(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    blocks: tuple[int, int, int] = DEFAULT_BLOCKS,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W_i^T (+ b_i)`` for one to three weights over all rows in one launch, side by side, in ``x``'s dtype: each
    weight's outputs are the bits ``linear`` gives it alone. ``blocks``: (M, N, K), powers of two >= 16.
    ``residual`` (the output's shape and dtype): added to the output in the same launch, with PyTorch's rounding of
    ``residual + product``.
    # x: [R, in]; weights: [out_i, in] each; residual: [R, sum of out_i] -> [R, sum of out_i]"""
    if not 1 <= len(weights) <= 3 or len(biases) != len(weights) or len({b is None for b in biases}) != 1:
        raise ValueError(f"linear: 1 to 3 weights, all with a bias or none, got {len(weights)} and {len(biases)}")
    n_in = x.shape[-1]
    for weight in weights:
        if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != n_in or x.stride(1) != 1:
            raise ValueError(
                f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [R, in] and [out, in]"
            )
        if not weight.is_contiguous():
            raise ValueError(f"linear: a weight {tuple(weight.shape)} must be contiguous")
    rows = x.shape[0]
    sizes = [int(weight.shape[0]) for weight in weights] + [0] * (3 - len(weights))
    unused = [weights[0]] * (3 - len(weights))  # pointers no program reads (their sizes are 0)
    w = [*weights, *unused]
    b = [bias if bias is not None else weights[0] for bias in biases] + unused
    y = torch.empty(rows, sum(sizes), dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype or residual.stride(1) != 1):
        raise ValueError(f"linear: a residual {tuple(residual.shape)} must be the output's {tuple(y.shape)}, its dtype")
    low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and all(v.dtype == x.dtype for v in weights)
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(rows, block_m) * sum(triton.cdiv(n, block_n) for n in sizes),)
    _linear_kernel[grid](
        x,
        *w,
        *b,
        residual if residual is not None else y,
        y,
        rows,
        *sizes,
        n_in,
        x.stride(0),
        y.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_BIAS=biases[0] is not None,
        HAS_RESIDUAL=residual is not None,
        LOW=low,
        ORDERED=not x.is_cuda,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: tuple[int, int, int] = DEFAULT_BLOCKS,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T (+ b) (+ residual)`` over all rows in one launch (``linear_group`` of one weight).
    # x: [R, in]; weight: [out, in]; residual: [R, out] -> [R, out]"""
    return linear_group(x, [weight], [bias], blocks, residual)


@triton.jit
def _gated_kernel(
    x_ptr,
    gate_ptr,
    up_ptr,
    y_ptr,
    rows,
    n_out,
    n_in,
    stride_xr,
    stride_yr,
    LOW: tl.constexpr,
    ORDERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M`` x ``BLOCK_N`` tile of ``silu(x G^T) * (x U^T)``: both products of the tile's columns, each
    summed as ``_linear_kernel`` sums it, then transformers' roundings: each product to the model's dtype, the SiLU
    of the gate to it, their product to it."""
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < rows
    n_ok = offs_n < n_out
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, n_in, BLOCK_K):
        offs_k = first + tl.arange(0, BLOCK_K)
        k_ok = offs_k < n_in
        a = _rows_chunk(x_ptr, offs_m, offs_k, m_ok, k_ok, stride_xr)  # [M, K]
        w_at = offs_n[None, :].to(tl.int64) * n_in + offs_k[:, None]
        w_ok = n_ok[None, :] & k_ok[:, None]
        g = tl.load(gate_ptr + w_at, mask=w_ok, other=0.0)  # [K, N]
        u = tl.load(up_ptr + w_at, mask=w_ok, other=0.0)
        if LOW:
            acc_g = tl.dot(a, g, acc_g, out_dtype=tl.float32)
            acc_u = tl.dot(a, u, acc_u, out_dtype=tl.float32)
        else:
            acc_g = dot_f32(a, g, acc_g, ORDERED)
            acc_u = dot_f32(a, u, acc_u, ORDERED)
    dt = y_ptr.dtype.element_ty
    gate = round_to(acc_g, dt).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt).to(tl.float32)
    out = round_to(silu * round_to(acc_u, dt).to(tl.float32), dt)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_yr + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :]
    )


def gated(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, blocks: tuple[int, int, int] = DEFAULT_BLOCKS
) -> torch.Tensor:
    """``silu(x G^T) * (x U^T)`` (a Llama MLP's input to its down projection) over all rows in one launch, in ``x``'s
    dtype, with transformers' roundings; each output's products summed as ``linear`` sums them. The SiLU's
    exponential is Triton's: the result may differ from PyTorch's by a unit in the last place, never with the rows.
    # x: [R, in]; gate, up: [out, in] -> [R, out]"""
    n_in = x.shape[-1]
    if (
        x.dim() != 2 or x.stride(1) != 1 or gate.shape != up.shape or gate.dim() != 2 or gate.shape[1] != n_in
        or not (gate.is_contiguous() and up.is_contiguous())
    ):  # fmt: skip
        raise ValueError(f"gated: x {tuple(x.shape)}, gate {tuple(gate.shape)} and up {tuple(up.shape)} must be "
                         "[R, in], [out, in] and [out, in], the weights contiguous")  # fmt: skip
    rows, n_out = x.shape[0], int(gate.shape[0])
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gate.dtype == up.dtype == x.dtype
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n_out, block_n),)
    _gated_kernel[grid](
        x, gate, up, y, rows, n_out, n_in, x.stride(0), y.stride(0),
        LOW=low, ORDERED=not x.is_cuda, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, rows, width, stride_xr, stride_yr, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """``ROWS`` rows, each on its own: x / sqrt(mean(x^2) + eps), rounded to the input's dtype, times the weight."""
    offs_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    ok = (offs_r < rows)[:, None] & (offs < width)[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=1) / width  # [ROWS]: each row's own sum
    normed = round_to(x * tl.rsqrt(variance + eps)[:, None], x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < width, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + offs_r[:, None] * stride_yr + offs[None, :],
        round_to(w[None, :] * normed, y_ptr.dtype.element_ty),
        mask=ok,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, each row on its own: one row per program on a GPU, 16 under the interpreter (which
    runs programs one after another). # x: [R, hidden] -> [R, hidden], in ``x``'s dtype"""
    if x.dim() != 2 or x.shape[1] != weight.shape[0] or x.stride(1) != 1:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} must be [R, {weight.shape[0]}], rows contiguous")
    y = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype), memory_format=torch.contiguous_format)
    rows_per_program = 1 if x.is_cuda else 16
    _rms_norm_kernel[(triton.cdiv(x.shape[0], rows_per_program),)](
        x,
        weight,
        y,
        x.shape[0],
        x.shape[1],
        x.stride(0),
        y.stride(0),
        eps,
        ROWS=rows_per_program,
        BLOCK=triton.next_power_of_2(x.shape[1]),
    )
    return y


@triton.jit
def _rotated(x, partner, cos, sin, sign, DT: tl.constexpr):
    """transformers' x * cos + rotate_half(x) * sin with its roundings: each product, then the sum, to ``DT``."""
    first = round_to(x * cos, DT).to(tl.float32)
    second = round_to(sign * partner * sin, DT).to(tl.float32)
    return round_to(first + second, DT)


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    rows,
    stride_qkv,
    stride_cos,
    stride_ks,
    stride_kh,
    stride_kc,
    stride_vs,
    stride_vh,
    stride_vc,
    HEADS: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``ROWS`` rows, each on its own: its q and k heads rotated at its position, q written out, k and v written to
    its slot's cache. Blocks are [row, head, d]."""
    offs_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_ok = offs_r < rows
    row = offs_r[:, None, None]
    position = tl.load(pos_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)[:, None, None]
    slot = tl.load(slot_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)[:, None, None]
    offs_h = tl.arange(0, BLOCK_H)[None, :, None]
    offs_d = tl.arange(0, BLOCK_D)[None, None, :]
    d_ok = r_ok[:, None, None] & (offs_d < D)
    partner_d = tl.where(offs_d < D // 2, offs_d + D // 2, offs_d - D // 2)  # rotate_half's pairs
    sign = tl.where(offs_d < D // 2, -1.0, 1.0)
    cos = tl.load(cos_ptr + position * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    base = qkv_ptr + row * stride_qkv
    q_ok = (offs_h < HEADS) & d_ok
    heads = offs_h * D
    q = tl.load(base + heads + offs_d, mask=q_ok, other=0.0).to(tl.float32)
    q_partner = tl.load(base + heads + partner_d, mask=q_ok, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * HEADS * D + heads + offs_d, _rotated(q, q_partner, cos, sin, sign, dt), mask=q_ok)
    kv_ok = (offs_h < KV) & d_ok
    k = tl.load(base + HEADS * D + heads + offs_d, mask=kv_ok, other=0.0).to(tl.float32)
    k_partner = tl.load(base + HEADS * D + heads + partner_d, mask=kv_ok, other=0.0).to(tl.float32)
    k_at = k_ptr + slot * stride_ks + offs_h.to(tl.int64) * stride_kh + position * stride_kc
    tl.store(k_at + offs_d, _rotated(k, k_partner, cos, sin, sign, dt), mask=kv_ok)
    v = tl.load(base + (HEADS + KV) * D + heads + offs_d, mask=kv_ok, other=0.0)
    v_at = v_ptr + slot * stride_vs + offs_h.to(tl.int64) * stride_vh + position * stride_vc
    tl.store(v_at + offs_d, v, mask=kv_ok)


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: int,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """A layer's rotary embedding and KV write in one launch, each row on its own: the rotated queries returned, the
    rotated keys and the values written at each row's slot and position; transformers' arithmetic and roundings.
    One row per program on a GPU, 16 under the interpreter (which runs programs one after another), unless
    ``rows_per_program`` (a power of two) says.
    # qkv: [R, (heads + 2 kv) * d]; cos, sin: [C, d]; positions, row_slots: [R]; keys, values: [slots, kv, C, d]
    # -> [R, heads, d]"""
    rows = qkv.shape[0]
    kv, d = keys.shape[1], keys.shape[3]
    if qkv.shape[1] != (heads + 2 * kv) * d or qkv.stride(1) != 1 or d % 2 or keys.stride(3) != 1:
        raise ValueError(f"rope_and_store: qkv {tuple(qkv.shape)} must be [R, (heads + 2 kv) * d] for {heads} heads")
    if keys.dtype != qkv.dtype or values.dtype != qkv.dtype or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("rope_and_store: the cache, qkv, cos and sin must share a dtype and a layout")
    q = torch.empty(rows, heads, d, dtype=qkv.dtype, device=qkv.device)
    if rows_per_program is None:
        rows_per_program = 1 if qkv.is_cuda else 16
    _rope_store_kernel[(triton.cdiv(rows, rows_per_program),)](
        qkv,
        cos,
        sin,
        positions,
        row_slots,
        q,
        keys,
        values,
        rows,
        qkv.stride(0),
        cos.stride(0),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        HEADS=heads,
        KV=kv,
        D=d,
        ROWS=rows_per_program,
        BLOCK_H=triton.next_power_of_2(max(heads, kv)),
        BLOCK_D=triton.next_power_of_2(d),
    )
    return q


def self_check(hidden: int, dtype: torch.dtype, device: torch.device, blocks: tuple[int, int, int]) -> None:
    """Compile and run the kernels at a model's hidden size on ``device`` and compare them with PyTorch's float32
    arithmetic: a ValueError (or the compiler's own error) where they cannot run or do not agree."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3 * blocks[0] + 1, hidden, generator=generator).to(device, dtype)
    weight = (torch.randn(2 * blocks[1] + 3, hidden, generator=generator) / hidden**0.5).to(device, dtype)
    bias = torch.randn(weight.shape[0], generator=generator).to(device, dtype)
    norm_weight = (1 + torch.randn(hidden, generator=generator) / 4).to(device, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 4e-2
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    off = float((linear(x, weight, bias, blocks).float() - want).abs().max())
    if not off <= tolerance * max(1.0, float(want.abs().max())):
        raise ValueError(f"the Triton matrix product is {off:.3g} off PyTorch's")
    up = (torch.randn(weight.shape, generator=generator) / hidden**0.5).to(device, dtype)
    silu = torch.nn.functional.silu(torch.nn.functional.linear(x.float(), weight.float()))
    want = silu * torch.nn.functional.linear(x.float(), up.float())
    off = float((gated(x, weight, up, blocks).float() - want).abs().max())
    if not off <= tolerance * max(1.0, float(want.abs().max())):
        raise ValueError(f"the Triton gated product is {off:.3g} off PyTorch's")
    variance = x.float().pow(2).mean(-1, keepdim=True)
    want = norm_weight.float() * (x.float() * torch.rsqrt(variance + 1e-6))
    off = float((rms_norm(x, norm_weight, 1e-6).float() - want).abs().max())
    if not off <= tolerance * max(1.0, float(want.abs().max())):
        raise ValueError(f"the Triton RMSNorm is {off:.3g} off PyTorch's")
