"""The GPU tooling, checked on the CPU: the 1b-shaped pair, decode_loop's GPU figures, the GPU suite's plan.

None of these measure a GPU; they check that a session lent one spends its minutes measuring, not debugging: the
pair has the shape the goals are stated for, decode_loop writes every figure the suite summarises (and every key its
other readers use), and the one prepared command runs what the goals ask for with the limits the device tool sets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_suite
from benchmarks.roofline import (
    TOP_KERNELS,
    Bandwidth,
    first_visits,
    kernel_table,
    ops_per_step,
    read_bandwidth,
    step_roofline,
)
from decoder.models import check_pair, load_model
from decoder.tiny import SHAPES, count_parameters, save_pair
from tests.conftest import tiny_lm

REPO = Path(__file__).resolve().parent.parent
TINYLLAMA_PARAMETERS = 1_100_048_384  # TinyLlama-1.1B's published count (untied embeddings and head)


# ---- specd tiny-pair --------------------------------------------------------------------------------------------


def test_the_1b_target_has_tinyllamas_shape_and_count():
    """Counted on the meta device: no weights are made. The exact count pins every dimension at once (a layer more
    or less, another MLP width or KV-head count would each move it)."""
    pair = SHAPES["1b"]
    t = pair.target
    assert (t.hidden, t.layers, t.heads, t.kv_heads, t.intermediate, pair.vocab) == (2048, 22, 32, 4, 5632, 32000)
    assert count_parameters(pair.target, pair.vocab) == TINYLLAMA_PARAMETERS
    assert pair.dtype == "bfloat16"


def test_the_1b_draft_is_about_40m():
    pair = SHAPES["1b"]
    assert 35e6 <= count_parameters(pair.draft, pair.vocab) <= 45e6


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=300)


def test_tiny_pair_writes_a_loadable_pair_by_default(tmp_path):
    done = specd("tiny-pair", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    target = load_model(tmp_path / "target", torch.device("cpu"), torch.float32)
    draft = load_model(tmp_path / "draft", torch.device("cpu"), torch.float32)
    check_pair(target, draft)
    assert target.model.config.hidden_size == SHAPES["tiny"].target.hidden
    assert target.dtype_name == "float32"


def test_the_1b_shape_comes_in_llama_only():
    done = specd("tiny-pair", "--shape", "1b", "--arch", "gpt2", "--out", "/nonexistent")
    assert done.returncode == 2
    assert "llama only" in done.stderr


@pytest.mark.skipif(os.environ.get("SPECD_TEST_BIG") != "1", reason="writes 2.2 GB; SPECD_TEST_BIG=1 runs it")
def test_the_1b_pair_is_written_in_bfloat16_and_loads(tmp_path):
    target_path, draft_path = save_pair(tmp_path, "1b")
    target = load_model(target_path, torch.device("cpu"), torch.bfloat16)
    draft = load_model(draft_path, torch.device("cpu"), torch.bfloat16)
    check_pair(target, draft)
    assert sum(p.numel() for p in target.model.parameters()) == TINYLLAMA_PARAMETERS
    assert target.dtype_name == "bfloat16"


# ---- the roofline helpers ---------------------------------------------------------------------------------------


def test_step_roofline_is_bytes_over_the_median_bandwidth():
    """2 GB at a median of 2,000 GB/s is a 1 ms floor; a 2 ms step achieves half the bandwidth."""
    bandwidth = Bandwidth([1000.0, 2000.0, 4000.0], 1 << 30)
    line = step_roofline(2_000_000_000, 0.002, bandwidth)
    assert line.roofline_step_ms == pytest.approx(1.0)
    assert line.achieved_share == pytest.approx(0.5)


def test_read_bandwidth_times_every_repeat():
    bandwidth = read_bandwidth(torch.device("cpu"), megabytes=8, repeats=3)
    assert len(bandwidth.samples_gbps) == 3 and min(bandwidth.samples_gbps) > 0


@pytest.fixture(scope="module")
def lean_target(tokenizer):
    return tiny_lm("llama", tokenizer, seed=0)


def test_ops_per_step_counts_a_lean_step_in_cpu_operators(lean_target):
    count = ops_per_step(lean_target, list(range(5, 25)), steps=2)
    assert count.unit == "cpu_ops"
    assert count.per_step >= 2 * lean_target.model.config.num_hidden_layers  # at least a product per layer
    assert count.detail["cpu_ops_top_level"] <= count.per_step


def test_kernel_table_groups_by_name_per_step_costliest_first():
    names = [("gemm", 10.0), ("norm", 1.0), ("gemm", 30.0), ("attn", 8.0), ("norm", 1.0)]
    table = kernel_table(names, steps=2)
    assert table == [
        {"name": "gemm", "per_step": 1.0, "us_per_step": 20.0},
        {"name": "attn", "per_step": 0.5, "us_per_step": 4.0},
        {"name": "norm", "per_step": 1.0, "us_per_step": 1.0},
    ]
    many = kernel_table([(f"k{i}", float(i)) for i in range(TOP_KERNELS + 5)], steps=1)
    assert len(many) == TOP_KERNELS and many[0]["name"] == f"k{TOP_KERNELS + 4}"


def test_first_visits_steps_past_the_context_then_repeats(lean_target):
    visits = first_visits(lean_target, list(range(5, 45)), new_lengths=4, repeats=2)
    assert visits.lengths == [37, 38, 39, 40]
    figures = visits.to_json()
    assert figures["first"] > 0 and figures["repeated"] > 0 and len(figures["repeated_ms"]) == 4


# ---- decode_loop's JSON ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_loop_json(tmp_path_factory) -> dict:
    """One short decode_loop run on the tiny pair, with the speedup curve, as the suite runs it (``-m``)."""
    root = tmp_path_factory.mktemp("decode")
    target, draft = save_pair(root / "pair")
    out = root / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.decode_loop", "--target", str(target), "--draft", str(draft),
            "--device", "cpu", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--k", "2",
            "--variants", "hf-plain,ours-none,ours-draft", "--engine-costs-prompts", "0", "--alphas", "0.7",
            "--ks", "1,2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_decode_loop_keeps_its_keys(decode_loop_json):
    doc = decode_loop_json
    assert {"variants", "costs", "bandwidth_gbps", "roofline", "forward_pass"} <= doc.keys()
    assert set(doc["variants"]) == {"hf-plain", "ours-none", "ours-draft"}
    assert len(doc["costs"]["forward_alone"]["v"]) == 3  # v(0..K), K = 2, as before
    assert doc["costs"]["target_step_ms"] is None  # --engine-costs-prompts 0: said, not invented


def test_decode_loop_writes_the_gpu_figures(decode_loop_json):
    doc = decode_loop_json
    assert doc["kernels_per_step"]["unit"] == "cpu_ops" and doc["kernels_per_step"]["target"] > 0
    assert doc["first_visit_ms"]["first"] > 0 and doc["first_visit_ms"]["repeated"] > 0
    roof = doc["step_roofline"]
    assert len(roof["read_gbps_samples"]) >= 3 and roof["read_gbps_median"] > 0
    assert roof["target"]["weight_bytes"] > roof["draft"]["weight_bytes"] > 0
    assert len(doc["v_by_k"]) == 9 and min(doc["v_by_k"]) > 0  # v(0..8), each timed on its own (v(0) ≈ 1, not 1)
    assert doc["device"]["type"] == "cpu"


def test_decode_loop_measures_the_curve_side_by_side(decode_loop_json):
    rows = decode_loop_json["speedup_curve"]
    assert [(r["alpha"], r["k"]) for r in rows] == [(0.7, 1), (0.7, 2)]
    for row in rows:
        assert row["speedup_range"][0] <= row["speedup"] <= row["speedup_range"][1]
        assert row["same_tokens"] == [1, 1]  # exact: the set proposals never change the output
        assert row["predicted"] > 0 and row["verified_positions"] > 0


def test_the_suite_reads_the_goals_from_decode_loops_json(decode_loop_json):
    figures = gpu_suite.decode_figures(decode_loop_json)
    assert figures["best_at_alpha_0.7"]["k"] in (1, 2)
    assert figures["ours_over_transformers"] > 0
    assert figures["v_max_k_le_8"] == max(decode_loop_json["v_by_k"][1:9])


# ---- the one prepared GPU command --------------------------------------------------------------------------------


def test_the_prepared_run_call_fits_the_device_tool():
    """The call written at the top of gpu_suite.py: one command of at most 2,000 characters, inside one call's
    600 s, running this script."""
    doc = gpu_suite.__doc__ or ""
    command = re.search(r'command="([^"]+)"', doc)
    assert command is not None and len(command.group(1)) <= 2000
    assert "benchmarks/gpu_suite.py" in command.group(1)
    assert "timeout_s=600" in doc and gpu_suite.GPU_BUDGET_S <= 560
    assert len(gpu_suite.BUNDLE) <= 8  # what comes back from $OUT


def test_the_gpu_plan_runs_what_the_issue_asks(tmp_path):
    steps = {s.name: s for s in gpu_suite.plan(False, tmp_path, "python3")}
    assert dict(steps["pytest"].env)["SPECD_TEST_DEVICE"] == "cuda"
    selected = steps["pytest"].argv[steps["pytest"].argv.index("-k") + 1]  # the Triton kernels' tests too
    assert all(word in selected.split(" or ") for word in ("invariant", "graph", "runners", "piece", "row_kernels"))
    assert "1b" in steps["pair"].argv
    names = ("decode_1b_auto", "decode_1b_capacity", "decode_1b_lean", "decode_ref_auto", "decode_ref_lean")
    for name in (*names, "worker_throughput", "worker_throughput_1b"):
        argv = " ".join(steps[name].argv)
        assert "--device cuda --dtype bfloat16" in argv, name
    before = dict(steps["decode_1b_capacity"].env)  # the step the Triton forms replace, on the same pair
    assert (before["SPECD_GRAPH_ATTENTION"], before["SPECD_GRAPH_ROWS"]) == ("capacity", "tiles")
    assert "--smoke" not in steps["attention"].argv and "--smoke" not in steps["linear"].argv
    assert "--alphas 0.5,0.7,0.9 --ks 1,2,4,8" in " ".join(steps["decode_1b_auto"].argv)
    assert "hf-plain" in " ".join(steps["decode_1b_auto"].argv)  # transformers' generate(), same GPU, same run
    assert "1,2,4,8,16,32,64" in steps["worker_throughput"].argv
    assert all(s.max_seconds <= gpu_suite.GPU_BUDGET_S for s in steps.values())


def test_a_step_that_overruns_is_cut_and_the_next_runs(tmp_path):
    slow = gpu_suite.Step("slow", (sys.executable, "-c", "import time; time.sleep(30)"), 30)
    outcome = gpu_suite.run_step(slow, 1.0, tmp_path / "slow.log", dict(os.environ))
    assert outcome.timed_out and outcome.seconds < 10
    fast = gpu_suite.Step("fast", (sys.executable, "-c", "print('ok')"), 30)
    assert gpu_suite.run_step(fast, 10.0, tmp_path / "fast.log", dict(os.environ)).rc == 0
    assert "ok" in (tmp_path / "fast.log").read_text()
