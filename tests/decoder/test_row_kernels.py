"""The graphs pass's Triton row kernels (decoder/runners/row_kernels.py): a matrix product over all of a step's rows
and RMSNorm, each a row's result summed in an order the row count cannot change. The graphs pass that runs them:
tests/decoder/test_graph_triton.py.

On a CPU they run under Triton's interpreter (tests/conftest.py) in float32; ``SPECD_TEST_DEVICE=cuda`` compiles
them. What is checked: they compute what PyTorch computes (a float64 reference; transformers' LlamaRMSNorm), a row's
bits are the same alone and among any number of rows at any place, and the start-up check refuses a wrong kernel."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))
pytest.importorskip("triton", reason="Triton is not installed (the dev extras bring it: pip install -e '.[dev]')")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from decoder.runners import row_kernels  # noqa: E402
from decoder.runners.row_kernels import gated, linear, rms_norm  # noqa: E402

BLOCKS = (16, 32, 16)  # several column tiles and K steps at test sizes


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


@pytest.mark.parametrize(("rows", "n_in", "n_out"), [(1, 70, 100), (16, 48, 64), (37, 100, 33)])
def test_linear_computes_x_w_transposed_plus_b(rows, n_in, n_out):
    """Sizes that are and are not multiples of the blocks (partial row, column and K tiles), with and without bias."""
    x, w, b = randn(rows, n_in, seed=1), randn(n_out, n_in, seed=2, scale=n_in**-0.5), randn(n_out, seed=3)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(linear(x, w, b, BLOCKS).double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(linear(x, w, None, BLOCKS).double(), want - b.double(), rtol=0, atol=1e-5)


def test_a_rows_product_is_the_same_bits_alone_and_among_any_rows():
    """Row r of a 1-row call, of 16 rows, of 61 rows at another place: the same bits (PyTorch's own matmul gives
    other bits between 1 and 61 rows on this CPU; the kernel's sum does not follow the row count)."""
    n_in, n_out = 96, 80
    w, b = randn(n_out, n_in, seed=5, scale=0.1), randn(n_out, seed=6)
    row = randn(1, n_in, seed=7)
    alone = linear(row, w, b, BLOCKS)[0]
    for rows, at in ((16, 0), (16, 15), (61, 44)):
        x = randn(rows, n_in, seed=rows + at)
        x[at] = row[0]
        assert torch.equal(linear(x, w, b, BLOCKS)[at], alone), (rows, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_is_transformers_llama_rms_norm(dtype):
    """To float32 rounding in float32; in bfloat16 within two roundings of each output (the sum of squares is summed
    in another order than PyTorch's, and transformers rounds twice: the normalised row, then the product)."""
    hidden = 72
    module = LlamaRMSNorm(hidden, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        module.weight.copy_(1 + randn(hidden, seed=8) / 4)
    module = module.to(dtype)
    x = randn(23, hidden, seed=9, scale=3.0).to(dtype)
    got, want = rms_norm(x, module.weight, module.variance_epsilon), module(x)
    assert got.dtype == want.dtype == dtype
    rtol = 1e-6 if dtype == torch.float32 else 2**-6  # bfloat16: 2 units in the last place
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=1e-6)


def test_a_rows_norm_is_the_same_bits_alone_and_among_rows():
    weight = 1 + randn(72, seed=10) / 4
    row = randn(1, 72, seed=11)
    x = randn(40, 72, seed=12)
    x[29] = row[0]
    assert torch.equal(rms_norm(x, weight, 1e-6)[29], rms_norm(row, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_residual_added_in_the_products_launch_is_pytorchs_add_bit_for_bit(dtype):
    """The epilogue's add: the product rounded to the model's dtype, plus the residual, rounded again, as PyTorch's
    ``residual + linear(x)`` rounds it (rows over partial tiles, a bias)."""
    rows, n_in, n_out = 37, 100, 33
    x, w = randn(rows, n_in, seed=11).to(dtype), randn(n_out, n_in, seed=12, scale=n_in**-0.5).to(dtype)
    b, residual = randn(n_out, seed=13).to(dtype), randn(rows, n_out, seed=14, scale=4.0).to(dtype)
    fused = linear(x, w, b, BLOCKS, residual)
    assert fused.dtype == dtype
    assert torch.equal(fused, residual + linear(x, w, b, BLOCKS))


def test_gated_is_silu_of_the_gate_times_up_and_a_rows_bits_are_its_own():
    """A Llama MLP's input to its down projection in one launch: SiLU(x G^T) * (x U^T) to float32 rounding (a
    float64 reference), over partial tiles; and row r's bits the same alone and among 16 or 61 rows."""
    rows, n_in, n_out = 37, 100, 33
    x, g, u = randn(rows, n_in, seed=21), randn(n_out, n_in, seed=22, scale=0.1), randn(n_out, n_in, seed=23, scale=0.1)
    want = F.silu(F.linear(x.double(), g.double())) * F.linear(x.double(), u.double())
    torch.testing.assert_close(gated(x, g, u, BLOCKS).double(), want, rtol=0, atol=1e-5)
    row = randn(1, n_in, seed=24)
    alone = gated(row, g, u, BLOCKS)[0]
    for count, at in ((16, 15), (61, 44)):
        among = randn(count, n_in, seed=count)
        among[at] = row[0]
        assert torch.equal(gated(among, g, u, BLOCKS)[at], alone), (count, at)


def test_gated_rounds_as_transformers_llama_mlp_does_in_bfloat16():
    """Each product to bfloat16, the SiLU to bfloat16, their product to bfloat16: as PyTorch runs
    ``act_fn(gate_proj(x)) * up_proj(x)``, to a unit in the last place (the exponentials differ)."""
    x = randn(20, 64, seed=31).to(torch.bfloat16)
    g, u = (randn(48, 64, seed=s, scale=0.2).to(torch.bfloat16) for s in (32, 33))
    theirs = F.silu(F.linear(x.float(), g.float()).to(torch.bfloat16)) * F.linear(x.float(), u.float()).to(
        torch.bfloat16
    )
    ours = gated(x, g, u, BLOCKS)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=1e-6)


def test_what_they_cannot_run_is_refused():
    with pytest.raises(ValueError, match="gated"):
        gated(randn(3, 8, seed=1), randn(5, 8, seed=2), randn(4, 8, seed=3))
    with pytest.raises(ValueError, match="residual"):
        linear(randn(3, 8, seed=1), randn(5, 8, seed=2), None, BLOCKS, randn(3, 4, seed=3))
    with pytest.raises(ValueError, match="linear"):
        linear(randn(3, 8, seed=1), randn(5, 9, seed=2))
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(randn(3, 8, seed=1), randn(9, seed=2), 1e-6)


def test_the_start_up_check_refuses_wrong_kernels(monkeypatch):
    row_kernels.self_check(64, torch.float32, DEVICE, BLOCKS)  # the real kernels pass
    monkeypatch.setattr(row_kernels, "rms_norm", lambda x, weight, eps: x)  # no normalisation
    with pytest.raises(ValueError, match="RMSNorm"):
        row_kernels.self_check(64, torch.float32, DEVICE, BLOCKS)
    monkeypatch.setattr(row_kernels, "linear", lambda x, weight, bias, blocks: torch.nn.functional.linear(x, weight))
    with pytest.raises(ValueError, match="matrix product"):
        row_kernels.self_check(64, torch.float32, DEVICE, BLOCKS)


def test_a_group_of_weights_gives_each_the_bits_it_gets_alone():
    """q, k and v (or gate and up) in one launch: each weight's outputs side by side, bit for bit its own call's."""
    x = randn(33, 80, seed=13)
    weights = [randn(n, 80, seed=14 + n, scale=0.1) for n in (64, 20, 20)]
    biases = [randn(n, seed=20 + n) for n in (64, 20, 20)]
    for count in (1, 2, 3):
        together = row_kernels.linear_group(x, weights[:count], biases[:count], BLOCKS)
        alone = torch.cat([linear(x, w, b, BLOCKS) for w, b in zip(weights[:count], biases[:count], strict=True)], 1)
        assert torch.equal(together, alone), count
    with pytest.raises(ValueError, match="all with a bias or none"):
        row_kernels.linear_group(x, weights[:2], [biases[0], None], BLOCKS)


@pytest.mark.parametrize("rows_per_program", [None, 1, 4], ids=lambda n: f"rows-{n or 'default'}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_and_store_is_transformers_rotary_embedding_and_the_cache_write_bit_for_bit(dtype, rows_per_program):
    """Rows of three sequences at scattered positions (the last of the capacity among them), more rows than one
    program takes and not a multiple of it: the rotated queries, and the keys and values at each row's slot and
    position, are the bits of transformers' apply_rotary_pos_emb and an indexed write; nothing else of the cache
    changes. One row per program is the GPU's form."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv, d, capacity = 6, 2, 16, 40
    angles = torch.arange(capacity, dtype=torch.float64)[:, None] / 10 ** (torch.arange(d // 2) / (d // 2))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(DEVICE, dtype)  # [C, d]
    sin = torch.cat([angles.sin(), angles.sin()], dim=1).to(DEVICE, dtype)
    rows = 37  # three programs of 16, the last part empty
    qkv = randn(rows, (heads + 2 * kv) * d, seed=15).to(dtype)
    slots = torch.tensor([i % 3 for i in range(rows)], dtype=torch.int32, device=DEVICE)
    # each slot's positions distinct (7 is prime to the capacity), slot 1's first at the capacity's last
    positions = torch.tensor([(7 * (i // 3) + 39 * (i % 3)) % capacity for i in range(rows)], dtype=torch.int32,
                             device=DEVICE)  # fmt: skip
    assert int(positions.max()) == capacity - 1
    keys, values = randn(3, kv, capacity, d, seed=16).to(dtype), randn(3, kv, capacity, d, seed=17).to(dtype)
    want_keys, want_values = keys.clone(), values.clone()

    q = row_kernels.rope_and_store(qkv, cos, sin, positions, slots, keys, values, heads, rows_per_program)

    q_in, k_in, v_in = qkv.split([heads * d, kv * d, kv * d], dim=1)
    at = positions.long()
    want_q, want_k = apply_rotary_pos_emb(
        q_in.view(1, rows, heads, d).transpose(1, 2), k_in.view(1, rows, kv, d).transpose(1, 2), cos[at][None],
        sin[at][None],
    )  # [1, heads | kv, R, d]  # fmt: skip
    want_keys[slots.long(), :, at] = want_k[0].transpose(0, 1)
    want_values[slots.long(), :, at] = v_in.view(rows, kv, d)
    assert torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
