"""Tokenizing a long prompt whole against tokenizing it with the worker's cap (decoder/capped_encoding.py), side by
side in one run, on the reference tokenizer: random CJK (one pre-token as long as the text) and prose (short
pieces), at each cap. Prints the median seconds of each, the ratio whole / capped with its spread (the ratios of
the runs, each run timing both in turn), and checks that a prompt within the cap gets the tokenizer's own ids.

    python benchmarks/capped_tokenizing.py [--chars 199000] [--caps 32768,4096] [--runs 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer  # noqa: E402

from decoder.capped_encoding import CappedEncoder, TooLong  # noqa: E402

PROSE_SOURCE = REPO / "README.md"


def texts(chars: int) -> dict[str, str]:
    rng = random.Random(0)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(chars))
    source = PROSE_SOURCE.read_text()
    prose = (source * (chars // len(source) + 1))[:chars]
    return {"cjk": cjk, "prose": prose}


def seconds(work: object) -> float:
    started = time.perf_counter()
    work()  # type: ignore[operator]
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=199_000)
    parser.add_argument("--caps", default="32768,4096")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "reference" / "target", local_files_only=True)
    tokenizer.model_max_length = 1 << 62  # no length warning: the worker's own limit is the cap
    encoder = CappedEncoder.of(tokenizer)
    if encoder is None:
        print("the reference tokenizer is not capped: nothing to compare", file=sys.stderr)
        return 1
    results = []
    for name, text in texts(args.chars).items():
        whole_ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        for cap in (int(c) for c in args.caps.split(",")):
            within = whole_ids[:cap]
            prefix = tokenizer.decode(within[: max(1, cap // 2)])
            assert encoder.encode(prefix, cap) == list(tokenizer(prefix, add_special_tokens=True)["input_ids"])
            whole, capped = [], []
            for _ in range(args.runs):
                whole.append(seconds(lambda t=text: tokenizer(t, add_special_tokens=True)["input_ids"]))
                capped.append(seconds(lambda t=text, c=cap: encoder.encode(t, c)))
            refused = encoder.encode(text, cap)
            assert isinstance(refused, TooLong)
            ratios = sorted(w / c for w, c in zip(whole, capped, strict=True))
            row = {
                "text": name, "chars": len(text), "tokens": len(whole_ids), "cap": cap,
                "whole_s": statistics.median(whole), "capped_s": statistics.median(capped),
                "whole_over_capped": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
                "counted_at_refusal": refused.at_least,
            }  # fmt: skip
            results.append(row)
            print(f"{name:6} {len(text):>8,} chars {len(whole_ids):>8,} tokens  cap {cap:>6,}:  whole "
                  f"{row['whole_s'] * 1e3:7.1f} ms  capped {row['capped_s'] * 1e3:7.1f} ms  whole/capped "
                  f"{row['whole_over_capped']:.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}]  refused at "
                  f"{refused.at_least:,}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
