"""`specd demo`: the pure aggregation (α, tokens/s, speedup, the latest decision), the planning, the rendering,
and real runs as a subprocess (a short one to the end, one interrupted with Ctrl-C, one whose controller
cannot start), each checked for leftover child processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from specd.demo import driver as drv
from specd.demo.report import DemoReport, Learned, read_traces
from specd.demo.view import progress_line, progress_table, render_summary
from workloads import Prompt

ROOT = Path(__file__).resolve().parents[1]
SEGMENTS = ("code", "prose", "structured", "extractive", "adversarial", "toolcall")


def prompt(segment: str, n: int = 0, max_new_tokens: int = 96) -> Prompt:
    return Prompt(f"{segment}-{n:03d}", segment, f"{segment} prompt {n}", max_new_tokens, 0.0)


def result(arm: str, segment: str = "code", n: int = 0, tokens: int = 48, seconds: float = 0.4, **kw) -> drv.Result:
    kw.setdefault("ok", True)
    kw.setdefault("decision_source", "controller")
    return drv.Result(f"{segment}-{n:03d}", segment, arm, completion_tokens=tokens, decode_seconds=seconds, **kw)


def adaptive(n: int = 0, **kw) -> drv.Result:
    return result(drv.ADAPTIVE, n=n, **kw)


def baseline(n: int = 0, **kw) -> drv.Result:
    return result(drv.BASELINE, n=n, **kw)


# -- aggregation --------------------------------------------------------------------------------------------

ALPHA_CASES = [
    # (why, results, expected α)
    ("accepted over proposed", [adaptive(proposed=40, accepted=30)], 0.75),
    ("summed over requests, not averaged: (10 + 0) / (10 + 30)",
     [adaptive(0, proposed=10, accepted=10), adaptive(1, proposed=30, accepted=0)], 0.25),
    ("the baseline never speculates; its counts (if any) do not enter",
     [adaptive(proposed=10, accepted=5), baseline(proposed=10, accepted=10)], 0.5),
    ("failed requests do not enter", [adaptive(0, proposed=10, accepted=5), adaptive(1, ok=False, proposed=90)], 0.5),
    ("nothing proposed: no α (not 0)", [adaptive(drafter="none")], None),
]  # fmt: skip


@pytest.mark.parametrize(("why", "results", "expected"), ALPHA_CASES, ids=[c[0] for c in ALPHA_CASES])
def test_alpha(why, results, expected):
    alpha = drv.summarize_segment("code", 10, results).alpha
    if expected is None:
        assert alpha is None
    else:
        assert alpha == pytest.approx(expected)


SPEEDUP_CASES = [
    # (why, results, tokens/s adaptive, tokens/s baseline, speedup)
    ("same tokens in half the time: 2x", [adaptive(seconds=0.2), baseline(seconds=0.4)], 240, 120, 2.0),
    ("a rate is all tokens over all time: (48 + 48) / (0.2 + 0.6) = 120, not the mean of 240 and 80",
     [adaptive(0, seconds=0.2), adaptive(1, seconds=0.6), baseline(0, seconds=0.4), baseline(1, seconds=0.4)],
     120, 120, 1.0),
    ("only prompts both workers answered: prompt 1 has no baseline answer yet",
     [adaptive(0, seconds=0.4), baseline(0, seconds=0.8), adaptive(1, seconds=0.01)], 120, 60, 2.0),
    ("a failed answer unpairs its prompt", [adaptive(seconds=0.2), baseline(ok=False)], None, None, None),
    ("slower with speculation: below 1", [adaptive(seconds=0.5), baseline(seconds=0.4)], 96, 120, 0.8),
]  # fmt: skip


@pytest.mark.parametrize(("why", "results", "rate_a", "rate_b", "speedup"), SPEEDUP_CASES,
                         ids=[c[0] for c in SPEEDUP_CASES])  # fmt: skip
def test_tokens_per_second_and_speedup(why, results, rate_a, rate_b, speedup):
    row = drv.summarize_segment("code", 10, results)
    got = (row.tokens_per_second_adaptive, row.tokens_per_second_baseline, row.speedup)
    assert got == pytest.approx((rate_a, rate_b, speedup)) if speedup is not None else got == (None, None, None)


def test_median_speedup_resists_one_hiccup():
    # Prompt 2's adaptive answer was descheduled for 5 s: the pooled rate drops, the median per prompt does not.
    results = [adaptive(0, seconds=0.2), baseline(0), adaptive(1, seconds=0.2), baseline(1), adaptive(2, seconds=5.0),
               baseline(2)]  # fmt: skip
    row = drv.summarize_segment("code", 6, results)
    assert row.speedup is not None and row.speedup < 0.3
    assert row.median_pair_speedup == pytest.approx(2.0)


def test_latest_decision_skips_probes_and_prefers_the_controllers_answers():
    results = [
        adaptive(0, drafter="draft", k=4),
        adaptive(1, drafter="prompt_lookup", k=8),
        adaptive(2, drafter="none", decision_source="last_decision", fallback="timeout"),  # the worker's fallback
        adaptive(3, drafter="draft", k=2, exploration=True),  # a probe
    ]
    row = drv.summarize_segment("code", 8, results)
    assert (row.drafter, row.k, row.decision_source) == ("prompt_lookup", 8, "controller")
    assert (row.explored, row.decided) == (1, 4)
    assert drv.fallback_counts(results) == {"timeout": 1}
    only_fallbacks = drv.summarize_segment("code", 2, [results[2]])
    assert (only_fallbacks.drafter, only_fallbacks.decision_source) == ("none", "last_decision")
    tabled = [*results, adaptive(4, drafter="draft", k=6, decision_source="table")]  # the controller's table
    assert (drv.summarize_segment("code", 10, tabled).k, drv.summarize_segment("code", 10, tabled).decision_source) == (
        6, "table"
    )  # fmt: skip


def test_the_table_marks_fallbacks_and_requests_that_fixed_their_plan_apart():
    """A decision from the controller's tables is its answer, unmarked; a seeded request's own plan is not the
    worker's fallback, and the caption says which is which."""
    rows = [
        drv.summarize_segment("code", 2, [adaptive(0, drafter="draft", k=4, decision_source="table")]),
        drv.summarize_segment("adversarial", 2, [adaptive(0, drafter="none", decision_source="request")]),
    ]
    _, overall = drv.summarize({"code": 2, "adversarial": 2}, [])
    text = rendered(progress_table(rows, overall))
    assert "draft K≤4 " in text and "off†" in text and "off*" not in text
    assert "the request's own plan" in text and "did not answer in time" not in text
    rows.append(drv.summarize_segment("prose", 2, [adaptive(0, drafter="none", decision_source="last_decision")]))
    text = rendered(progress_table(rows, overall))
    assert "off*" in text and "did not answer in time" in text


def test_summarize_counts_done_and_failures_per_segment_and_overall():
    results = [adaptive(0), baseline(0), result(drv.ADAPTIVE, "prose", ok=False, error="HTTP 503")]
    rows, overall = drv.summarize({"code": 4, "prose": 4, "structured": 4}, results)
    assert [(r.segment, r.done, r.total, r.failures) for r in rows] == [
        ("code", 2, 4, 0), ("prose", 1, 4, 1), ("structured", 0, 4, 0)
    ]  # fmt: skip
    assert (overall.segment, overall.done, overall.total, overall.failures, overall.pairs) == ("all", 3, 12, 1, 1)


def test_plan_interleaves_segments_alternates_the_first_worker_and_caps_tokens():
    workloads = {s: [prompt(s, n) for n in range(3)] for s in ("adversarial", "code", "prose")}
    requests = drv.plan(workloads, per_segment=4, max_tokens=48, seed=1)
    # Round-robin in the README's order (code, prose, ..., adversarial), whatever the dict's order.
    assert [r.prompt.segment for r in requests[:6]] == ["code", "prose", "adversarial"] * 2
    assert all(r.max_tokens == 48 for r in requests)
    for segment in workloads:
        mine = [r for r in requests if r.prompt.segment == segment]
        # Each segment's prompts rotate which arm goes first, so all see the same noise; every AA_EVERY-th prompt
        # also goes to the A/A arm (the adaptive worker, speculation off).
        assert len({r.order[0] for r in mine}) >= 2
        assert all(set(r.order) == ({*drv.ARMS, drv.AA} if i % drv.AA_EVERY == 0 else set(drv.ARMS))
                   for i, r in enumerate(mine))  # fmt: skip
        assert all(len(set(r.order)) == len(r.order) for r in mine)
        # 4 prompts from a segment of 3: all 3, then repeats.
        assert {r.prompt.id for r in mine[:3]} == {p.id for p in workloads[segment]}
    assert drv.plan(workloads, 4, 48, seed=1) == requests
    assert drv.totals_of(requests) == {"code": 10, "prose": 10, "adversarial": 10}  # 4 x 2 arms + 2 A/A
    assert drv.plan({"code": [prompt("code", max_new_tokens=16)]}, 1, 48, 0)[0].max_tokens == 16


def test_parse_response():
    request = drv.plan({"code": [prompt("code")]}, 1, 48, 0)[0]
    body = {
        "usage": {"completion_tokens": 48},
        "specd": {"segment": "code", "drafter": "draft", "k": 4, "decision_reason": "best",
                  "decision_source": "controller", "fallback": None, "exploration": False,
                  "num_drafted": 40, "num_accepted": 22, "decode_seconds": 0.3, "prefill_seconds": 0.02},
    }  # fmt: skip
    ok = drv.parse_response(200, body, request, drv.ADAPTIVE, 0.35)
    assert (ok.ok, ok.completion_tokens, ok.drafter, ok.k, ok.proposed, ok.accepted) == (
        True, 48, "draft", 4, 40, 22)  # fmt: skip
    busy = drv.parse_response(429, {"error": {"message": "at capacity"}}, request, drv.BASELINE, 0.01)
    assert not busy.ok and busy.error == "HTTP 429: at capacity"


# -- rendering ----------------------------------------------------------------------------------------------


def rendered(renderable, width: int = 120) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def sample_rows() -> tuple[list[drv.SegmentRow], drv.SegmentRow]:
    results = [
        adaptive(0, drafter="draft", k=4, proposed=40, accepted=22, seconds=0.3),
        baseline(0, seconds=0.4),
        result(drv.ADAPTIVE, "adversarial", drafter="none", seconds=0.4),
        result(drv.BASELINE, "adversarial", seconds=0.4),
    ]
    return drv.summarize({"code": 48, "adversarial": 48, "prose": 48}, results)


def test_progress_table_shows_each_segment_and_the_overall_row():
    rows, overall = sample_rows()
    text = rendered(progress_table(rows, overall))
    lines = {line.split()[0]: line.replace("━", "").replace("╸", "") for line in text.splitlines() if line.strip()}
    assert lines["code"].split()[1:] == ["2/48", "0.55", "draft", "K≤4", "0/1", "160", "120", "1.33x"]
    assert lines["adversarial"].split()[1:] == ["2/48", "-", "off", "0/1", "120", "120", "1.00x"]
    assert lines["prose"].split()[1:] == ["0/48", "-", "-", "-", "-", "-", "-"]
    # Overall: 96 tokens in 0.3 + 0.4 s = 137/s against 96 in 0.8 s = 120/s.
    assert lines["all"].split()[1:] == ["4/144", "0.55", "0/2", "137", "120", "1.14x"]
    assert "requests" in text  # the progress bars' column
    assert "requests" not in rendered(progress_table(rows, overall, width=80), width=80)  # narrow: no bars


def test_progress_line_for_logs():
    rows, overall = sample_rows()
    line = progress_line(rows, overall, 12.0)
    assert line.startswith("[   12s] 4/144 requests | code α 0.55 1.33x | adversarial α - 1.00x")
    assert line.endswith("overall 1.14x")


def test_summary_names_the_controllers_learning_the_traces_and_the_files(tmp_path):
    spans = [
        {"service_name": "specd-worker-adaptive", "trace_id": "a1", "name": "specd.worker.request"},
        {"service_name": "specd-worker-adaptive", "trace_id": "a2", "name": "specd.worker.request"},
    ]
    (tmp_path / "traces-worker-adaptive.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    controller = {"service_name": "specd-controller", "trace_id": "a1", "name": "Decide"}
    (tmp_path / "traces-controller.jsonl").write_text(json.dumps(controller) + "\n" + '{"torn')  # a torn last line
    traces = read_traces([tmp_path / "traces-worker-adaptive.jsonl", tmp_path / "traces-controller.jsonl"])
    assert (traces.spans, len(traces.trace_ids), traces.shared_trace_ids()) == (3, 2, {"a1"})
    rows, overall = sample_rows()
    report = DemoReport(
        rows=rows, overall=overall, requests_planned=144, seconds=61.0, interrupted=False, settings="2 prompts",
        fallbacks={"timeout": 3},
        learned=[Learned("code", 120.0, {"draft": 0.61, "prompt_lookup": 0.3}, "draft K=4 (best, x1.2)", False)],
        learned_error=None, traces=traces, plot=tmp_path / "demo.png", logs=[tmp_path / "controller.log"],
    )  # fmt: skip
    text = rendered(render_summary(report), width=160)
    assert "specd demo: finished in 61 s" in text
    # the headline is the paired median per prompt (code 1.33x, adversarial 1.00x), the totals ratio beside it
    assert "overall speedup: 1.17x" in text and "1.14x" in text
    assert "failures: 0 of 4 requests" in text and "3 timeout" in text
    assert "draft K=4 (best, x1.2)" in text and "0.61" in text
    assert "traces: 3 spans in 2 files, 2 distinct trace ids (1 shared by a worker and the controller)" in text
    assert str(tmp_path / "traces-controller.jsonl") in text and str(tmp_path / "demo.png") in text


def test_plot_writes_a_png(tmp_path):
    from specd.demo.plot import plot

    rows, _ = sample_rows()
    path = plot(rows, tmp_path / "demo.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- real runs ----------------------------------------------------------------------------------------------


def demo_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "specd", "demo", "--out", str(out), *args]


def leftovers(run: Path) -> list[str]:
    """Processes whose command line names the run folder: the services and the controller's embedded Redis."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if str(run) in line and " Z" not in line and "ps -eo" not in line]


def spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_runs_to_the_end(tmp_path):
    run = tmp_path / "run"  # given relative to the working folder, as `make demo` does (.specd/demo)
    done = subprocess.run(demo_command(Path("run"), "--prompts-per-segment", "2", "--max-tokens", "16"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for segment in SEGMENTS:
        assert f" {segment} " in out
    aa = len(SEGMENTS)  # the first of each segment's 2 prompts also goes to the A/A arm
    assert "overall speedup:" in out and f"failures: 0 of {2 * 2 * len(SEGMENTS) + aa} requests" in out
    assert "what the controller learned" in out and "decision now" in out and "A/A: " in out
    assert not leftovers(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failures"] == 0 and summary["overall"]["pairs"] == 2 * len(SEGMENTS)
    assert summary["overall"]["paired_median"] > 0 and len(summary["overall"]["interval"]) == 2
    assert summary["overall"]["totals_ratio"] > 0 and set(summary["segments"]) == set(SEGMENTS)
    assert summary["aa"]["pairs"] == aa and summary["aa"]["ratio"] > 0

    worker = spans(run / "traces-worker-adaptive.jsonl")
    baseline_spans = spans(run / "traces-worker-baseline.jsonl")
    controller = spans(run / "traces-controller.jsonl")
    requests = [s for s in worker if s["name"] == "specd.worker.request"]
    per_worker = 2 * len(SEGMENTS)
    assert len(requests) == per_worker + aa
    assert len([s for s in baseline_spans if s["name"] == "specd.worker.request"]) == per_worker
    assert {s["service_name"] for s in controller} == {"specd-controller"}
    # The baseline has no controller: it never speculates, and its requests continue in no controller trace.
    baseline_requests = [s for s in baseline_spans if s["name"] == "specd.worker.request"]
    assert {s["attributes"]["specd.drafter"] for s in baseline_requests} == {"none"}
    assert not {s["trace_id"] for s in baseline_spans} & {s["trace_id"] for s in controller}
    # The A/A's requests, on the adaptive worker, were told none; the learned table leaves them out.
    aa_requests = [s for s in requests if s["attributes"]["specd.segment"].startswith("aa/")]
    assert len(aa_requests) == aa and {s["attributes"]["specd.drafter"] for s in aa_requests} == {"none"}
    assert "aa/" not in out.split("what the controller learned", 1)[1]
    # A request's trace continues in the controller (its Decide call): the files share trace ids.
    shared = {s["trace_id"] for s in requests} & {s["trace_id"] for s in controller}
    assert shared, "no trace spans both the adaptive worker and the controller"
    assert f"{len(worker)} spans" in out and "run/traces-controller.jsonl" in out
    assert (run / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "logs" / "controller.log").exists()


def test_ctrl_c_shuts_down_in_order_and_prints_the_partial_summary(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(demo_command(run, "--prompts-per-segment", "40", "--max-tokens", "16"), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    sending = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("sending "):
                sending.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert sending.wait(90), "".join(lines)
        time.sleep(2.0)  # mid-traffic
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(5)
    out = "".join(lines)
    assert "specd demo: interrupted after" in out and "400/400" not in out
    assert "overall speedup" in out and "what the controller learned" in out
    assert not leftovers(run)


def test_a_service_that_cannot_start_ends_the_demo_with_one_line_and_no_orphans(tmp_path):
    bad = tmp_path / "policy.yaml"
    bad.write_text("defaults:\n  max_batch_size: -3\n")
    run = tmp_path / "run"
    done = subprocess.run(demo_command(run, "--policy", str(bad)), cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"specd demo: error: the controller did not start (exited with status 2): {bad}:2: defaults.max_batch_size: "
        f"Input should be greater than or equal to 0; see {run / 'logs' / 'controller.log'}"
    ]
    assert not leftovers(run)


def test_the_run_folder_is_wiped_only_when_it_is_the_demos(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    done = subprocess.run(demo_command(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "refusing to wipe" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_demo_policy_puts_the_aa_rule_first(tmp_path):
    from controller.decision.policy import load_policy
    from specd.demo.configs import demo_policy, write_config

    path = write_config(tmp_path / "policy.yaml", demo_policy(Path("policies/default.yaml")), "test")
    policy = load_policy(path)
    assert policy.for_segment("aa/adversarial").force == "none"  # ahead of the adversarial* rule
    assert policy.for_segment("aa/extractive#sampled").force == "none"  # a learning segment follows its segment's
    assert policy.for_segment("code").force is None


def test_the_aa_figure_pairs_the_aa_arm_with_the_baseline():
    results = [result(drv.AA, n=i, seconds=0.4 * f) for i, f in enumerate((1.0, 1.02, 0.98, 1.0))] + [
        baseline(i) for i in range(4)
    ]
    figure = drv.aa_figure(results)
    assert figure.pairs == 4 and figure.median == pytest.approx(1.0)
    assert figure.interval is not None and figure.interval[0] <= 1.0 <= figure.interval[1]
    _, overall = drv.summarize({"code": 8}, results)
    assert overall.pairs == 0, "A/A answers are not the adaptive arm's"
