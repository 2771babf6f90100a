"""The graphs pass's capture code (decoder/runners/graph_manager.py, ``GraphPass.capture_all``), run on a CPU against
a recorder that behaves as a CUDA graph does.

A CUDA graph replays the kernels its capture recorded, on the memory they used then; the step's Python does not run
again. So a step is capturable only when:

(a) no operation needs the host to see a tensor's values (``.item()``, a tensor's truth value, ``nonzero`` and
    boolean-mask indexing, whose output shapes depend on values): they fail under capture;
(b) it makes no tensor from Python data (``torch.tensor([...])``): a constant, frozen at capture;
(c) every tensor it reads is a public buffer of its store, a weight or buffer of the model, or made by the step
    itself: anything else (a tensor made per call, outside the step) is read at its capture-time address forever;
(d) replays over new inputs give the bits of the same step run eagerly.

``Recorder`` (a ``TorchDispatchMode``) sees every aten operation of a capture, refuses (a)-(c) naming the operation,
and records (operation, arguments, outputs); ``FakeGraph.replay`` reruns the recorded operations on the recorded
tensors, writing each fresh output into the tensor the capture produced, without the step's Python: as on a GPU.
The CPU tests of tests/decoder/test_graph_pass.py run the eager stand-in, which reaches none of this code.

The capture itself must run under ``torch.inference_mode`` (start-up calls it outside any forward, and the model's
weights require grad: a capture recording a backward graph keeps every saved activation alive), and on the stream
its warm-up ran on. One-sequence decoding (``SpeculativeDecoder``) must not capture per request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.models import from_objects
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.runners.buckets import Bucket
from decoder.runners.graph_manager import WARM_UP_RUNS, BucketGraphs
from decoder.runners.graphed import GraphStore
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from tests.decoder.test_graph_pass import DEVICE, graph_pool, model_of, pass_of, store_of
from tests.decoder.test_native import VOCAB

aten = torch.ops.aten
REFUSED = {  # (a) and (b): the operation, and why a CUDA graph cannot hold it
    aten.item.default: "a host sync (.item())",
    aten._local_scalar_dense.default: "a host sync (.item(), .tolist())",
    aten.is_nonzero.default: "a host sync (a tensor's truth value: if tensor:)",
    aten.nonzero.default: "a shape that depends on values (nonzero)",
    aten.masked_select.default: "a shape that depends on values (masked_select)",
    aten.lift_fresh.default: "a tensor made from Python data (torch.tensor): a constant frozen at capture",
    aten.lift_fresh_copy.default: "a tensor made from Python data (torch.tensor): a constant frozen at capture",
}

INDEXING = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)  # args[1]: the indices


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


@dataclass
class Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    fresh: list[bool]  # per output: a new tensor (not a view of, nor an in-place result on, an input)


class Recorder(TorchDispatchMode):
    """Refuses what a CUDA graph cannot capture ((a)-(c) in the module docstring) and records every operation."""

    def __init__(self, allowed: set[int]) -> None:
        super().__init__()
        self.allowed = allowed  # storages of the static buffers and weights
        self.made: set[int] = set()  # storages this capture's operations produced
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in REFUSED:
            raise AssertionError(f"{func} inside a captured step: {REFUSED[func]}")
        inputs = tensors((args, kwargs))
        masks = [i for i in tensors(args[1:2]) if i.dtype in (torch.bool, torch.uint8)] if func in INDEXING else []
        if masks:
            raise AssertionError(f"{func} with a boolean mask inside a captured step: a shape that depends on values")
        for t in inputs:
            if storage(t) not in self.allowed and storage(t) not in self.made:
                raise AssertionError(
                    f"{func} reads a {tuple(t.shape)} {t.dtype} tensor that is neither a static buffer, a weight, "
                    "nor made by the step: a replay would read it at its capture-time address"
                )
        out = func(*args, **kwargs)
        outputs = tensors(out)
        read = {storage(t) for t in inputs}
        self.ops.append(Op(func, args, kwargs, outputs, [storage(t) not in read for t in outputs]))
        self.made.update(storage(t) for t in outputs)
        return out


class FakeGraph:
    """torch.cuda.CUDAGraph: ``replay`` reruns the recorded operations over the recorded tensors."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.inference_mode():
            for op in self.ops:
                fresh = tensors(op.func(*op.args, **op.kwargs))
                for recorded, new, is_fresh in zip(op.outputs, fresh, op.fresh, strict=True):
                    if is_fresh:
                        recorded.copy_(new)


class FakeStream:
    """torch.cuda.Stream (a class: transformers' annotations write ``torch.cuda.Stream | None``)."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def wait_stream(self, other: FakeStream) -> None:
        pass


@dataclass
class Simulator:
    """Stands in for torch.cuda's graph and stream API (``fake_cuda``); what each capture saw."""

    allowed: set[int] = field(default_factory=set)
    current_streams: list[FakeStream | None] = field(default_factory=lambda: [None])
    captures: list[dict[str, Any]] = field(default_factory=list)  # per capture: its stream, warm-up streams, mode
    warm_up_streams: list[FakeStream | None] = field(default_factory=list)

    def allow(self, store: GraphStore, model: torch.nn.Module) -> None:
        """The store's public tensors and the model's weights and buffers may be read by a captured step."""
        buffers = [v for k, v in vars(store).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]
        self.allowed.update(storage(t) for t in [*buffers, *model.parameters(), *model.buffers()])

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        self.current_streams.append(s)
        try:
            yield
        finally:
            self.current_streams.pop()

    @contextlib.contextmanager
    def graph(self, graph: FakeGraph, pool: Any = None, stream: FakeStream | None = None, **_: Any) -> Iterator[None]:
        recorder = Recorder(self.allowed)
        self.captures.append({"stream": stream, "warm_up_streams": list(self.warm_up_streams),
                              "inference_mode": torch.is_inference_mode_enabled()})  # fmt: skip
        with self.stream(stream) if stream is not None else contextlib.nullcontext(), recorder:
            yield
        graph.ops = recorder.ops
        self.warm_up_streams = []  # the next capture's warm-up runs next


@pytest.fixture
def fake_cuda(monkeypatch) -> Simulator:
    """Graphs stores capture on this CPU: torch.cuda's graph and stream calls go to a ``Simulator``."""
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the real captures run (tests/decoder/test_graph_pass.py, SPECD_TEST_DEVICE=cuda)")
    return install_fake_cuda(monkeypatch)


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Simulator:
    """Every graphs store made from now on captures (unless SPECD_GRAPH_CAPTURE=0), into a ``Simulator`` (also what
    a dry run of a GPU benchmark on this CPU can install: ``pytest.MonkeyPatch()`` as ``monkeypatch``)."""
    sim = Simulator()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current_streams[-1] or FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", sim.stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", sim.graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    made = GraphStore.__init__

    def capturing_store(store: GraphStore, pass_: Any, num_slots: int, capacity: int) -> None:
        made(store, pass_, num_slots, capacity)
        capture = pass_.settings.capture  # as on CUDA: SPECD_GRAPH_CAPTURE=0 runs the eager stand-in
        store.graphs = BucketGraphs(store.graphs.step, store.aim_at_scratch, store.device, capture=capture)
        step = store.graphs.step

        def counted(bucket: Bucket) -> torch.Tensor:  # the step's Python: what a replay must not run
            store.step_calls = getattr(store, "step_calls", 0) + 1
            sim.warm_up_streams.append(sim.current_streams[-1])
            return step(bucket)

        store.graphs.step = counted
        sim.allow(store, pass_.model)

    monkeypatch.setattr(GraphStore, "__init__", capturing_store)
    return sim


# -- the recorder catches what a CUDA graph cannot hold ---------------------------------------------------------------


def bad_steps(static: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    per_call = torch.arange(4)  # made outside the step and outside the static buffers
    return {
        "item": lambda: static * static.sum().item(),
        "truth value": lambda: static * 2 if static.sum() > 0 else static,
        "boolean mask": lambda: static[static > 1],
        "nonzero": lambda: static.nonzero(),
        "tensor from a list": lambda: static + torch.tensor([1, 2, 3, 4]),
        "per-call tensor": lambda: static + per_call,
    }


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("item", "host sync"),
        ("truth value", "host sync"),
        ("boolean mask", "boolean mask|shape that depends on values"),
        ("nonzero", "shape that depends on values"),
        ("tensor from a list", "made from Python data"),
        ("per-call tensor", "neither a static buffer"),
    ],
)
def test_the_recorder_refuses_what_a_cuda_graph_cannot_hold(name, message):
    """The checks are real: each of these would fail, or be frozen at capture, on a GPU."""
    static = torch.arange(4)
    step = bad_steps(static)[name]  # its per-call tensor made here, before the capture
    with pytest.raises(AssertionError, match=message), Recorder({storage(static)}):
        step()


def test_a_replay_reruns_the_kernels_not_the_python():
    """The recorder's replay is a CUDA graph's: new values in the static input, new output; Python not run."""
    static_in, static_out = torch.zeros(4), torch.zeros(4)
    calls = []

    def step() -> None:
        calls.append(1)
        static_out.copy_(static_in * 2 + 1)

    graph, recorder = FakeGraph(), Recorder({storage(static_in), storage(static_out)})
    with recorder:
        step()
    graph.ops = recorder.ops
    static_in.copy_(torch.arange(4.0))
    graph.replay()
    assert static_out.tolist() == [1.0, 3.0, 5.0, 7.0] and len(calls) == 1


# -- the graphs pass under it --------------------------------------------------------------------------------------


def test_captured_steps_replay_the_eager_bits_and_hold_no_autograd(fake_cuda):
    """Every bucket of a 4-slot pool captured at start-up (outside any forward, as the worker does): no capture saw
    autograd on, each ran on its warm-up's stream, and nothing in the store requires grad. Then passes of every kind
    (a split prefill, ragged widths, a rollback) through replays give the eager stand-in's bits, and the step's
    Python never runs again."""
    model = model_of(torch.float32)
    graphed = graph_pool(model, slots=4)
    store = store_of(graphed)
    assert store.graphs.capturing
    captured = pass_of(graphed).capture_all(store)
    assert captured == len(store.graphs.captured) == 3 * 9  # batch 1, 2, 4 x width 1..9
    assert not any(t.requires_grad for t in (store.keys, store.values, store.logits)), "captured with autograd on"
    for capture in fake_cuda.captures:
        assert capture["inference_mode"], "a capture with autograd on records a backward graph"
        assert capture["stream"] is not None and capture["warm_up_streams"] == [capture["stream"]] * WARM_UP_RUNS
    assert pass_of(graphed).capture_all(store) == 0  # already captured: nothing more
    steps_at_capture = store.step_calls
    assert steps_at_capture == 27 * (WARM_UP_RUNS + 1)

    graphed_twin = graph_pool(model, slots=4)
    store_of(graphed_twin).graphs.capturing = False  # the eager stand-in, over the same buffers and step
    eager = KVPool(from_objects(model, None, "eager", runner="lean"), num_slots=4)  # the model, computed another way
    generator = torch.Generator().manual_seed(6)
    seqs = [(graphed.open(), graphed_twin.open(), eager.open()) for _ in range(3)]
    for widths in ([17, 3, 1], [1, 1, 1], [9, 2, 5], [4], [1, 9]):
        tokens = [torch.randint(0, VOCAB, (w,), generator=generator) for w in widths]
        got = graphed.forward_many([(g, t) for (g, _, _), t in zip(seqs, tokens, strict=False)])
        want = graphed_twin.forward_many([(w, t) for (_, w, _), t in zip(seqs, tokens, strict=False)])
        close = eager.forward_many([(e, t) for (_, _, e), t in zip(seqs, tokens, strict=False)])
        for g, w, c in zip(got, want, close, strict=True):
            assert torch.equal(g, w), (g - w).abs().max()
            torch.testing.assert_close(g, c, rtol=0, atol=2e-4)  # and it is the model
        if widths == [9, 2, 5]:
            for g, w, e in seqs:
                for seq in (g, w, e):
                    seq.truncate(seq.length - 3)
    assert store.step_calls == steps_at_capture, "a step's Python ran after capture: not a replay"
    assert sum(store.graphs._graphs[b].replays for b in store.graphs.captured) > 0


def test_a_bucket_met_first_while_serving_is_captured_then_replayed(fake_cuda):
    """A pool not captured at start-up captures each bucket the first time a pass meets it (inside the forward's
    inference mode), then replays it."""
    pool = graph_pool(model_of(torch.float32), slots=2)
    a, b = pool.open(), pool.open()
    pool.forward_many([(a, torch.arange(1, 4)), (b, torch.arange(1, 2))])  # bucket 2 x 3
    pool.forward_many([(a, torch.arange(1, 4)), (b, torch.arange(1, 2))])
    assert store_of(pool).graphs.captured == (Bucket(2, 3),)
    assert store_of(pool).graphs._graphs[Bucket(2, 3)].replays == 2
    assert all(c["inference_mode"] for c in fake_cuda.captures)


def test_the_worker_engine_captures_its_pools_before_serving(fake_cuda, tokenizer):
    """``BatchEngine.capture_graphs`` (the worker's start-up) captures every bucket of the target's and the draft's
    pools; the warm-up's rounds and a served request then only replay."""
    vocab = len(tokenizer)
    target = from_objects(model_of(torch.float32, 0, vocab_size=vocab), tokenizer, "t", runner="graphs")
    draft = from_objects(model_of(torch.float32, 1, vocab_size=vocab), tokenizer, "d", runner="graphs")
    engine = BatchEngine(target, draft, max_batch=2)
    assert engine.capture_graphs() == 2 * 2 * 9  # two pools x batch 1, 2 x width 1..9
    captures = len(fake_cuda.captures)
    engine.warm_up(max_k=2, batch_sizes=(1, 2))
    session = engine.open([5, 6, 7], SamplingParams(), StopConditions(max_new_tokens=6), requested("draft", 3))
    while session.finish_reason is None:
        engine.step([session])
    engine.close(session)
    assert len(fake_cuda.captures) == captures, "a step captured while serving"


def test_one_sequence_decoding_captures_once_not_per_request(fake_cuda, tokenizer):
    """``SpeculativeDecoder.generate`` decodes in pools kept from one request to the next: the second request with
    the same shapes captures nothing (it made a new pool, and captured its buckets again, per request); a request
    that fails gives its slots back too."""
    vocab = len(tokenizer)
    target = from_objects(model_of(torch.float32, 0, vocab_size=vocab), tokenizer, "t", runner="graphs")
    draft = from_objects(model_of(torch.float32, 1, vocab_size=vocab), tokenizer, "d", runner="graphs")
    decoder = SpeculativeDecoder(target, draft)
    rules, prompt = StopConditions(max_new_tokens=12), [5, 6, 7, 8]
    first = decoder.generate(prompt, "draft", 3, SamplingParams(), rules)
    captures = len(fake_cuda.captures)
    assert captures > 0
    for _ in range(2):
        again = decoder.generate(prompt, "draft", 3, SamplingParams(), rules)
        assert again.token_ids == first.token_ids
    assert len(fake_cuda.captures) == captures, "a request captured its pool's graphs again"
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([], "draft", 3, SamplingParams(), rules)
    decoder.generate(prompt, "none", 0, SamplingParams(), rules)
    assert len(fake_cuda.captures) == captures
