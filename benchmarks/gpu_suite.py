"""The GPU measurements in one command, for a session lent a GPU for 30 minutes: run it in ONE device call.

The call (the device tool's ``run``; the whole command, well under its 2,000 characters):

    run(kind="nvidia-h100-x1", timeout_s=600, carry=[".whl"],
        command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py")

``.whl`` is optional: the GPU image has torch, transformers, pytest and hypothesis, which is all these steps import
(``tests/decoder`` and the benchmarks need neither the controller nor the worker's HTTP stack). Wheels found there
are installed first, as /work/.library/device/README.md says; a carry of a folder that is not here is harmless.
What comes back under files_at: ``suite.log`` (every step's output), ``summary.json`` (each step's exit status
and seconds, every figure against its goal (``GOALS``), and every step's JSON) and ``results.tar.gz`` (each step's
JSON and log). They are rewritten after every step, so a call cut short still returns the steps that finished.

Steps, in order, each in its own process group with its own time limit (cut to what is left of ``--budget``, so
one hang costs its own step only):

  env                 the GPU, the driver, torch and transformers as seen there
  pair                ``python -m decoder.tiny --shape 1b``: TinyLlama-1.1B's shape + a ~40M draft, bf16, in /tmp
  pytest              SPECD_TEST_DEVICE=cuda pytest tests/decoder
                      -k "invariant or graph or runners or piece or row_kernels"
  attention           benchmarks/attention_bench.py: one layer's attention at the 1b shape, the pieces kernel beside
                      the capacity form, batch 1/8/64 x width 1/5/9 x length 128/1024/2048, a piece-size sweep
  linear              benchmarks/linear_bench.py: the 1b weight shapes' matrix products, the Triton form (all rows,
                      four block choices) beside 16-row tiles and PyTorch's one call, at 16/64/144/576 rows
  decode_1b_auto      decode_loop on the 1b pair, runner auto (the graphs pass, its Triton forms): the step, kernels,
                      first visits, roofline, v(K) to 8, transformers' generate() beside ours, and the α × K speedup
                      curve (set-acceptance drafter)
  decode_1b_capacity  the same pass in its PyTorch forms (SPECD_GRAPH_ATTENTION=capacity, SPECD_GRAPH_ROWS=tiles),
                      plain decoding only: the before of the kernels that replace them
  worker_throughput_1b  the batch engine on the 1b pair, batch 1..64, no speculation (batch 64 / batch 1)
  worker_throughput   the batch engine on the shipped pair, batch 1..64, none and draft
  decode_ref_auto     decode_loop on the shipped pair, runner auto, every variant
  decode_ref_lean     the same with the lean pass (beside auto's graphs pass)
  decode_1b_lean      decode_loop on the 1b pair with the lean pass (beside auto's graphs pass)

``--smoke`` runs the same steps on the CPU with the tiny shape and fewer tokens, in under six minutes (the Triton
kernels under Triton's interpreter): the check that the suite works end to end before device time is spent on it.

    python benchmarks/gpu_suite.py --smoke            # here, on the CPU
    python benchmarks/gpu_suite.py --list             # the steps and their commands
    python benchmarks/gpu_suite.py --only pytest      # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".whl"
SITE = Path("/tmp/site")  # where carried wheels are installed (the device README's recipe)
GPU_BUDGET_S = 530  # the run's limit is 600 s: this leaves room for the machine's start-up work and the bundle
SMOKE_BUDGET_S = 360
BUNDLE = ("suite.log", "summary.json", "results.tar.gz")  # what comes back: at most 8 files


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    max_seconds: int
    json_name: str | None = None  # the JSON file it writes under the work folder
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class Outcome:
    name: str
    rc: int | None  # None: not run (no time left, or the step it needs failed)
    seconds: float = 0.0
    timed_out: bool = False
    note: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def plan(smoke: bool, work: Path, python: str) -> list[Step]:
    """The suite's steps. ``smoke``: the same on the CPU, with the tiny shape and fewer tokens."""
    pair = work / "pair"
    ref = ("--target", "models/reference/target", "--draft", "models/reference/draft")
    mine = ("--target", str(pair / "target"), "--draft", str(pair / "draft"))
    device = ("--device", "cpu", "--dtype", "float32") if smoke else ("--device", "cuda", "--dtype", "bfloat16")
    decode = (python, "-m", "benchmarks.decode_loop", *device)
    if smoke:
        big = ("--prompts", "2", "--repeats", "1", "--max-new-tokens", "24", "--engine-costs-prompts", "1")
        curve = ("--alphas", "0.5,0.7,0.9", "--ks", "1,4")
        ref_run = ("--prompts", "2", "--repeats", "1", "--max-new-tokens", "24", "--engine-costs-prompts", "1")
        lean_big = ("--prompts", "1", "--repeats", "1", "--max-new-tokens", "16", "--engine-costs-prompts", "0")
        batches = ("--batches", "1,2,4,8,16,32,64", "--tokens", "8", "--repeats", "1")
    else:
        big = ("--prompts", "3", "--repeats", "2", "--max-new-tokens", "48", "--engine-costs-prompts", "1")
        curve = ("--alphas", "0.5,0.7,0.9", "--ks", "1,2,4,8")
        ref_run = ("--prompts", "6", "--repeats", "2", "--max-new-tokens", "64", "--engine-costs-prompts", "2")
        lean_big = ("--prompts", "2", "--repeats", "1", "--max-new-tokens", "32", "--engine-costs-prompts", "0")
        batches = ("--batches", "1,2,4,8,16,32,64", "--tokens", "32", "--repeats", "2")
    test_device = "cpu" if smoke else "cuda"
    pytest = (
        python,
        "-m",
        "pytest",
        "tests/decoder",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "invariant or graph or runners or piece or row_kernels",
    )
    attention = (python, "-m", "benchmarks.attention_bench", *(("--smoke",) if smoke else ()))
    linear = (python, "-m", "benchmarks.linear_bench", *(("--smoke",) if smoke else ()))
    linear_rows = () if smoke else ("--rows", "16,64,144")  # a 1-token step, batch 64 x 1, batch 16 x 9

    def throughput_of(models: tuple[str, ...]) -> tuple[str, ...]:
        return (python, "-m", "benchmarks.worker_throughput", *models, *device, "--runner", "auto", *batches)

    def decode_step(name: str, models: tuple[str, ...], runner: str, settings: tuple[str, ...], seconds: int) -> Step:
        json_name = f"{name}.json"
        argv = (*decode, *models, "--runner", runner, *settings, "--json", str(work / json_name))
        return Step(name, argv, seconds, json_name)

    return [
        Step("env", (python, "-m", "benchmarks.gpu_suite", "--env", str(work / "env.json")), 60, "env.json"),
        Step("pair", (python, "-m", "decoder.tiny", "--shape", "tiny" if smoke else "1b", "--out", str(pair)), 120),
        Step("pytest", pytest, 200 if smoke else 100, env=(("SPECD_TEST_DEVICE", test_device),)),
        Step("attention", (*attention, "--json", str(work / "attention.json")), 45, "attention.json"),
        Step("linear", (*linear, *linear_rows, "--json", str(work / "linear.json")), 60, "linear.json"),
        decode_step("decode_1b_auto", mine, "auto", (*big, "--variants", "hf-plain,ours-none,ours-draft", *curve), 150),
        Step(
            "decode_1b_capacity",
            (
                *decode,
                *mine,
                "--runner",
                "auto",
                *lean_big,
                "--variants",
                "ours-none",
                "--json",
                str(work / "decode_1b_capacity.json"),
            ),
            60,
            "decode_1b_capacity.json",
            env=(("SPECD_GRAPH_ATTENTION", "capacity"), ("SPECD_GRAPH_ROWS", "tiles")),
        ),
        Step(
            "worker_throughput_1b",
            (*throughput_of(mine), "--variants", "none", "--json", str(work / "worker_throughput_1b.json")),
            80,
            "worker_throughput_1b.json",
        ),
        Step(
            "worker_throughput",
            (*throughput_of(ref), "--variants", "none,draft", "--json", str(work / "worker_throughput.json")),
            80,
            "worker_throughput.json",
        ),
        decode_step("decode_ref_auto", ref, "auto", ref_run, 60),
        decode_step("decode_ref_lean", ref, "lean", ref_run, 60),
        decode_step("decode_1b_lean", mine, "lean", (*lean_big, "--variants", "hf-plain,ours-none"), 60),
    ]


# a step that cannot run when another failed
NEEDS = {name: "pair" for name in ("decode_1b_auto", "decode_1b_capacity", "worker_throughput_1b", "decode_1b_lean")}


def run_step(step: Step, seconds: float, log: Path, env: dict[str, str]) -> Outcome:
    """Run ``step`` in its own process group for at most ``seconds``, its output into ``log``."""
    started = time.monotonic()
    with log.open("w") as out:
        out.write(f"$ {' '.join(step.argv)}\n")
        out.flush()
        process = subprocess.Popen(
            step.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**env, **dict(step.env)},
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = process.wait(timeout=seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            rc, timed_out = process.wait(), True
    return Outcome(step.name, rc, time.monotonic() - started, timed_out)


def child_env() -> dict[str, str]:
    """The steps' environment: the repository (and installed wheels) on the path, unbuffered output, offline."""
    paths = [str(REPO), *([str(SITE)] if SITE.is_dir() else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def install_wheels() -> str:
    """Install the carried wheels (.whl/*.whl) into /tmp/site, as the device README says; '' when there are none."""
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    if not wheels:
        return ""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--upgrade", "--target", str(SITE), *wheels],
        check=True,
    )  # fmt: skip
    return f"installed {len(wheels)} wheels into {SITE}"


# ---- the summary: each figure beside its goal ----------------------------------------------------------------------


def load(work: Path, name: str | None) -> dict[str, Any] | None:
    if name is None or not (work / name).is_file():
        return None
    try:
        value = json.loads((work / name).read_text())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def decode_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures ``GOALS`` holds to their goals, from one decode_loop JSON."""
    variants = doc.get("variants", {})
    alone = doc.get("costs", {}).get("forward_alone", {})
    roof = doc.get("step_roofline", {}).get("target", {})
    visits = doc.get("first_visit_ms") or {}
    figures: dict[str, Any] = {
        "runner": doc.get("forward_pass", {}).get("runner"),
        "forms": {key: doc.get("forward_pass", {}).get(key) for key in ("attention", "rows", "fallbacks")},
        "target_step_ms": alone.get("target_step_ms"),
        "roofline_step_ms": roof.get("roofline_step_ms"),
        "read_gbps": doc.get("step_roofline", {}).get("read_gbps_median"),
        "bandwidth_share": roof.get("achieved_share"),
        "kernels_per_step": doc.get("kernels_per_step", {}).get("target"),
        "kernels_unit": doc.get("kernels_per_step", {}).get("unit"),
        "first_visit_ratio": visits.get("ratio"),
        "v_by_k": doc.get("v_by_k"),
        "v_max_k_le_8": max(doc.get("v_by_k", [0.0])[1:9], default=None),
        "same_tokens": {name: v.get("same_tokens") for name, v in variants.items()},
    }
    if "ours-none" in variants and "hf-plain" in variants:
        figures["ours_over_transformers"] = variants["ours-none"]["tokens_per_second"] / max(
            variants["hf-plain"]["tokens_per_second"], 1e-9
        )
    curve = doc.get("speedup_curve") or []
    at_07 = [row for row in curve if abs(row["alpha"] - 0.7) < 1e-9]
    if at_07:
        best = max(at_07, key=lambda row: row["speedup"])
        figures["best_at_alpha_0.7"] = {"k": best["k"], "speedup": best["speedup"], "range": best["speedup_range"]}
    return figures


def worker_figures(doc: dict[str, Any]) -> dict[str, Any]:
    batches = doc.get("batches", {})
    none = {b: row["none"]["tokens_per_second"] for b, row in batches.items() if "none" in row}
    figures: dict[str, Any] = {"none_tokens_per_second": none}
    if "1" in none and "64" in none:
        figures["batch64_over_batch1"] = none["64"] / max(none["1"], 1e-9)
    figures["same_tokens"] = {b: {d: v.get("same_tokens") for d, v in row.items()} for b, row in batches.items()}
    return figures


def attention_figures(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc.get("rows", [])
    longest = [r for r in rows if r["batch"] == 1 and r["width"] == 1 and r["piece"] == 256]
    return {
        "same_bits_everywhere": all(r["same_bits_alone_and_batched"] for r in rows) if rows else None,
        "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None),
        "capacity_over_pieces_b1_longest": longest[-1]["capacity_over_pieces"] if longest else None,
        "pieces_gbps_best": max((r["pieces_gbps"] for r in rows), default=None),
    }


GOALS = (  # (step, figure, goal, holds): what each GPU figure must reach
    ("decode_1b_auto", "target_step_ms", "<= 0.8 ms", lambda x: x <= 0.8),
    ("decode_1b_auto", "bandwidth_share", ">= 0.65", lambda x: x >= 0.65),
    ("decode_1b_auto", "v_max_k_le_8", "<= 1.10", lambda x: x <= 1.10),
    ("decode_1b_auto", "first_visit_ratio", "<= 1.5", lambda x: x <= 1.5),
    ("decode_1b_auto", "ours_over_transformers", ">= 8", lambda x: x >= 8),
    ("decode_ref_auto", "target_step_ms", "<= 0.2 ms", lambda x: x <= 0.2),
    ("worker_throughput_1b", "batch64_over_batch1", ">= 30", lambda x: x >= 30),
    ("attention", "same_bits_everywhere", "true", lambda x: x is True),
    ("linear", "same_bits_everywhere", "true", lambda x: x is True),
)


def summarize(outcomes: list[Outcome], work: Path, steps: list[Step], smoke: bool) -> dict[str, Any]:
    by_name = {s.name: s for s in steps}
    results: dict[str, Any] = {}
    for outcome in outcomes:
        doc = load(work, by_name[outcome.name].json_name)
        if doc is None:
            continue
        results[outcome.name] = doc
        if outcome.name.startswith("decode_"):
            outcome.figures = decode_figures(doc)
        elif outcome.name.startswith("worker_throughput"):
            outcome.figures = worker_figures(doc)
        elif outcome.name == "attention":
            outcome.figures = attention_figures(doc)
        elif outcome.name == "linear":
            cases = doc.get("rows", [])
            same = all(r["same_bits_alone_and_among_rows"] for r in cases) if cases else None
            outcome.figures = {"step_ms": doc.get("step_ms"), "same_bits_everywhere": same}
    figures = {o.name: o.figures for o in outcomes}
    goals = []
    for step, name, goal, holds in GOALS:
        value = figures.get(step, {}).get(name)
        goals.append({"step": step, "figure": name, "goal": goal, "value": value,
                      "met": None if value is None else bool(holds(value))})  # fmt: skip
    at_07 = figures.get("decode_1b_auto", {}).get("best_at_alpha_0.7")
    goals.append({"step": "decode_1b_auto", "figure": "best_at_alpha_0.7", "goal": ">= 2.0x target-only",
                  "value": at_07, "met": None if at_07 is None else at_07["speedup"] >= 2.0})  # fmt: skip
    return {
        "smoke": smoke,
        "steps": [
            {"name": o.name, "rc": o.rc, "seconds": round(o.seconds, 1), "timed_out": o.timed_out, "note": o.note}
            for o in outcomes
        ],
        "goals": goals,  # on the CPU (--smoke) they say nothing: the GPU's figures are what they are for
        "figures": figures,
        "results": results,
    }


def write_bundle(out: Path, work: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.json")) + sorted(work.glob("*.log")):
            tar.add(path, arcname=path.name)


def print_goals(summary: dict[str, Any]) -> None:
    print("\n== steps")
    for s in summary["steps"]:
        status = "not run" if s["rc"] is None else ("TIMED OUT" if s["timed_out"] else f"rc {s['rc']}")
        print(f"  {s['name']:<18} {status:<10} {s['seconds']:>6.1f} s  {s['note']}")
    print("== goals" + ("  [smoke run on the CPU: the figures say nothing about a GPU]" if summary["smoke"]
                                  else ""))  # fmt: skip
    for g in summary["goals"]:
        mark = {True: "met", False: "MISSED", None: "-"}[g["met"]]
        print(f"  {g['step']:<18} {g['figure']:<24} {g['goal']:<20} {json.dumps(g['value']):<40} {mark}")


def environment() -> dict[str, Any]:
    """The machine as the suite's Python sees it."""
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}  # fmt: skip
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
                 "bf16": torch.cuda.is_bf16_supported(), "cudnn": torch.backends.cudnn.version()}  # fmt: skip
        try:
            smi = ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem", "--format=csv"]
            info["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the same steps on the CPU, tiny shape, < 6 minutes")
    parser.add_argument("--out", type=Path, default=None, help="where the bundle goes (default $OUT, else a /tmp dir)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all steps together")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument("--env", type=Path, default=None, help=argparse.SUPPRESS)  # the env step's own work
    args = parser.parse_args()
    if args.env is not None:
        args.env.write_text(json.dumps(environment(), indent=2) + "\n")
        print(json.dumps(environment(), indent=2))
        return 0

    out = args.out or Path(os.environ.get("OUT") or f"/tmp/specd-gpu-suite{'-smoke' if args.smoke else ''}")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(f"/tmp/specd-gpu-suite-work{'-smoke' if args.smoke else ''}")  # the 1b pair is 2.2 GB: never $OUT
    work.mkdir(parents=True, exist_ok=True)
    steps = plan(args.smoke, work, sys.executable)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            parser.error(f"unknown steps {', '.join(sorted(unknown))}; the steps: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in wanted]
    if args.list:
        for s in steps:
            print(f"{s.name} (<= {s.max_seconds} s): {' '.join(s.argv)}")
        return 0

    budget = args.budget or (SMOKE_BUDGET_S if args.smoke else GPU_BUDGET_S)
    deadline = time.monotonic() + budget
    suite_log = out / "suite.log"
    note = install_wheels()
    suite_log.write_text(f"specd GPU suite{' (smoke, CPU)' if args.smoke else ''}, budget {budget:.0f} s. {note}\n")
    env = child_env()
    outcomes: list[Outcome] = []
    for step in steps:
        left = deadline - time.monotonic()
        needed = NEEDS.get(step.name)
        failed = next((o for o in outcomes if o.name == needed and o.rc != 0), None)
        if failed is not None:
            outcomes.append(Outcome(step.name, None, note=f"skipped: {needed} failed"))
        elif left < 15:
            outcomes.append(Outcome(step.name, None, note=f"skipped: {left:.0f} s left of the budget"))
        else:
            seconds = min(step.max_seconds, left)
            print(f"== {step.name} (<= {seconds:.0f} s)", flush=True)
            log = work / f"{step.name}.log"
            if step.json_name is not None:
                (work / step.json_name).unlink(missing_ok=True)  # a figure from an earlier suite is not this one's
            outcome = run_step(step, seconds, log, env)
            outcome.note = f"cut at {seconds:.0f} s" if outcome.timed_out else ""
            outcomes.append(outcome)
            text = log.read_text(errors="replace")
            with suite_log.open("a") as f:
                f.write(
                    f"\n== {step.name}: rc {outcome.rc}, {outcome.seconds:.1f} s{', TIMED OUT' * outcome.timed_out}\n"
                )
                f.write(text)
            print("\n".join(text.splitlines()[-12:]), flush=True)
        write_bundle(out, work, summarize(outcomes, work, steps, args.smoke))  # after every step: a cut call keeps it
    summary = summarize(outcomes, work, steps, args.smoke)
    write_bundle(out, work, summary)
    print_goals(summary)
    print(f"\nwrote {', '.join(str(out / name) for name in BUNDLE)}")
    return 0 if all(o.rc == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
