"""What one decode step costs against what the machine allows: bytes, bandwidth, kernels and first visits.

A decode step at batch 1 reads every weight once, so its floor is the weight bytes over the device's read bandwidth
(the roofline step time); the step measured against that floor is the share of the bandwidth the pass achieves. On
a GPU a small model's step is bound by launches, not bytes, until it is captured in a graph: ``ops_per_step``
counts the kernels one 1-token step launches (the CPU operators where there is no GPU). A pass that builds a plan
per shape pays for it at every new KV length: ``first_visits`` times a step at lengths never seen against the same
step repeated. Every timing here synchronizes the device around what it times (``synchronize``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from decoder.kv_cache import open_sequence
from decoder.models import LoadedModel


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose work is done when a call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Bandwidth:
    """A STREAM-like read (a sum over a large float32 buffer) timed several times."""

    samples_gbps: list[float]
    buffer_bytes: int

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.samples_gbps)

    @property
    def best_gbps(self) -> float:
        return max(self.samples_gbps)


def read_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 9, warmup: int = 1) -> Bandwidth:
    """Time ``repeats`` sums over a ``megabytes`` buffer (default 256 on a CPU; 2048 on a GPU, 40x its L2 cache, so
    a sum takes about a millisecond and the launch is noise), after ``warmup`` untimed ones."""
    if megabytes is None:
        megabytes = 2048 if device.type == "cuda" else 256
    data = torch.ones(megabytes * (1 << 20) // 4, device=device)  # [n] float32
    samples = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        if i >= warmup:
            samples.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    del data
    return Bandwidth(samples, megabytes * (1 << 20))


@dataclass(frozen=True)
class StepRoofline:
    """One model's 1-token step against its roofline."""

    weight_bytes: int  # read per step
    roofline_step_ms: float  # weight_bytes / the measured read bandwidth (median)
    measured_step_ms: float
    achieved_share: float  # roofline / measured: the share of the read bandwidth the step achieves


def step_roofline(weight_bytes: int, step_seconds: float, bandwidth: Bandwidth) -> StepRoofline:
    floor = weight_bytes / (bandwidth.median_gbps * 1e9)
    return StepRoofline(weight_bytes, floor * 1e3, step_seconds * 1e3, floor / step_seconds)


@dataclass(frozen=True)
class OpCount:
    """Operations one 1-token step runs, counted with torch.profiler over several steps."""

    unit: str  # "cuda_kernels" (kernels the GPU ran) or "cpu_ops" (aten operator calls, nested ones included)
    per_step: float
    detail: dict[str, float]  # every count the profiler gave, per step
    top: list[dict[str, Any]] = field(default_factory=list)  # the GPU's kernels by name, most time first


TOP_KERNELS = 30  # names in OpCount.top


def kernel_table(names_and_us: list[tuple[str, float]], steps: int) -> list[dict[str, Any]]:
    """Kernels grouped by name: per step, how many ran and their device time (µs), the ``TOP_KERNELS`` costliest."""
    table: dict[str, list[float]] = {}
    for name, us in names_and_us:
        row = table.setdefault(name[:120], [0.0, 0.0])
        row[0] += 1
        row[1] += us
    ranked = sorted(table.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return [{"name": name, "per_step": count / steps, "us_per_step": us / steps} for name, (count, us) in ranked]


def ops_per_step(lm: LoadedModel, context: list[int], steps: int = 8) -> OpCount:
    """Profile ``steps`` 1-token steps of ``lm`` on a cache holding ``context`` (each at the same length, after two
    unprofiled ones, so no first visit is counted). On a GPU: the device's kernels (memory copies and sets apart),
    and as a cross-check the kernels the CPU events launched and the runtime's launch calls; on a CPU: the
    operators."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    seq = open_sequence(lm)
    seq.forward(torch.tensor(context[:-1]))
    token = torch.tensor(context[-1:])
    for _ in range(2):
        seq.forward(token)
        seq.truncate(len(context) - 1)
    cuda = lm.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    synchronize(lm.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            seq.forward(token)
            seq.truncate(len(context) - 1)
        synchronize(lm.device)
    events = list(prof.events())
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not cuda:
        ops = [e for e in cpu if e.name.startswith("aten::")]
        top = [e for e in ops if e.cpu_parent is None]
        detail = {"cpu_ops": len(ops) / steps, "cpu_ops_top_level": len(top) / steps}
        return OpCount("cpu_ops", detail["cpu_ops"], detail)
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [e for e in device if e.name.startswith(("Memcpy", "Memset"))]
    launches = [e for e in cpu if "LaunchKernel" in e.name or "GraphLaunch" in e.name]
    detail = {
        "cuda_kernels": (len(device) - len(copies)) / steps,
        "cuda_memcpy_memset": len(copies) / steps,
        "kernels_attached_to_cpu_ops": sum(len(e.kernels) for e in cpu) / steps,
        "launch_calls": len(launches) / steps,
    }
    per_step = detail["cuda_kernels"] or detail["kernels_attached_to_cpu_ops"] or detail["launch_calls"]
    kernels = [(e.name, e.time_range.elapsed_us()) for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    detail["kernel_us"] = sum(us for _, us in kernels) / steps
    return OpCount("cuda_kernels", per_step, detail, kernel_table(kernels, steps))


@dataclass(frozen=True)
class FirstVisits:
    """1-token steps at KV lengths this process never ran, then the same steps repeated."""

    lengths: list[int]  # the KV length each step ends at
    first_ms: list[float]  # per length: its first visit
    repeated_ms: list[float]  # per length: the median of its repeats

    def to_json(self) -> dict[str, Any]:
        first, repeated = statistics.median(self.first_ms), statistics.median(self.repeated_ms)
        return {"first": first, "repeated": repeated, "ratio": first / repeated, **asdict(self)}


def first_visits(lm: LoadedModel, context: list[int], new_lengths: int = 8, repeats: int = 5) -> FirstVisits:
    """Prefill all of ``context`` but its last ``new_lengths + 1`` tokens, run one untimed step (what a new pool pays
    once, a graph's capture say, is not a length's), step through the last ``new_lengths`` one at a time (each a KV
    length never seen, if ``context`` is longer than anything run before), then roll back and step through them again
    ``repeats`` times."""
    seq = open_sequence(lm)
    base = len(context) - new_lengths
    seq.forward(torch.tensor(context[: base - 1]))
    seq.forward(torch.tensor(context[base - 1 : base]))  # the untimed step
    tokens = [torch.tensor(context[base + j : base + j + 1]) for j in range(new_lengths)]  # [1] each

    def walk() -> list[float]:
        seconds = []
        for token in tokens:
            synchronize(lm.device)
            start = time.perf_counter()
            seq.forward(token)
            synchronize(lm.device)
            seconds.append((time.perf_counter() - start) * 1e3)
        seq.truncate(base)
        return seconds

    first = walk()
    again = [walk() for _ in range(repeats)]
    repeated = [statistics.median(r[j] for r in again) for j in range(new_lengths)]
    return FirstVisits([base + j + 1 for j in range(new_lengths)], first, repeated)
