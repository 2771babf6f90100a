"""The graphs pass (decoder/runners/graphed.py): bucketed fixed shapes over a fixed-capacity store, one CUDA graph per
bucket on a GPU and the same step run eagerly here. What a CPU can prove: which bucket runs a pass (a pure table);
the static buffers are the same memory every step and the store never grows; a token's logits are the same bits
alone, verified among 8 and batched among 64, in float32 and bfloat16; a pass outside the buckets is split without
changing a bit, and counted; the pass computes the model (transformers' logits); and greedy speculative output equals
target-only output in bfloat16, one sequence and batched.

``SPECD_TEST_DEVICE=cuda`` runs the same tests on a GPU, where the steps are captured graphs (and one more test
compares replays with the eager stand-in bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.kv_cache import open_sequence
from decoder.models import from_objects
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.runners.buckets import (
    MANY_ROWS,
    WIDE_ROWS,
    Bucket,
    Piece,
    Step,
    all_buckets,
    bucket_for,
    outside_reasons,
    plan_steps,
)
from decoder.runners.graphed import TILE, GraphPass, GraphSettings, GraphStore
from decoder.runners.select import select_pass
from decoder.sampling import SamplingParams
from tests.decoder.test_native import (
    VOCAB,
    assert_batched_equals_single,
    assert_speculative_equals_target_only,
    llama,
    perturbed,
)

DTYPES = [torch.float32, torch.bfloat16]
DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE", "cpu"))
CAPACITY = 256  # the models' context: attention reads the whole of it every step


def model_of(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    # wide enough that MKL's float32 kernels differ between 1 and n rows (tests/decoder/test_invariant.py)
    shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, head_dim=32)
    return llama(seed=seed, max_position_embeddings=CAPACITY, **{**shape, **overrides}).to(DEVICE, dtype)


def graph_pool(model: torch.nn.Module, slots: int) -> KVPool:
    pool = KVPool(from_objects(model, None, "graphs", runner="graphs"), num_slots=slots)
    assert isinstance(pool.forward_pass, GraphPass) and isinstance(pool.store, GraphStore)
    return pool


def pass_of(pool: KVPool) -> GraphPass:
    assert isinstance(pool.forward_pass, GraphPass)
    return pool.forward_pass


def store_of(pool: KVPool) -> GraphStore:
    assert isinstance(pool.store, GraphStore)
    return pool.store


# -- buckets (pure) -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "width", "k_max", "expected"),
    [
        (1, 1, 8, Bucket(1, 1)),  # a decode step of one sequence
        (1, 9, 8, Bucket(1, 9)),  # a verification of K = 8 drafts: the widest bucket
        (1, 10, 8, None),  # wider than K_max + 1: a prefill
        (3, 5, 8, Bucket(4, 5)),  # 3 sequences pad up to the batch bucket 4
        (5, 1, 8, Bucket(8, 1)),
        (33, 2, 8, Bucket(64, 2)),
        (64, 9, 8, Bucket(64, 9)),  # the largest bucket
        (65, 1, 8, None),  # more than the largest batch
        (2, 5, 4, Bucket(2, 5)),  # K_max 4: widths 1..5
        (2, 6, 4, None),
    ],
)
def test_the_bucket_of_a_pass(batch, width, k_max, expected):
    assert bucket_for(batch, width, k_max) == expected


def test_a_bucket_pads_its_rows_to_whole_tiles():
    assert [Bucket(1, 1).rows(16), Bucket(1, 9).rows(16), Bucket(2, 9).rows(16), Bucket(64, 9).rows(16)] == [
        16,  # one token still costs one tile
        16,  # a K = 8 verification fits one tile of 16
        32,
        576,
    ]


def test_the_buckets_a_pool_captures():
    assert len(all_buckets(8)) == 7 * 9  # batch 1..64 x width 1..9
    assert all_buckets(8, max_batch=3) == [Bucket(b, w) for b in (1, 2, 4) for w in range(1, 10)]
    assert all_buckets(2, max_batch=100)[-1] == Bucket(64, 3)  # no bucket above 64


@pytest.mark.parametrize(
    ("counts", "k_max", "steps"),
    [
        ([1, 3, 2], 8, [Step(Bucket(4, 3), (Piece(0, 0, 1), Piece(1, 0, 3), Piece(2, 0, 2)))]),  # fits: one step
        # a prefill of 20 beside a verification of 3: piece j of every row, each step after the one before
        (
            [20, 3],
            8,
            [
                Step(Bucket(2, 9), (Piece(0, 0, 9), Piece(1, 0, 3))),
                Step(Bucket(1, 9), (Piece(0, 9, 9),)),
                Step(Bucket(1, 2), (Piece(0, 18, 2),)),
            ],
        ),
        ([5], 2, [Step(Bucket(1, 3), (Piece(0, 0, 3),)), Step(Bucket(1, 2), (Piece(0, 3, 2),))]),
    ],
    ids=["inside", "prefill", "k_max-2"],
)
def test_a_pass_is_planned_as_bucket_shaped_steps(counts, k_max, steps):
    assert plan_steps(counts, k_max) == steps


def test_more_rows_than_the_largest_bucket_run_in_groups():
    steps = plan_steps([1] * 70, 8)
    assert [(s.bucket, len(s.pieces)) for s in steps] == [(Bucket(64, 1), 64), (Bucket(8, 1), 6)]
    assert [p.row for s in steps for p in s.pieces] == list(range(70))
    assert outside_reasons([1] * 70, 8) == (MANY_ROWS,)
    assert outside_reasons([10, 1], 8) == (WIDE_ROWS,) and outside_reasons([9] * 64, 8) == ()


def test_settings_are_read_once_and_validated():
    assert GraphSettings.from_environ({}) == GraphSettings(k_max=8, capture=True, compile=False)
    env = {"SPECD_GRAPH_K_MAX": "4", "SPECD_GRAPH_CAPTURE": "0"}
    assert GraphSettings.from_environ(env) == GraphSettings(4, False, False)
    for bad, message in [
        ({"SPECD_GRAPH_K_MAX": "0"}, "SPECD_GRAPH_K_MAX must be a whole number in 1..32, got '0'"),
        ({"SPECD_GRAPH_K_MAX": "eight"}, "SPECD_GRAPH_K_MAX must be a whole number"),
        ({"SPECD_GRAPH_CAPTURE": "yes"}, "SPECD_GRAPH_CAPTURE must be 0 or 1, got 'yes'"),
    ]:
        with pytest.raises(ValueError, match=message):
            GraphSettings.from_environ(bad)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="SPECD_GRAPH_COMPILE=1 compiles for CUDA only"):
            GraphPass(llama(), DEVICE, GraphSettings(compile=True))


def test_auto_picks_the_graphs_pass_on_a_gpu_only():
    model = llama()
    assert select_pass(model, "auto", torch.device("cuda")).name == "graphs"  # made without touching the GPU
    assert select_pass(model, "auto", torch.device("cpu")).name in ("native", "lean")
    assert select_pass(model, "graphs", torch.device("cpu")).name == "graphs"  # named, it runs here too


# -- static buffers -------------------------------------------------------------------------------------------------


def addresses(store: GraphStore) -> dict[str, int]:
    return {
        name: getattr(store, name).data_ptr()
        for name in ("keys", "values", "table", "logits", "cos", "sin", "capacity_index")
    }


def test_the_static_buffers_are_the_same_memory_every_step_and_the_store_never_grows():
    pool = graph_pool(model_of(torch.float32), slots=3)
    store = pool.store
    assert isinstance(store, GraphStore)
    assert store.capacity == CAPACITY and store.keys.shape[1] == 3 + 1  # the scratch slot
    before = addresses(store)
    generator = torch.Generator().manual_seed(3)
    a, b = pool.open(), pool.open()
    pool.forward_many([(a, torch.randint(0, VOCAB, (30,), generator=generator))])  # split: 4 steps
    for width in (1, 5, 9, 1):
        pool.forward_many([(a, torch.randint(0, VOCAB, (width,), generator=generator)), (b, torch.arange(1, 3))])
    a.truncate(10)
    pool.forward_many([(a, torch.arange(1, 4))])
    assert addresses(store) == before
    with pytest.raises(ValueError, match=r"the graphs pass holds 256 positions per sequence .* this pass needs 257"):
        pool.forward_many([(b, torch.zeros(CAPACITY + 1 - b.length, dtype=torch.long))])
    assert addresses(store) == before
    if DEVICE.type == "cpu":
        assert store.graphs.captured == ()  # the eager stand-in: nothing captured


def test_padding_writes_only_the_scratch_slot():
    """Rows padded up to a bucket (a shorter row, the sequences up to the batch bucket) write their keys to the
    scratch slot: a free slot and the positions past a sequence's end stay as they were."""
    pool = graph_pool(model_of(torch.float32), slots=4)
    a, b, c = pool.open(), pool.open(), pool.open()
    pool.forward_many([(a, torch.arange(1, 8)), (b, torch.arange(1, 3)), (c, torch.arange(3, 4))])  # bucket (4, 7)
    keys = store_of(pool).keys
    for slot, length in ((a.slot, 7), (b.slot, 2), (c.slot, 1)):
        assert keys[:, slot, :, :length].abs().sum() > 0 and not keys[:, slot, :, length:].any(), slot
    assert not keys[:, 3].any(), "the free slot"
    assert keys[:, 4].any(), "the scratch slot took the padding"


# -- exactness -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tokens_logits_are_the_same_bits_alone_verified_among_8_and_batched_among_64(dtype, request):
    """One sequence decodes 8 tokens one step at a time (bucket 1 x 1); a twin verifies the same 8 in one row
    (1 x 8); a third decodes them again inside passes of 64 sequences of every width (64 x 1, 64 x 9), the last
    one 65 rows (split into 64 + 1). The same bits every time; the other sequences' tokens and lengths differ."""
    torch.set_num_threads(2)
    request.addfinalizer(lambda: torch.set_num_threads(1))
    pool = graph_pool(model_of(dtype), slots=66)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (20,), generator=generator)
    tokens = torch.randint(0, VOCAB, (8,), generator=generator)
    alone_seq, twin, third = pool.open(), pool.open(), pool.open()
    others = [pool.open() for _ in range(63)]
    pool.forward_many([(alone_seq, prompt), (twin, prompt), (third, prompt)])
    pool.forward_many(
        [(seq, torch.randint(0, VOCAB, (3 + i % 17,), generator=generator)) for i, seq in enumerate(others)]
    )

    alone = torch.cat([alone_seq.forward(tokens[i : i + 1]) for i in range(8)])  # [8, vocab]
    verified = twin.forward(tokens)
    assert verified.dtype == dtype and torch.equal(verified, alone), (verified - alone).abs().max()

    def among_others(count: int, widths: list[int], extra: list | None = None) -> torch.Tensor:
        """``third`` appends its next ``count`` tokens after one row per other sequence of the given widths."""
        rows = [
            (seq, torch.randint(0, VOCAB, (w,), generator=generator)) for seq, w in zip(others, widths, strict=True)
        ]
        done = third.length - len(prompt)
        rows += [*(extra or []), (third, tokens[done : done + count])]
        return pool.forward_many(rows)[-1]

    batched = [
        among_others(1, [1] * 63),  # bucket 64 x 1
        among_others(2, [1 + i % 9 for i in range(63)]),  # 64 x 9, ragged
        among_others(5, [9] * 63, [(alone_seq, tokens[:1])]),  # 65 rows: 64 x 9, then this row alone in 1 x 5
    ]
    assert torch.equal(torch.cat(batched), alone), (torch.cat(batched) - alone).abs().max()
    counted = pass_of(pool).outside_buckets
    assert counted == {WIDE_ROWS: 2, MANY_ROWS: 1}, counted  # the two prefills; the 65 rows


def test_every_call_has_one_shape_whatever_the_bucket(monkeypatch):
    """Why the bits cannot depend on the bucket, checked where this CPU cannot show it (MKL gives the same bits for
    every multiple of 16 rows here; a GPU's kernels are chosen by shape): every row-wise module call runs on exactly
    ``TILE`` rows, and every attention call has the same shapes, in buckets 1 x 1, 1 x 9, 4 x 3, 8 x 9 and a split
    prefill. (The PyTorch forms' calls: the Triton forms are one launch per layer and step whatever the bucket,
    tests/decoder/test_graph_triton.py.)"""
    from decoder.runners import capacity_attention

    monkeypatch.setenv("SPECD_GRAPH_ATTENTION", "capacity")
    monkeypatch.setenv("SPECD_GRAPH_ROWS", "tiles")
    model = model_of(torch.float32)
    pool = graph_pool(model, slots=8)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    row_wise = [m for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "LlamaRMSNorm"]
    hooks = [
        m.register_forward_pre_hook(lambda m, args: seen.add(("rows", tuple(args[0].shape[:-1])))) for m in row_wise
    ]
    attend_one = capacity_attention.attend_one

    def recorded(q, keys, values, visible, scaling):
        seen.add(("attention", (*q.shape, *keys.shape, *values.shape, *visible.shape)))
        return attend_one(q, keys, values, visible, scaling)

    monkeypatch.setattr(capacity_attention, "attend_one", recorded)
    try:
        seqs = [pool.open() for _ in range(8)]
        pool.forward_many([(seqs[0], torch.arange(1, 21))])  # 20 tokens: steps of 9, 9, 2
        pool.forward_many([(seqs[0], torch.arange(1, 2))])
        pool.forward_many([(seqs[0], torch.arange(1, 10))])
        pool.forward_many([(s, torch.arange(1, 1 + i % 3 + 1)) for i, s in enumerate(seqs[:3])])
        pool.forward_many([(s, torch.arange(1, 10)) for s in seqs])
    finally:
        for hook in hooks:
            hook.remove()
    assert {shape for kind, shape in seen if kind == "rows"} == {(TILE,)}
    assert len({shape for kind, shape in seen if kind == "attention"}) == 1, seen


def test_a_pass_outside_the_buckets_is_split_without_changing_a_bit():
    """A prefill of 23 tokens runs as steps of 9, 9 and 5; its logits (all, then the last 7: across two steps) are
    the bits of the same tokens decoded one at a time."""
    pool = graph_pool(model_of(torch.bfloat16), slots=3)
    tokens = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(4))
    one_by_one, whole, tail = pool.open(), pool.open(), pool.open()
    expected = torch.cat([one_by_one.forward(tokens[i : i + 1]) for i in range(23)])
    assert pass_of(pool).outside_buckets == {WIDE_ROWS: 0, MANY_ROWS: 0}
    assert torch.equal(whole.forward(tokens), expected)
    assert torch.equal(tail.forward(tokens, logits_to_keep=7), expected[-7:])
    assert pass_of(pool).outside_buckets == {WIDE_ROWS: 2, MANY_ROWS: 0}
    for got, want in zip(whole.cached_keys(), one_by_one.cached_keys(), strict=True):
        assert torch.equal(got, want)


def beside_transformers(
    pool: KVPool, dtype: torch.dtype, first: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A prefill of ``first`` tokens, decode steps, a rollback of 4 and a verification, through ``pool``, through
    transformers in ``dtype`` and in float64: each step's (ours, transformers', float64's) logits, in float64."""
    ours = pool.open()
    same_dtype = open_sequence(from_objects(model_of(dtype), None, "theirs", runner="transformers"))
    exact = open_sequence(from_objects(model_of(torch.float64), None, "exact", runner="transformers"))
    generator = torch.Generator().manual_seed(1)
    steps = []
    for i, n in enumerate((first, 1, 6, 1, 9)):
        if i == 3:  # roll back 4 tokens first
            for seq in (ours, same_dtype, exact):
                seq.truncate(seq.length - 4)
        tokens = torch.randint(0, VOCAB, (n,), generator=generator)
        steps.append((ours.forward(tokens).double(), same_dtype.forward(tokens).double(), exact.forward(tokens)))
    return steps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_logits_as_transformers(dtype):
    """Invariance is not enough: the pass must compute the model. Against transformers in float64: to float32
    rounding in float32; in bfloat16 no further off than transformers' own bfloat16 forward."""
    for i, (got, theirs, want) in enumerate(beside_transformers(graph_pool(model_of(dtype), slots=1), dtype, 37)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4, msg=f"step {i}")
        else:
            ours_off, theirs_off = (got - want).abs().max(), (theirs - want).abs().max()
            assert ours_off <= 1.25 * theirs_off + 1e-3, f"step {i}: {ours_off:.3f} off, transformers {theirs_off:.3f}"


def bf16_pair(tokenizer, seed: int) -> tuple:
    vocab = len(tokenizer)
    target = from_objects(model_of(torch.bfloat16, seed, vocab_size=vocab), tokenizer, "t", runner="graphs")
    sometimes = perturbed(model_of(torch.bfloat16, seed, vocab_size=vocab), seed + 1)
    return target, from_objects(sometimes, tokenizer, "d", runner="graphs")


def test_speculative_greedy_equals_target_only_exactly_in_bfloat16(tokenizer):
    target, draft = bf16_pair(tokenizer, seed=4)
    assert_speculative_equals_target_only(SpeculativeDecoder(target, draft), len(tokenizer))


def test_batched_greedy_equals_single_exactly_in_bfloat16(tokenizer):
    rules = StopConditions(max_new_tokens=16)
    target, draft = bf16_pair(tokenizer, seed=8)
    engine = BatchEngine(target, draft, max_batch=4)
    assert engine.draft_pool is not None
    assert engine.target_pool.forward_pass.name == engine.draft_pool.forward_pass.name == "graphs"
    assert_batched_equals_single(engine, rules, len(tokenizer))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="captured graphs need CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_replayed_graphs_give_the_eager_stand_ins_bits(dtype, monkeypatch):
    """On a GPU: every bucket a 4-slot pool can use is captured at start-up, and replays give the bits the same
    step gives run eagerly (``SPECD_GRAPH_CAPTURE=0``)."""
    model = model_of(dtype)
    graphed = graph_pool(model, slots=4)
    captured = pass_of(graphed).capture_all(store_of(graphed))
    assert captured == len(store_of(graphed).graphs.captured) == 3 * 9  # batch 1, 2, 4 x width 1..9
    monkeypatch.setenv("SPECD_GRAPH_CAPTURE", "0")
    eager = graph_pool(model, slots=4)
    assert not store_of(eager).graphs.capturing
    generator = torch.Generator().manual_seed(6)
    seqs = [(graphed.open(), eager.open()) for _ in range(3)]
    for widths in ([17, 3, 1], [1, 1, 1], [9, 2, 5], [4]):
        tokens = [torch.randint(0, VOCAB, (w,), generator=generator) for w in widths]
        got = graphed.forward_many([(g, t) for (g, _), t in zip(seqs, tokens, strict=False)])
        want = eager.forward_many([(e, t) for (_, e), t in zip(seqs, tokens, strict=False)])
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (g - w).abs().max()
    assert store_of(graphed).graphs.captured == tuple(sorted(store_of(graphed).graphs.captured))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="captured graphs need CUDA")
def test_on_a_gpu_the_engine_captures_before_serving_and_serving_only_replays(tokenizer):
    """The worker's start-up (``BatchEngine.capture_graphs``) captures every bucket of both pools outside any forward;
    batched and single-sequence decoding then capture nothing more in them and stay exact; one-sequence decoding
    (``SpeculativeDecoder``) captures its spare pools' buckets once, not per request. (On the CPU:
    tests/decoder/test_graph_capture.py runs the same against a recording stand-in.)"""
    target, draft = bf16_pair(tokenizer, seed=8)
    engine = BatchEngine(target, draft, max_batch=4)  # assert_batched_equals_single decodes 4 together
    assert engine.draft_pool is not None
    assert engine.capture_graphs() == 2 * 3 * 9  # two pools x batch 1, 2, 4 x width 1..9
    pools = (store_of(engine.target_pool), store_of(engine.draft_pool))
    assert not any(store.keys.requires_grad or store.logits.requires_grad for store in pools)
    before = [store.graphs.captured for store in pools]
    assert_batched_equals_single(engine, StopConditions(max_new_tokens=12), len(tokenizer))
    assert [store.graphs.captured for store in pools] == before

    def request() -> list[int]:
        return engine.generate([5, 6, 7, 8], "draft", 4, SamplingParams(), StopConditions(max_new_tokens=12)).token_ids

    first = request()
    spare = engine.spare_target.open()  # the pool the requests decoded in
    engine.spare_target.release(spare)
    captured = store_of(spare.pool).graphs.captured
    assert request() == first and store_of(spare.pool).graphs.captured == captured, "a request captured again"
