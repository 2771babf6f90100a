"""The graphs pass's two forms of a matrix product side by side, at a model's weight shapes: ``triton`` (all of a
step's rows in one launch, fixed blocks: decoder/runners/row_kernels.py) against ``tiles`` (PyTorch's F.linear on
16-row tiles, what the pass runs without Triton), with PyTorch's one call over all rows beside them (not
batch-invariant: the speed a free choice of kernel gets).

For each weight shape, row count and block choice it prints each form's time per call (median of ``--repeats``
calls, 10th-90th percentile beside it), the weight bytes over the Triton form's time (GB/s), tiles / triton, and
whether a row got the same bits alone and among the rows; then, per block choice, one layer plus the LM head summed
(``step_ms``: the row-wise products of a 1-token step at 16 rows, times the layers).

    python benchmarks/linear_bench.py --device cuda --dtype bfloat16 --json out.json     # the 1.1B shapes
    python benchmarks/linear_bench.py --smoke      # a CPU, Triton's interpreter, tiny shapes: that it runs

JSON keys: ``rows`` (one per case: ``name``, ``out``, ``in``, ``rows``, ``blocks``, ``triton_ms``,
``triton_range_ms``, ``tiles_ms``, ``tiles_range_ms``, ``torch_ms``, ``tiles_over_triton``, ``triton_gbps``,
``same_bits_alone_and_among_rows``), ``step_ms`` (by blocks: ``triton`` and ``tiles``), ``layers``, ``device``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch
import torch.nn.functional as F

from benchmarks.attention_bench import spread, timed
from decoder.runners.row_kernels import linear

SHAPES = {  # name -> (out, in) per weight, and the layers
    "1b": ({"q": (2048, 2048), "kv": (256, 2048), "o": (2048, 2048), "gate_up": (5632, 2048),
            "down": (2048, 5632), "lm_head": (32000, 2048)}, 22),
    "tiny": ({"q": (128, 128), "gate_up": (384, 128), "down": (128, 384), "lm_head": (384, 128)}, 2),
}  # fmt: skip
PER_LAYER = {"q": 1, "kv": 2, "o": 1, "gate_up": 2, "down": 1}  # calls of each shape per layer
TILE = 16
# the default first, then narrower column tiles (more programs streaming a 1-row step's weights), then wider row tiles
BLOCK_CHOICES = "16,64,64;16,32,128;16,16,256;16,32,256;32,64,64;64,64,64"


def tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x[i : i + TILE], weight) for i in range(0, x.shape[0], TILE)])


def case(name: str, out: int, n_in: int, rows: int, blocks: tuple[int, int, int], args: Any) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(rows * 7 + out)
    weight = (torch.randn(out, n_in, generator=generator) / n_in**0.5).to(device, dtype)
    x = torch.randn(rows, n_in, generator=generator).to(device, dtype)
    alone = linear(x[:1], weight, None, blocks)
    same = bool(torch.equal(linear(x, weight, None, blocks)[:1], alone))
    triton_ms, triton_range = spread(timed(lambda: linear(x, weight, None, blocks), args.repeats, device))
    tiles_ms, tiles_range = spread(timed(lambda: tiles(x, weight), args.repeats, device))
    torch_ms, _ = spread(timed(lambda: F.linear(x, weight), args.repeats, device))
    return {
        "name": name,
        "out": out,
        "in": n_in,
        "rows": rows,
        "blocks": ",".join(map(str, blocks)),
        "triton_ms": round(triton_ms, 4),
        "triton_range_ms": triton_range,
        "tiles_ms": round(tiles_ms, 4),
        "tiles_range_ms": tiles_range,
        "torch_ms": round(torch_ms, 4),
        "tiles_over_triton": round(tiles_ms / max(triton_ms, 1e-9), 3),
        "triton_gbps": round(weight.numel() * weight.element_size() / (triton_ms * 1e-3) / 1e9, 1),
        "same_bits_alone_and_among_rows": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--rows", default="16,64,144,576", help="row counts (a step's rows, whole 16-row tiles)")
    parser.add_argument("--blocks", default=BLOCK_CHOICES, help="M,N,K choices, ;-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes, a few cases")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.device, args.dtype, args.shape, args.repeats, args.rows = "cpu", "float32", "tiny", 2, "16,48"
        args.blocks = "16,64,64;16,128,128"
    weights, layers = SHAPES[args.shape]
    choices = [tuple(int(b) for b in text.split(",")) for text in args.blocks.split(";") if text]
    print(f"{'weight':>8} {'rows':>5} {'blocks':>10} {'triton ms':>10} {'tiles ms':>9} {'torch ms':>9} "
          f"{'tiles/tri':>9} {'GB/s':>7} same-bits")  # fmt: skip
    found, step_ms = [], {}
    for blocks in choices:
        assert len(blocks) == 3
        for rows in (int(r) for r in args.rows.split(",")):
            for name, (out, n_in) in weights.items():
                row = case(name, out, n_in, rows, blocks, args)  # type: ignore[arg-type]
                found.append(row)
                print(f"{name:>8} {rows:>5} {row['blocks']:>10} {row['triton_ms']:>10.4f} {row['tiles_ms']:>9.4f} "
                      f"{row['torch_ms']:>9.4f} {row['tiles_over_triton']:>9.2f} {row['triton_gbps']:>7.1f} "
                      f"{row['same_bits_alone_and_among_rows']}", flush=True)  # fmt: skip
        at_16 = {r["name"]: r for r in found if r["rows"] == 16 and r["blocks"] == ",".join(map(str, blocks))}
        if at_16:
            per_step = {form: sum(at_16[n][f"{form}_ms"] * PER_LAYER.get(n, 0) * layers for n in at_16)
                        + (at_16["lm_head"][f"{form}_ms"] if "lm_head" in at_16 else 0.0)
                        for form in ("triton", "tiles")}  # fmt: skip
            step_ms[",".join(map(str, blocks))] = {k: round(v, 3) for k, v in per_step.items()}
            print(f"  blocks {blocks}: a 1-token step's row-wise products {per_step['triton']:.3f} ms (triton), "
                  f"{per_step['tiles']:.3f} ms (tiles)")  # fmt: skip
        if args.json:  # after each block choice: a run cut short keeps the choices it finished
            doc = {"device": args.device, "dtype": args.dtype, "layers": layers, "rows": found, "step_ms": step_ms}
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["same_bits_alone_and_among_rows"] for r in found) else 1


if __name__ == "__main__":
    sys.exit(main())
