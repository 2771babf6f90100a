"""The graphs pass's row-wise reductions on a GPU, all of a step's rows in one launch each: a matrix product that
reads the weights once per step, and RMSNorm. Batch-invariant by construction, not by padding to a tile.

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

Elementwise steps (rotary embedding, SiLU x mul, residual adds) need neither: an element's result does not depend on
the others, so PyTorch's kernels run them over all rows at once.

Arithmetic: a bfloat16 or float16 model on a GPU takes the products on the tensor cores in
that dtype with float32 accumulation (each product is exact in float32); elsewhere in float32 (IEEE, not TF32).
Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels on a CPU for the tests, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

DEFAULT_BLOCKS = (16, 64, 64)  # a matrix product's program: M rows x N outputs, K columns per step of the sum


@triton.jit
def _linear_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    rows,
    n0,
    n1,
    n2,
    n_in,
    stride_xr,
    stride_yr,
    HAS_BIAS: tl.constexpr,
    LOW: tl.constexpr,
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
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xr + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [M, K]
        b = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * n_in + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [K, N]
        if LOW:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_yr + first_col + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def linear_group(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    blocks: tuple[int, int, int] = DEFAULT_BLOCKS,
) -> torch.Tensor:
    """``x W_i^T (+ b_i)`` for one to three weights over all rows in one launch, side by side, in ``x``'s dtype: each
    weight's outputs are the bits ``linear`` gives it alone. ``blocks``: (M, N, K), powers of two >= 16.
    # x: [R, in]; weights: [out_i, in] each -> [R, sum of out_i]"""
    if not 1 <= len(weights) <= 3 or len(biases) != len(weights) or len({b is None for b in biases}) != 1:
        raise ValueError(f"linear: 1 to 3 weights, all with a bias or none, got {len(weights)} and {len(biases)}")
    n_in = x.shape[-1]
    for w in weights:
        if x.dim() != 2 or w.dim() != 2 or w.shape[1] != n_in or x.stride(1) != 1 or not w.is_contiguous():
            raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(w.shape)} must be [R, in] and [out, in]")
    rows = x.shape[0]
    sizes = [int(w.shape[0]) for w in weights] + [0] * (3 - len(weights))
    w = [*weights, *[weights[0]] * (3 - len(weights))]
    b = [bias if bias is not None else weights[0] for bias in biases] + [weights[0]] * (3 - len(weights))
    y = torch.empty(rows, sum(sizes), dtype=x.dtype, device=x.device)
    low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and all(v.dtype == x.dtype for v in weights)
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(rows, block_m) * sum(triton.cdiv(n, block_n) for n in sizes),)
    _linear_kernel[grid](
        x,
        *w,
        *b,
        y,
        rows,
        *sizes,
        n_in,
        x.stride(0),
        y.stride(0),
        HAS_BIAS=biases[0] is not None,
        LOW=low,
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
) -> torch.Tensor:
    """``x W^T (+ b)`` over all rows in one launch (``linear_group`` of one weight).
    # x: [R, in]; weight: [out, in] -> [R, out]"""
    return linear_group(x, [weight], [bias], blocks)


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
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < width, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + offs_r[:, None] * stride_yr + offs[None, :], (w[None, :] * normed).to(y_ptr.dtype.element_ty), mask=ok
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


def self_check(hidden: int, dtype: torch.dtype, device: torch.device, blocks: tuple[int, int, int]) -> None:
    """Compile and run both kernels at a model's hidden size on ``device`` and compare them with PyTorch's float32
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
    variance = x.float().pow(2).mean(-1, keepdim=True)
    want = norm_weight.float() * (x.float() * torch.rsqrt(variance + 1e-6))
    off = float((rms_norm(x, norm_weight, 1e-6).float() - want).abs().max())
    if not off <= tolerance * max(1.0, float(want.abs().max())):
        raise ValueError(f"the Triton RMSNorm is {off:.3g} off PyTorch's")
