"""The graphs pass's row-wise reductions on a GPU, all of a step's rows in one launch each: a matrix product that
reads the weights once per step, and RMSNorm. Batch-invariant by construction, not by padding to a tile.

The rule: a row's result is summed in an order fixed by the weights' shape alone, never by the number of rows.

- **``linear``** (``y = x W^T + b``): one fixed configuration per call site (``BLOCK_M`` x ``BLOCK_N`` output tiles,
  ``BLOCK_K`` columns at a time), no split of K: each output is its row's dot product accumulated in float32, K
  chunk after K chunk, in the same order whatever the step's rows; only the number of row tiles changes with them.
  The programs of one column tile are launched side by side (row tiles fastest), so a weight tile read from memory
  serves every row tile from the cache: a step of 64 sequences reads the weights about once, where 16-row calls
  read them once per 16 rows. vLLM's batch-invariant mode keeps BLOCK_K fixed per weight shape the same way;
- **``rms_norm``**: each row's sum of squares in float32 over one block of the hidden size, then transformers'
  rounding (the normalised row to the input's dtype, times the weight).

Elementwise steps (rotary embedding, SiLU x mul, residual adds) need neither: an element's result does not depend on
the others, so PyTorch's kernels run them over all rows at once.

Arithmetic: ``low_precision_dot`` (a bfloat16 or float16 model on a GPU) takes the products on the tensor cores in
that dtype with float32 accumulation (each product is exact in float32); elsewhere in float32 (IEEE, not TF32).
Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels on a CPU for the tests, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_BLOCKS = (16, 64, 64)  # a matrix product's program: M rows x N outputs, K columns per step of the sum


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    rows,
    n_out,
    n_in,
    stride_xr,
    stride_wn,
    stride_yr,
    HAS_BIAS: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M`` x ``BLOCK_N`` tile of ``y``: K chunk after K chunk, in order."""
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    pid_m = pid % row_tiles  # row tiles fastest: a column tile's weights are read by neighbouring programs
    pid_n = pid // row_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
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
        y_ptr + offs_m[:, None].to(tl.int64) * stride_yr + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: tuple[int, int, int] = DEFAULT_BLOCKS,
) -> torch.Tensor:
    """``x W^T (+ b)`` over all rows in one launch, in ``x``'s dtype; ``blocks``: (M, N, K), powers of two >= 16.
    # x: [R, in]; weight: [out, in] -> [R, out]"""
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [R, in] and [out, in]")
    rows, n_in = x.shape
    n_out = weight.shape[0]
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n_out, block_n),)
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        rows,
        n_out,
        n_in,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        LOW=low,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
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
