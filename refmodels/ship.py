"""Copy finished reference models into the repository and (re)write their model card.

    python -m refmodels.ship [--runs refmodels/runs] [--out models/reference] [--roles target,draft]

For each role, takes ``RUNS/ROLE/final`` (bfloat16 safetensors + tokenizer + ``refmodels.json``) into
``OUT/ROLE`` together with the run's loss curve. A run that continued an earlier model (``--init-from``)
ships the earlier curve followed by its own, steps counted from the start. The card (``OUT/README.md``) is
built from the shipped folders only, so one role can be retrained and re-shipped while the other stays.
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
CURVE = "loss_curve.jsonl"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def total_steps(summary: dict[str, Any]) -> int:
    """Steps of this run and of every run it continued."""
    earlier = summary.get("init_from")
    return int(summary["steps"]) + (total_steps(earlier) if earlier else 0)


def shipped_curve(run: Path, dest: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's curve, after the curve of the model it continued (read before ``dest`` is replaced)."""
    earlier: list[dict[str, Any]] = []
    offset = 0
    init = summary.get("init_from")
    if init:
        offset = total_steps(init)
        earlier = [r for r in read_jsonl(Path(init["path"]) / CURVE) if r["step"] <= offset]
    own = [{**r, "step": r["step"] + offset, "stage": len(_chain(summary))} for r in read_jsonl(run / CURVE)]
    return earlier + own


def ship_role(run: Path, dest: Path) -> None:
    final = run / "final"
    if not (final / "model.safetensors").is_file():
        raise SystemExit(f"{final} is not a finished run (no model.safetensors); train it to the end first")
    summary = json.loads((final / "refmodels.json").read_text())
    curve = shipped_curve(run, dest, summary)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in SHIPPED_FILES:
        if (final / name).is_file():
            shutil.copyfile(final / name, dest / name)
    (dest / CURVE).write_text("".join(json.dumps(r) + "\n" for r in curve))


def _chain(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that made a model, first to last."""
    earlier = summary.get("init_from")
    return [*(_chain(earlier) if earlier else []), summary]


def command_of(summary: dict[str, Any]) -> str:
    cfg = summary["train_config"]
    role = cfg["role"]
    parts = [f"python -m refmodels.train --out refmodels/runs/{role} --role {role} --steps {cfg['steps']}"]
    if summary.get("init_from"):
        init = summary["init_from"]["path"]
        parts.append(f"--lr {cfg['lr']} --warmup-steps {cfg['warmup_steps']} --init-from {init}")
    return " ".join(parts)


def curve_table(curves: dict[str, list[dict[str, Any]]], every: int = 300) -> list[str]:
    rows = ["| step | target val | draft val |", "|---|---|---|"]
    by_role = {role: {r["step"]: r["val_loss"] for r in curve} for role, curve in curves.items()}
    last = {role: max(points, default=0) for role, points in by_role.items()}
    for step in sorted(set().union(*by_role.values())):
        if step % every == 0 or step in last.values():
            cells = [by_role[role].get(step) for role in ("target", "draft")]
            rows.append(f"| {step} | " + " | ".join(f"{v:.3f}" if v is not None else "-" for v in cells) + " |")
    return rows


def model_card(out: Path, meta: dict[str, Any]) -> str:
    summaries = {role: json.loads((out / role / "refmodels.json").read_text()) for role in ("target", "draft")}
    configs = {role: json.loads((out / role / "config.json").read_text()) for role in ("target", "draft")}
    curves = {role: read_jsonl(out / role / CURVE) for role in ("target", "draft")}
    gap = summaries["draft"]["final_val_loss"] - summaries["target"]["final_val_loss"]
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
        c = configs[role]
        shape = (
            f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads "
            f"({c['num_key_value_heads']} KV), MLP {c['intermediate_size']}, context {c['max_position_embeddings']}"
        )
        lines.append(f"| {role} | {summaries[role]['parameters']:,} | {shape} |")
    lines += [
        "",
        "## Training",
        "",
        f"Corpus: {meta['tokens']['train']:,} training tokens; validation tokens "
        + ", ".join(f"{k.removeprefix('val_')} {v:,}" for k, v in meta["tokens"].items() if k.startswith("val_"))
        + f" (held out by document). Tokenizer: byte-level BPE, {meta['vocab_size']} tokens, sha256 "
        f"`{meta['tokenizer_sha256'][:16]}…`; corpus fingerprint `{meta['corpus_fingerprint'][:16]}…`.",
        "",
        "Each model, run by run (seed 0, corpus seed 0, batch 16×256 tokens, bf16 autocast, 2 CPU cores):",
        "",
    ]
    for role in ("target", "draft"):
        for i, run in enumerate(_chain(summaries[role]), start=1):
            cfg = run["train_config"]
            lines.append(
                f"- {role}, run {i}: `{command_of(run)}` (peak lr {cfg['lr']}): {run['steps']} steps, "
                f"{run['tokens_seen'] / 1e6:.1f}M tokens, {run['wall_seconds'] / 3600:.2f} h, "
                f"val loss {run.get('pretrained', run)['final_val_loss']:.3f}"
            )
    lines += distillation(summaries["draft"])
    by_domain = summaries["target"]["final_val_loss_by_domain"]
    lines += [
        "",
        "## Validation loss (nats/token)",
        "",
        "| role | overall | " + " | ".join(by_domain) + " |",
        "|---|---|" + "---|" * len(by_domain),
    ]
    for role in ("target", "draft"):
        s = summaries[role]
        cells = " | ".join(f"{s['final_val_loss_by_domain'][d]:.3f}" for d in by_domain)
        lines.append(f"| {role} | {s['final_val_loss']:.3f} | {cells} |")
    lines += ["", f"The target is {gap:.2f} nats/token below the draft overall.", "", "Loss curve (steps counted"
              " from the first run; points before a run's own folder existed come from the card that shipped them, see"
              " `source` in `loss_curve.jsonl`):", ""]  # fmt: skip
    lines += curve_table(curves)
    return "\n".join(lines) + "\n"


def distillation(summary: dict[str, Any]) -> list[str]:
    """The distillation stages a model went through after pretraining (``distilled`` in its refmodels.json)."""
    stages = summary.get("distilled") or []
    if not stages:
        return []
    lines = [
        "",
        "Then distilled from the target (`specd distill`, forward KL on the target's logits, 10% of the batches",
        "the target's own greedy continuations), stage by stage, each from the previous stage's weights:",
        "",
    ]
    for i, stage in enumerate(stages, start=1):
        r = stage["report"]
        lines.append(
            f"- stage {i}: `{stage['command']}` on {stage['device']}: {r['steps']} steps, {r['tokens'] / 1e6:.1f}M "
            f"tokens, {r['seconds'] / 60:.1f} min; held-out greedy α (K = {r['eval_k']}, {r['eval_prompts']} "
            f"prompts) {r['alpha_before']:.3f} → {r['alpha_after']:.3f}, "
            f"KL {r['kl_before']:.3f} → {r['kl_after']:.3f}, "
            f"top-1 agreement {r['agreement_before']:.3f} → {r['agreement_after']:.3f}"
        )
    pre = summary.get("pretrained")
    if pre:
        lines += [
            "",
            f"Before distillation the draft's validation loss was {pre['final_val_loss']:.3f}; the table "
            "below is the shipped (distilled) draft's, measured on its bfloat16 weights run in float32.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("refmodels/runs"))
    parser.add_argument("--out", type=Path, default=Path("models/reference"))
    parser.add_argument("--roles", default="target,draft", help="which roles to (re)ship; the others stay")
    args = parser.parse_args()
    for role in args.roles.split(","):
        ship_role(args.runs / role, args.out / role)
    meta = json.loads((args.runs / "data" / "meta.json").read_text())
    (args.out / "README.md").write_text(model_card(args.out, meta))
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"shipped to {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
