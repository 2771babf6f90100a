"""Decode-loop benchmark: our loop against transformers' generate(), interleaved in one run.

Variants, each on the same prompts with the same greedy settings:
  hf-plain        model.generate()                                  (target only)
  hf-assisted     model.generate(assistant_model=draft)              (constant K, no confidence cut-off)
  hf-lookup       model.generate(prompt_lookup_num_tokens=K)
  ours-none       our loop, drafter none                             (target only)
  ours-draft      our loop, draft model
  ours-lookup     our loop, prompt lookup
  ours-suffix     our loop, suffix decoding (the request's own text: the loop fills no cache)
  ours-self       our loop, the target as its own draft (α = 1)      (pure loop overhead)

It prints tokens/s and ratios, checks every variant's tokens against ours-none, and for our speculative
variants the overhead efficiency = measured decode speedup / speedup predicted from the measured
tokens per round, drafting cost c (as the loop measures it, the number workers report to the controller)
and verification cost v(K) (measured in isolation).

    python benchmarks/decode_loop.py                          # a synthetic pair built from configs
    python benchmarks/decode_loop.py --target T --draft D     # any local Hugging Face pair

Beside them, from the same run: kernels per 1-token target step (CUDA kernels, counted with torch.profiler; on a
CPU its aten operators, the unit named in the JSON), the first step at a never-seen KV length against the same step
repeated, v(K) for K up to 8, and each step against its roofline (weight bytes over the read bandwidth measured in
this run: benchmarks/roofline.py). With ``--alphas 0.5,0.7,0.9 --ks 1,2,4,8`` it also measures the speedup curve
over α and K with a drafter of set acceptance (benchmarks/speedup_curve.py) on real draft and target passes.

On a GPU (warm-up over every prompt first, so no first visit of a KV length is timed; fewer prompts and variants
keep it inside a few minutes; benchmarks/gpu_suite.py runs it so):

    python -m benchmarks.decode_loop --target T --draft D --device cuda --dtype bfloat16 --prompts 3 --repeats 2 \
        --variants hf-plain,ours-none,ours-draft --alphas 0.5,0.7,0.9 --ks 1,2,4,8 --json F
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kept_slots import KeptSlots, decode_with
from benchmarks.roofline import first_visits, ops_per_step, read_bandwidth, step_roofline, synchronize
from benchmarks.speedup_curve import curve_json, measure_curve, print_curve
from decoder.batch_engine import BatchEngine
from decoder.choices import RUNNER_NAMES
from decoder.engine import SpeculativeDecoder, make_drafter
from decoder.kv_cache import open_sequence
from decoder.models import LoadedModel, from_objects, load_model, parse_dtype, resolve_device
from decoder.runners import KVPool
from decoder.runners.native import NativePass
from decoder.sampling import SamplingParams
from decoder.telemetry import RequestStats
from specd.bench.isolated import engine_costs
from specd.bench.suffix_cost import describe, measure_suffix_cost
from specd_api.plan import requested
from specd_api.rounds import RoundRecord
from specd_api.speedup import runs_draft_model

PROMPTS = [
    "def parse_config(path):\n    with open(path) as f:\n        data = json.load(f)\n    return",
    "The with statement is used to wrap the execution of a block with methods defined by",
    '{"id": 17, "name": "alpha", "tags": ["x", "y"]},\n{"id": 18, "name": "beta", "tags": ["x",',
    "SELECT name, count(*) FROM orders WHERE status = 'open' GROUP BY name ORDER BY",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Exceptions can be handled with the try statement, which specifies exception handlers and",
]


@dataclass
class Tally:
    """Accumulated measurements of one variant."""

    seconds: float = 0.0
    tokens: int = 0
    decode_seconds: float = 0.0  # ours only: without prefill
    mismatches: int = 0
    stats: list[RequestStats] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else float("nan")


Run = Callable[[list[int]], tuple[list[int], RequestStats | None]]
VARIANTS = (
    *("hf-plain", "hf-assisted", "hf-lookup"),
    *("ours-none", "ours-draft", "ours-lookup", "ours-suffix", "ours-self"),
)
REQUIRED = ("hf-plain", "ours-none")  # the baselines every ratio is taken against
V_K_MAX = 8  # v(K) is measured up to K = 8 whatever --k is


def build_synthetic_pair(device: torch.device, dtype: torch.dtype, damping: float) -> tuple[LoadedModel, LoadedModel]:
    """A 6-layer Llama target and a 1-layer draft sharing its embeddings, first layer and head.

    Random weights agree with nobody. Here the target's upper layers are damped (their output projections
    scaled by ``damping``), so a draft cut from its first layer agrees with it often but not always,
    as a trained draft would, without any training. The target still pays for all six layers.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from decoder.tiny import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=2048)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # clear preferences instead of near-uniform logits
        for layer in target.model.layers[1:]:  # upper layers nudge the output instead of rewriting it
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    draft = AutoModelForCausalLM.from_config(draft_config)
    draft.load_state_dict(target.state_dict(), strict=False)  # embeddings, layer 0, final norm, head
    target, draft = (m.to(device=device, dtype=dtype).eval() for m in (target, draft))
    return from_objects(target, tokenizer, "synthetic-target"), from_objects(draft, tokenizer, "synthetic-draft")


def hf_runner(target: LoadedModel, max_new_tokens: int, device: torch.device, **kwargs: Any) -> Run:
    def run(prompt_ids: list[int]) -> tuple[list[int], RequestStats | None]:
        input_ids = torch.tensor([prompt_ids], device=device)
        out = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,  # like our runs: no stop at EOS, exactly max_new_tokens
            pad_token_id=0,
            **kwargs,
        )
        return out[0, len(prompt_ids) :].tolist(), None

    return run


def ours_runner(decoder: SpeculativeDecoder, drafter: str, k: int, max_new_tokens: int) -> Run:
    """``decoder.generate`` (no EOS, like eos_token_id=None for generate()) on KV slots kept from one request to
    the next, as a worker keeps them (benchmarks/kept_slots.py): the same loop and tokens, no per-request pool."""
    plan = requested(drafter, k)
    slots = KeptSlots(decoder.target, decoder.draft if runs_draft_model(drafter) else None)

    def run(prompt_ids: list[int]) -> tuple[list[int], RequestStats | None]:
        with slots.lend(runs_draft_model(drafter)) as (target_seq, draft_seq):
            made = make_drafter(plan, decoder.draft, decoder.prompt_lookup, SamplingParams(), None, draft_seq,
                                decoder.suffix_cache)  # fmt: skip
            result = decode_with(decoder.target, made, prompt_ids, plan.k, max_new_tokens, target_seq)
        return result.token_ids, result.stats

    return run


def time_forward(lm: LoadedModel, context: list[int], num_tokens: int, repeats: int) -> float:
    """Median seconds of one forward of ``num_tokens`` new tokens on a cache holding ``context``."""
    seq = open_sequence(lm)
    seq.forward(torch.tensor(context))
    new = torch.tensor(context[-num_tokens:])
    samples = []
    for _ in range(repeats):
        synchronize(lm.device)
        start = time.perf_counter()
        seq.forward(new)
        synchronize(lm.device)
        samples.append(time.perf_counter() - start)
        seq.truncate(len(context))
    return statistics.median(samples)


@dataclass(frozen=True)
class Costs:
    """Measured in isolation, relative to one target step: c per drafted token, v(j) to verify j drafts."""

    target_step_seconds: float
    c_draft: float
    v: list[float]  # v[j] = time of a (j + 1)-token target pass / time of a 1-token pass


def measure_costs(target: LoadedModel, draft: LoadedModel, context: list[int], k_max: int, repeats: int = 30) -> (
    Costs
):  # fmt: skip
    step = time_forward(target, context, 1, repeats)
    draft_step = time_forward(draft, context, 1, repeats)
    v = [time_forward(target, context, j + 1, repeats) / step for j in range(k_max + 1)]
    return Costs(step, draft_step / step, v)


def predicted_speedup(stats: list[RequestStats], c: float, v: list[float]) -> float:
    """τ / mean round cost, where a round with j drafts costs c·j + v(j) target steps."""
    rounds = [r for s in stats for r in s.rounds]
    tau = sum(r.num_accepted + 1 for r in rounds) / len(rounds)
    cost = sum(c * r.num_drafted + v[r.num_drafted] for r in rounds) / len(rounds)
    return tau / cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--damping", type=float, default=0.01, help="synthetic pair: upper-layer damping")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runner", choices=RUNNER_NAMES, default="auto", help="model forward for our loop")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help=f"which to run, of {','.join(VARIANTS)} ({' and '.join(REQUIRED)} always)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", choices=("auto", "first", "full"), default="auto",
        help="uncounted runs first: the first prompt per variant, or every prompt (every KV length and width the "
        "counted runs visit: on a GPU a first visit builds kernel plans); auto: full on a GPU, first on a CPU",
    )  # fmt: skip
    parser.add_argument(
        "--engine-costs-prompts", type=int, default=None, metavar="N",
        help="prompts for the engine-loop costs (none and draft at K = 1..8 each); default all, 0 skips them",
    )  # fmt: skip
    parser.add_argument("--alphas", default="", help="set acceptances for the speedup curve, e.g. 0.5,0.7,0.9")
    parser.add_argument("--ks", default="1,2,4,8", help="K values for the speedup curve")
    parser.add_argument("--seed", type=int, default=0, help="the set-acceptance drafter's corruption seed")
    args = parser.parse_args()
    variants = [name for name in VARIANTS if name in {*REQUIRED, *args.variants.split(",")}]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    alphas = [float(a) for a in args.alphas.split(",") if a]
    curve_ks = [int(k) for k in args.ks.split(",") if k]
    if any(not 0.0 <= a <= 1.0 for a in alphas) or any(k < 1 for k in curve_ks):
        parser.error("--alphas must be in [0, 1] and --ks at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if args.target and args.draft:
        target = load_model(args.target, device, dtype, args.runner)
        draft = load_model(args.draft, device, dtype, args.runner)
    else:
        target, draft = build_synthetic_pair(device, dtype, args.damping)
        target, draft = (dataclasses.replace(lm, runner=args.runner) for lm in (target, draft))
    k, n = args.k, args.max_new_tokens

    # transformers' assisted generation: exactly K drafts per round, as ours.
    draft.model.generation_config.num_assistant_tokens = k
    draft.model.generation_config.num_assistant_tokens_schedule = "constant"
    draft.model.generation_config.assistant_confidence_threshold = 0.0
    ours = SpeculativeDecoder(target, draft)
    ours_self = SpeculativeDecoder(target, target)
    makers: dict[str, Callable[[], Run]] = {  # only the chosen ones are made: ours hold KV slots
        "hf-plain": lambda: hf_runner(target, n, device),
        "hf-assisted": lambda: hf_runner(target, n, device, assistant_model=draft.model),
        "hf-lookup": lambda: hf_runner(target, n, device, prompt_lookup_num_tokens=k, max_matching_ngram_size=3),
        "ours-none": lambda: ours_runner(ours, "none", 0, n),
        "ours-draft": lambda: ours_runner(ours, "draft", k, n),
        "ours-lookup": lambda: ours_runner(ours, "prompt_lookup", k, n),
        "ours-suffix": lambda: ours_runner(ours, "suffix", k, n),
        "ours-self": lambda: ours_runner(ours_self, "draft", k, n),
    }
    runs = {name: makers[name]() for name in variants}
    prompts = [ours.encode(p) for p in PROMPTS[: args.prompts]]
    reference = {i: runs["ours-none"](p)[0] for i, p in enumerate(prompts)}
    full_warmup = args.warmup == "full" or (args.warmup == "auto" and device.type == "cuda")
    warmup_prompts = len(prompts) if full_warmup else 1
    for run in runs.values():  # warm-up, not counted
        for prompt in prompts[:warmup_prompts]:
            run(prompt)

    tallies = {name: Tally() for name in runs}
    names = list(runs)
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:  # rotate the order: no variant always goes first
                synchronize(device)
                start = time.perf_counter()
                tokens, stats = runs[name](prompt)
                synchronize(device)
                tally = tallies[name]
                tally.seconds += time.perf_counter() - start
                tally.tokens += len(tokens)
                tally.mismatches += tokens != reference[i]
                if stats is not None:
                    tally.decode_seconds += stats.decode_seconds
                    tally.stats.append(stats)

    mid_context = prompts[0] + reference[0][: n // 2]
    costs_to_8 = measure_costs(target, draft, mid_context, max(k, V_K_MAX, *curve_ks))
    costs = dataclasses.replace(costs_to_8, v=costs_to_8.v[: k + 1])  # the --k costs, as before
    forward = KVPool(target, 1).forward_pass
    forms = ", ".join(f"{key} {value}" for key, value in graph_forms(forward).items())
    print(f"runner {target.runner} (the {forward.name} pass, {forward.kernel} products{', ' * bool(forms)}{forms}), "
          f"device {device}, "
          f"dtype {dtype}, threads {torch.get_num_threads()}, K={k}, max_new_tokens={n}, "
          f"{len(prompts)} prompts x {args.repeats} repeats, interleaved")  # fmt: skip
    print(f"target {target.name} ({params_millions(target):.1f}M params), "
          f"draft {draft.name} ({params_millions(draft):.1f}M params)")  # fmt: skip
    print(f"costs, one forward alone: target step {costs.target_step_seconds * 1e3:.2f} ms, "
          f"c(draft) = {costs.c_draft:.3f}, v(K) = " + ", ".join(f"{x:.2f}" for x in costs.v))  # fmt: skip
    print("v(K) alone, K = 0.." + str(len(costs_to_8.v) - 1) + ": " + ", ".join(f"{x:.2f}" for x in costs_to_8.v))
    loop_prompts = prompts[: args.engine_costs_prompts] if args.engine_costs_prompts is not None else prompts
    loop = None
    if loop_prompts:  # as a worker reports them; its pools captured first, as a worker's are (no capture is timed)
        engine = BatchEngine(target, draft)
        engine.capture_graphs()
        loop = engine_costs(engine, loop_prompts, n)
    if loop is not None:
        print(f"costs, in the engine's loop (as a worker reports them): target step {loop.step_seconds * 1e3:.2f} "
              f"ms, c(draft) = {loop.c_draft:.3f}, v(n) = " + ", ".join(f"{x:.2f}" for x in loop.v))  # fmt: skip
    step_seconds = loop.step_seconds if loop is not None else costs.target_step_seconds
    suffix = measure_suffix_cost(target.vocab_size, step_seconds)  # the worker's cache, full
    print(f"costs, suffix decoding at the cache's full size: {describe(suffix)}")
    bandwidth = read_bandwidth_gbps(device)
    print(f"memory read bandwidth (a sum over 256 MB): {bandwidth:.1f} GB/s")
    report(tallies, costs, len(prompts) * args.repeats)
    step_figures = measure_step_figures(target, draft, prompts, reference, costs, max(k, V_K_MAX, *curve_ks))
    print_step_figures(step_figures)
    curve = None
    if alphas:
        points = measure_curve(target, draft, prompts, [reference[i] for i in range(len(prompts))], alphas, curve_ks,
                               args.repeats, warmup_prompts, args.seed)  # fmt: skip
        curve = curve_json(points, costs.c_draft, costs_to_8.v)
        print_curve(curve)
    lines = roofline(tallies, target, draft)
    print(
        f"\nroofline: weight bytes read per emitted token, and the rate that makes, against {bandwidth:.1f} GB/s read"
    )
    for name, row in lines.items():
        print(f"  {name:<12} {row['weight_bytes_per_token'] / 1e6:7.1f} MB/token  {row['achieved_gbps']:6.1f} GB/s  "
              f"({row['achieved_gbps'] / bandwidth:.0%} of the read bandwidth)")  # fmt: skip
    if args.json:
        runs = len(prompts) * args.repeats
        document = {
            "variants": {
                name: {"tokens_per_second": t.tokens_per_second, "same_tokens": [runs - t.mismatches, runs]}
                for name, t in tallies.items()
            },
            "costs": {
                "target_step_ms": loop.step_seconds * 1e3 if loop else None,  # None: --engine-costs-prompts 0
                "c_draft": loop.c_draft if loop else None,
                "v": loop.v if loop else None,
                "forward_alone": {"target_step_ms": costs.target_step_seconds * 1e3, "c_draft": costs.c_draft,
                                  "v": costs.v},
                "c_suffix": suffix.c_suffix,  # one proposal at the cache's full size / a target step
                "suffix": dataclasses.asdict(suffix),
            },
            "bandwidth_gbps": bandwidth,
            "roofline": lines,
            "forward_pass": {"runner": forward.name, "dtype": forward.dtype_name, "kernel": forward.kernel,
                             "cpu": cpu_model(), **graph_forms(forward)},
            "device": device_json(device),
            "settings": {"k": k, "max_new_tokens": n, "prompts": len(prompts), "repeats": args.repeats,
                         "variants": variants, "warmup_prompts": warmup_prompts},
            "v_by_k": costs_to_8.v,  # v(K) alone for K = 0..8 (at least), in target steps
            **step_figures,
            "speedup_curve": curve,
        }  # fmt: skip
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")


def cpu_model() -> str:
    """lscpu's model line (docs/BENCHMARKS.md names the CPU of every figure), or the platform's processor."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def read_bandwidth_gbps(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """A STREAM-like read: the best of ``repeats`` sums over a ``megabytes`` float32 tensor, in GB/s (the figure
    the CPU tables have always printed; the roofline line takes a median, ``step_figures``)."""
    return read_bandwidth(device, megabytes, repeats, warmup=0).best_gbps


def graph_forms(forward: Any) -> dict[str, Any]:
    """The graphs pass's forms of attention and of the row-wise steps, and why ``auto`` fell back from a Triton one
    (decoder/runners/graphed.py); nothing for another pass."""
    if not hasattr(forward, "fallbacks"):
        return {}
    return {"attention": forward.attention, "rows": forward.rows, "fallbacks": dict(forward.fallbacks)}


def device_json(device: torch.device) -> dict[str, Any]:
    """The device the figures were taken on, and the software that drove it."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"type": device.type, "name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "threads": torch.get_num_threads()}  # fmt: skip


def measure_step_figures(
    target: LoadedModel, draft: LoadedModel, prompts: list[list[int]], reference: dict[int, list[int]], costs: Costs,
    visited: int,
) -> dict[str, Any]:  # fmt: skip
    """The JSON's per-step figures: ``kernels_per_step`` (target and draft), ``first_visit_ms`` (the target, at KV
    lengths past every run's: ``visited`` tokens past the longest prompt and output) and ``step_roofline`` (each
    model's step, measured alone, against its weight bytes over the read bandwidth measured now)."""
    context = prompts[0] + reference[0]
    kernels = {"target": ops_per_step(target, context), "draft": ops_per_step(draft, context)}
    longest = max(len(p) + len(reference[i]) for i, p in enumerate(prompts))
    limit = target.max_context or longest + 64
    base_length = min(longest + visited + 16, limit - 9)
    fresh = (context * (base_length // len(context) + 2))[: base_length + 8]  # prompts repeated: a new length
    visits = first_visits(target, fresh) if base_length > longest + visited else None
    bandwidth = read_bandwidth(target.device)
    target_bytes = streamed_bytes(target, ours=True)
    draft_step = costs.c_draft * costs.target_step_seconds
    return {
        "kernels_per_step": {
            "unit": kernels["target"].unit,
            "target": kernels["target"].per_step,
            "draft": kernels["draft"].per_step,
            "detail": {"target": kernels["target"].detail, "draft": kernels["draft"].detail},
            "top": {"target": kernels["target"].top, "draft": kernels["draft"].top},
        },
        "first_visit_ms": visits.to_json() if visits is not None else None,  # None: no room left in the context
        "step_roofline": {
            "read_gbps_median": bandwidth.median_gbps,
            "read_gbps_samples": bandwidth.samples_gbps,
            "read_buffer_bytes": bandwidth.buffer_bytes,
            "target": dataclasses.asdict(step_roofline(target_bytes, costs.target_step_seconds, bandwidth)),
            "draft": dataclasses.asdict(step_roofline(streamed_bytes(draft, ours=True), draft_step, bandwidth)),
        },
    }


def print_step_figures(figures: dict[str, Any]) -> None:
    kernels, visits, roof = figures["kernels_per_step"], figures["first_visit_ms"], figures["step_roofline"]
    print(f"\nper 1-token step: target {kernels['target']:.0f} {kernels['unit']}, draft {kernels['draft']:.0f}")
    for row in kernels["top"]["target"][:12]:  # a GPU's kernels by name (empty on a CPU)
        print(f"  {row['us_per_step']:8.1f} µs  {row['per_step']:5.1f}x  {row['name'][:90]}")
    if visits is not None:
        print(f"first step at a never-seen KV length {visits['first']:.2f} ms, the same step repeated "
              f"{visits['repeated']:.2f} ms ({visits['ratio']:.2f}x; lengths {visits['lengths'][0]}.."
              f"{visits['lengths'][-1]})")  # fmt: skip
    samples, megabytes = len(roof["read_gbps_samples"]), roof["read_buffer_bytes"] / 1e6
    print(f"step roofline, read bandwidth {roof['read_gbps_median']:.1f} GB/s (median of {samples} sums over "
          f"{megabytes:.0f} MB, this run):")  # fmt: skip
    for role in ("target", "draft"):
        r = roof[role]
        print(
            f"  {role:<6} {r['weight_bytes'] / 1e6:8.1f} MB/step  roofline {r['roofline_step_ms']:.3f} ms  "
            f"measured {r['measured_step_ms']:.3f} ms  ({r['achieved_share']:.0%} of the read bandwidth)"
        )


def streamed_bytes(lm: LoadedModel, ours: bool) -> int:
    """Weight bytes one forward pass reads: the native pass's packed matrices where ours runs it, else every
    parameter but an untied input embedding (a pass reads only its rows)."""
    step = KVPool(lm, 1).forward_pass if ours else None
    if isinstance(step, NativePass):
        return step.native.weight_bytes
    embedding = lm.model.get_input_embeddings().weight
    tied = embedding is lm.model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in lm.model.parameters() if tied or p is not embedding)


def roofline(tallies: dict[str, Tally], target: LoadedModel, draft: LoadedModel) -> dict[str, dict[str, float]]:
    """Per variant whose passes we count: weight bytes read per emitted token, and the GB/s that makes."""
    rows = {}
    for name, t in tallies.items():
        ours = name.startswith("ours-")
        per_token: float
        if name == "hf-plain":
            per_token = streamed_bytes(target, ours=False)  # one target pass per token
        elif ours:
            rounds = rounds_of(t)
            drafter = target if name == "ours-self" else draft
            draft_passes = sum(r.num_drafted for r in rounds) if name in ("ours-draft", "ours-self") else 0
            read = len(rounds) * streamed_bytes(target, ours=True) + draft_passes * streamed_bytes(drafter, ours=True)
            per_token = read / max(1, sum(r.num_accepted + 1 for r in rounds))
        else:
            continue  # transformers' assisted and lookup rounds are not visible from outside
        rows[name] = {"weight_bytes_per_token": per_token, "achieved_gbps": per_token * t.tokens_per_second / 1e9}
    return rows


def params_millions(lm: LoadedModel) -> float:
    return sum(p.numel() for p in lm.model.parameters()) / 1e6


def rounds_of(tally: Tally) -> list[RoundRecord]:
    return [r for s in tally.stats for r in s.rounds]


def report(tallies: dict[str, Tally], costs: Costs, runs_total: int) -> None:
    base_hf, base_ours = tallies["hf-plain"], tallies["ours-none"]
    print(f"\n{'variant':<12} {'tok/s':>8} {'vs hf-plain':>11} {'vs ours-none':>12} {'alpha':>6} {'tau':>5} "
          f"{'same tokens':>11}")  # fmt: skip
    for name, t in tallies.items():
        rounds = rounds_of(t)
        proposed = sum(r.num_drafted for r in rounds)
        alpha = f"{sum(r.num_accepted for r in rounds) / proposed:.2f}" if proposed else "-"
        tau = f"{sum(r.num_accepted + 1 for r in rounds) / len(rounds):.2f}" if proposed else "-"
        tps = t.tokens_per_second
        print(f"{name:<12} {tps:>8.1f} {tps / base_hf.tokens_per_second:>10.2f}x "
              f"{tps / base_ours.tokens_per_second:>11.2f}x {alpha:>6} {tau:>5} "
              f"{runs_total - t.mismatches:>5}/{runs_total}")  # fmt: skip

    print("\nours vs transformers on the same pair, prompts and outputs:")
    for ours_name, hf_name in (
        ("ours-none", "hf-plain"),
        ("ours-draft", "hf-assisted"),
        ("ours-lookup", "hf-lookup"),
    ):
        if ours_name not in tallies or hf_name not in tallies:
            continue
        ratio = tallies[ours_name].tokens_per_second / tallies[hf_name].tokens_per_second
        print(f"  {ours_name} / {hf_name}: {ratio:.2f}x")

    print("\noverhead efficiency = measured decode speedup / predicted from measured tau, c and v(K)")
    print("  (c as the loop measures it, i.e. as workers report it to the controller; v(K) measured in isolation)")
    for name in ("ours-draft", "ours-lookup", "ours-suffix", "ours-self"):
        if name not in tallies:
            continue
        t = tallies[name]
        rounds = rounds_of(t)
        c = (
            sum(r.draft_seconds for r in rounds) / max(1, sum(r.num_drafted for r in rounds))
        ) / costs.target_step_seconds
        isolated = {"ours-draft": f"{costs.c_draft:.3f}", "ours-self": "1.000"}.get(name, "-")
        measured = t.decode_tokens_per_second / base_ours.decode_tokens_per_second
        predicted = predicted_speedup(t.stats, c, costs.v)
        print(
            f"  {name:<12} measured {measured:.2f}x  predicted {predicted:.2f}x  (c = {c:.3f}; in isolation "
            f"{isolated})  efficiency {measured / predicted:.2f}"
        )


if __name__ == "__main__":
    main()
