"""The graphs pass's two attentions side by side, one layer's call at a model's shape: ``pieces`` (one Triton kernel
for every sequence, over its own length: decoder/runners/piece_attention.py) against ``capacity`` (one fixed-shape
call per sequence over the whole capacity: decoder/runners/capacity_attention.py).

For each batch, width (query rows per sequence) and length it prints each form's time per call (median of
``--repeats`` timed calls, with the 10th-90th percentile range), the ratio capacity / pieces, the bytes the pieces
form must read (each sequence's keys and values up to its length) as GB/s, the largest difference between the two
forms, and whether the pieces form gave a sequence the same bits alone and among the batch. ``--pieces`` sweeps the
piece size.

    python benchmarks/attention_bench.py --device cuda --dtype bfloat16 --json out.json     # the 1.1B shape
    python benchmarks/attention_bench.py --smoke      # a CPU, Triton's interpreter, a tiny shape: that it runs

JSON keys: ``rows`` (one per case: ``batch``, ``width``, ``length``, ``piece``, ``pieces_ms``, ``pieces_range_ms``,
``capacity_ms``, ``capacity_range_ms``, ``capacity_over_pieces``, ``pieces_gbps``, ``max_abs_diff``,
``same_bits_alone_and_batched``), ``shape``, ``device``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch

from decoder.runners.capacity_attention import attend_sequences, visible_positions
from decoder.runners.piece_attention import attend_pieces

SHAPES = {  # heads, kv heads, head size, capacity
    "1b": (32, 4, 64, 2048),
    "tiny": (4, 2, 16, 256),
}


def timed(call: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds per call, ``repeats`` times, after two warm-up calls."""
    for _ in range(2):
        call()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            out.append((time.perf_counter() - began) * 1e3)
    return out


def spread(samples: list[float]) -> tuple[float, list[float]]:
    ordered = sorted(samples)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return statistics.median(samples), [round(at(0.1), 4), round(at(0.9), 4)]


def case(
    shape: tuple[int, int, int, int],
    batch: int,
    width: int,
    length: int,
    piece: int,
    k_max: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    heads, kv, d, capacity = shape
    generator = torch.Generator().manual_seed(batch * 131 + width * 7 + length)
    keys = torch.randn(batch + 1, kv, capacity, d, generator=generator).to(device, dtype)
    values = torch.randn(batch + 1, kv, capacity, d, generator=generator).to(device, dtype)
    rows = batch * width
    q = torch.randn(rows, heads, d, generator=generator).to(device, dtype)
    positions = torch.tensor(
        [length - width + j for _ in range(batch) for j in range(width)], dtype=torch.int32, device=device
    )
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    query_rows = k_max + 1
    scaling = d**-0.5
    query_positions = torch.nn.functional.pad(positions.view(batch, width), (0, query_rows - width))
    visible = visible_positions(torch.arange(capacity, dtype=torch.int32, device=device), query_positions)

    def pieces() -> torch.Tensor:
        return attend_pieces(q, keys, values, slots, positions, width, query_rows, scaling, piece)

    def whole() -> torch.Tensor:
        return attend_sequences(q, keys, values, slots, visible, width, scaling)

    got, want = pieces(), whole()
    alone = attend_pieces(
        q[:width], keys, values, slots[:1], positions[:width], width, query_rows, scaling, piece
    )  # the first sequence by itself
    pieces_ms, pieces_range = spread(timed(pieces, repeats, device))
    capacity_ms, capacity_range = spread(timed(whole, repeats, device))
    bytes_read = 2 * batch * kv * length * d * keys.element_size()
    return {
        "batch": batch,
        "width": width,
        "length": length,
        "piece": piece,
        "pieces_ms": round(pieces_ms, 4),
        "pieces_range_ms": pieces_range,
        "capacity_ms": round(capacity_ms, 4),
        "capacity_range_ms": capacity_range,
        "capacity_over_pieces": round(capacity_ms / max(pieces_ms, 1e-9), 3),
        "pieces_gbps": round(bytes_read / (pieces_ms * 1e-3) / 1e9, 1),
        "max_abs_diff": float((got.float() - want.float()).abs().max()),
        "same_bits_alone_and_batched": bool(torch.equal(alone, got[:width])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--widths", default="1,5,9")
    parser.add_argument("--lengths", default="128,1024,2048")
    parser.add_argument("--pieces", default="64,128,256,512", help="piece sizes (the first batch and width only)")
    parser.add_argument("--piece", type=int, default=256, help="the piece size of the main grid")
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shape, a few cases")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.device, args.dtype, args.shape, args.repeats, args.piece = "cpu", "float32", "tiny", 2, 64
        args.batches, args.widths, args.lengths, args.pieces = "1,4", "1,5", "100,256", "64,128"
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    grid = [(b, w, n, args.piece) for b in ints(args.batches) for w in ints(args.widths) for n in ints(args.lengths)]
    first = (ints(args.batches)[0], ints(args.widths)[0])
    grid += [(*first, n, p) for n in ints(args.lengths) for p in ints(args.pieces) if p != args.piece]
    print(f"{'batch':>5} {'width':>5} {'length':>6} {'piece':>5} {'pieces ms':>10} {'capacity ms':>11} "
          f"{'cap/pieces':>10} {'GB/s':>7} {'max diff':>9} same-bits")  # fmt: skip
    rows = []
    for batch, width, length, piece in grid:
        row = case(shape, batch, width, length, piece, args.k_max, dtype, device, args.repeats)
        rows.append(row)
        print(f"{batch:>5} {width:>5} {length:>6} {piece:>5} {row['pieces_ms']:>10.4f} {row['capacity_ms']:>11.4f} "
              f"{row['capacity_over_pieces']:>10.2f} {row['pieces_gbps']:>7.1f} {row['max_abs_diff']:>9.2e} "
              f"{row['same_bits_alone_and_batched']}", flush=True)  # fmt: skip
    if args.json:
        doc = {"shape": dict(zip(("heads", "kv_heads", "head_dim", "capacity"), shape, strict=True)),
               "device": str(device), "dtype": args.dtype, "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["same_bits_alone_and_batched"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
