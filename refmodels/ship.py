"""Copy the finished reference pair into the repository with its model card.

    python -m refmodels.ship [--runs refmodels/runs] [--out models/reference]

Takes ``RUNS/{target,draft}/final`` (bfloat16 safetensors + tokenizer), copies them to ``OUT/{target,draft}``
and writes ``OUT/README.md``: shapes and parameter counts, how to run them, the training commands and
seeds, corpus statistics, the loss curves and the final validation losses of both models.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "refmodels.json",
)


def read_curve(run: Path) -> list[dict[str, Any]]:
    path = run / "loss_curve.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def copy_final(run: Path, dest: Path) -> None:
    final = run / "final"
    if not (final / "model.safetensors").is_file():
        raise SystemExit(f"{final} is not a finished run (no model.safetensors); train it to the end first")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in SHIPPED_FILES:
        if (final / name).is_file():
            shutil.copyfile(final / name, dest / name)


def curve_table(curves: dict[str, list[dict[str, Any]]], every: int = 300) -> list[str]:
    rows = ["| step | target val | draft val |", "|---|---|---|"]
    target = {r["step"]: r["val_loss"] for r in curves["target"]}
    draft = {r["step"]: r["val_loss"] for r in curves["draft"]}
    for step in sorted(set(target) | set(draft)):
        if step % every == 0 or step == max(target, default=0) or step == max(draft, default=0):
            cells = [f"{v:.3f}" if v is not None else "-" for v in (target.get(step), draft.get(step))]
            rows.append(f"| {step} | {cells[0]} | {cells[1]} |")
    return rows


def model_card(runs: Path, out: Path) -> str:
    curves = {role: read_curve(runs / role) for role in ("target", "draft")}
    configs = {role: json.loads((runs / role / "run_config.json").read_text()) for role in ("target", "draft")}
    meta = json.loads((runs / "data" / "meta.json").read_text())
    last = {role: curves[role][-1] for role in curves}
    gap = last["draft"]["val_loss"] - last["target"]["val_loss"]
    lines = [
        "# specd reference pair: model card",
        "",
        "A small Llama-style target and a draft that shares its tokenizer, trained by `refmodels/` on text every",
        "Python 3.11 install has (stdlib code, `pydoc_data` prose, seeded JSON/SQL/CSV/log text), so the demo and",
        "the benchmarks need no download. Weights are stored in bfloat16; run them in float32 on CPU "
        "(`--dtype float32`, the default) or bfloat16 on a GPU.",
        "",
        "```bash",
        ".venv/bin/specd generate --target models/reference/target --draft models/reference/draft --k 4 'def main('",
        "```",
        "",
        "| role | parameters | shape |",
        "|---|---|---|",
    ]
    for role in ("target", "draft"):
        spec = configs[role]["model_spec"]
        shape = (
            f"hidden {spec['hidden_size']}, {spec['num_layers']} layers, {spec['num_heads']} heads "
            f"({spec['num_kv_heads']} KV), MLP {spec['intermediate_size']}, context {spec['max_position_embeddings']}"
        )
        lines.append(f"| {role} | {configs[role]['parameters']:,} | {shape} |")
    lines += [
        "",
        "## Training",
        "",
        f"Corpus: {meta['tokens']['train']:,} training tokens; validation tokens "
        + ", ".join(f"{k.removeprefix('val_')} {v:,}" for k, v in meta["tokens"].items() if k.startswith("val_"))
        + f" (held out by document). Tokenizer: byte-level BPE, {meta['vocab_size']} tokens, sha256 "
        f"`{meta['tokenizer_sha256'][:16]}…`; corpus fingerprint `{meta['corpus_fingerprint'][:16]}…`.",
        "",
    ]
    for role in ("target", "draft"):
        cfg = configs[role]["train_config"]
        command = f"python -m refmodels.train --out refmodels/runs/{role} --role {role} --steps {cfg['steps']}"
        lines.append(
            f"- {role}: `{command}` (seed {cfg['seed']}, corpus seed {cfg['corpus_seed']}, batch "
            f"{cfg['batch_size']}×{cfg['seq_len']} tokens, peak lr {cfg['lr']}, bf16 autocast): {last[role]['step']} "
            f"steps, {last[role]['tokens_seen'] / 1e6:.1f}M tokens, {last[role]['wall_seconds'] / 3600:.1f} h "
            "on 2 CPU cores"
        )
    lines += [
        "",
        "## Validation loss (nats/token)",
        "",
        "| role | overall | " + " | ".join(last["target"]["val_loss_by_domain"]) + " |",
        "|---|---|" + "---|" * len(last["target"]["val_loss_by_domain"]),
    ]
    for role in ("target", "draft"):
        by_domain = " | ".join(f"{v:.3f}" for v in last[role]["val_loss_by_domain"].values())
        lines.append(f"| {role} | {last[role]['val_loss']:.3f} | {by_domain} |")
    lines += ["", f"The target is {gap:.2f} nats/token below the draft overall.", "", "Loss curve:", ""]
    lines += curve_table(curves)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("refmodels/runs"))
    parser.add_argument("--out", type=Path, default=Path("models/reference"))
    args = parser.parse_args()
    for role in ("target", "draft"):
        copy_final(args.runs / role, args.out / role)
    (args.out / "README.md").write_text(model_card(args.runs, args.out))
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"shipped to {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
