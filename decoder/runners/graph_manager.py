"""One CUDA graph per bucket over a step that reads and writes only static buffers; or the same step run eagerly.

``BucketGraphs`` holds, for one store, a step function per bucket (decoder/runners/buckets.py) that reads its inputs
from the store's static buffers and writes its logits to a static buffer: every address it touches is fixed once the
store exists. On CUDA (``capture=True``) it captures each bucket's step in a ``torch.cuda.CUDAGraph`` the first time
the bucket runs (or all at start-up, ``GraphPass.capture_all``), as PyTorch's documentation says: a few eager runs on
a side stream first (allocator and library warm-up), then the capture; every later step of the bucket is a replay.
All graphs share one memory pool: their outputs go to the static buffer, so nothing a graph allocated outlives its
replay, and graphs may replay in any order. Elsewhere (a CPU, or capture switched off) it runs the very same step
eagerly: the eager stand-in, which is what the CPU tests check (tests/decoder/test_graph_capture.py also runs this
module's capture code on a CPU, against a recorder that replays what it captured as a CUDA graph would).

How a capture is made, and why:

- under ``torch.inference_mode``: the model's weights require grad, so a capture made with autograd on (start-up
  calls this outside any forward) would record a backward graph whose saved activations, chained through the
  in-place writes to the static buffers, stay alive in the graph pool for as long as the store does;
- the warm-up runs and the capture on one side stream, kept for the store's life and made on the store's device:
  cuBLAS keeps a workspace per (handle, stream), so a warm-up on one stream and a capture on ``torch.cuda.graph``'s
  own stream would first meet the capture stream inside the capture (ROCm's hipBLASLt fails there; sglang and vLLM
  warm up and capture on one stream), and ``torch.cuda.graph``'s own stream is made on the current device, not
  necessarily the store's.

Before a capture, ``aim_at_scratch`` points the static buffers at the scratch slot: the warm-up runs write their
keys and values there, never into a sequence's slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decoder.runners.buckets import Bucket

WARM_UP_RUNS = 3  # eager runs on a side stream before a capture (PyTorch's documented pattern)


class BucketGraphs:
    """The captured graph of each bucket a store has run (``capture=True``), or the eager stand-in."""

    def __init__(
        self,
        step: Callable[[Bucket], torch.Tensor],
        aim_at_scratch: Callable[[Bucket], None],
        device: torch.device,
        capture: bool,
    ) -> None:
        self.step = step
        self.aim_at_scratch = aim_at_scratch
        self.device = device
        self.capturing = capture
        self._graphs: dict[Bucket, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self._stream: Any = torch.cuda.Stream(device) if capture else None  # warm-ups and captures run on it

    @property
    def captured(self) -> tuple[Bucket, ...]:
        return tuple(sorted(self._graphs))

    def run(self, bucket: Bucket) -> None:
        """One step of ``bucket`` over what the static buffers hold now: a replay, or the step itself."""
        if not self.capturing:
            self.step(bucket)
            return
        graph = self._graphs.get(bucket)
        assert graph is not None, f"{bucket} runs before its capture"
        graph.replay()

    def ready(self, bucket: Bucket) -> None:
        """Capture ``bucket`` if it has no graph yet (call before loading a step's inputs: a capture overwrites
        them)."""
        if self.capturing and bucket not in self._graphs:
            self.capture(bucket)

    def capture(self, bucket: Bucket) -> None:
        """Warm the step up on the side stream, then capture it there into the shared pool (module docstring)."""
        assert self.capturing, "capture() with graphs off"
        with torch.inference_mode(), torch.cuda.device(self.device):
            self.aim_at_scratch(bucket)
            current, side = torch.cuda.current_stream(self.device), self._stream
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(WARM_UP_RUNS):
                    self.step(bucket)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                self.step(bucket)
        self._graphs[bucket] = graph
