"""The native Llama pass (decoder/native): transformers' logits to float32 rounding (to bfloat16 rounding of the
activations with the AVX512-BF16 products), bit-identical logits for a token whatever else shares its pass (batch
invariance) within each build, and therefore greedy speculative output equal to greedy target-only output token
for token, with no tie allowance. The tests that take ``isa`` run once per build (``SPECD_NATIVE_ISA``), each
skipped with the reason where this CPU cannot run it; ``test_the_ci_machine_runs_it`` fails where a build the CPU
can run does not load (a silent fallback would skip every test below)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from decoder.batch_engine import BatchEngine
from decoder.engine import SpeculativeDecoder
from decoder.kv_cache import open_sequence
from decoder.models import from_objects
from decoder.native import build
from decoder.native.llama import NativeLlama, pack_pair_panels, pack_panels
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.runners.native import NativePass
from decoder.sampling import SamplingParams
from specd_api.plan import requested

VOCAB = 97  # not a multiple of 16: the LM head's last panel is padded
needs_native = pytest.mark.skipif(build.load() is None, reason=f"no native pass here: {build.why_not()}")


def llama(seed: int = 0, bf16_weights: bool = False, **overrides) -> torch.nn.Module:
    # hidden 48: three panels, so the one-token path runs its single-panel remainder too
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**base, **overrides})).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # sharper distributions than the init's: argmaxes well apart, drafts that disagree
            if bf16_weights:
                p.copy_(p.to(torch.bfloat16).float())
    return model


def pool_of(model, runner: str = "native", slots: int = 3) -> KVPool:
    return KVPool(from_objects(model, None, runner, runner=runner), num_slots=slots)


@pytest.fixture(params=build.ISA_NAMES)
def isa(request, monkeypatch) -> str:
    """Run the test with the build it names (``SPECD_NATIVE_ISA``), or skip saying why this CPU cannot."""
    name = request.param
    if build.load(name) is None:
        pytest.skip(f"no {name} build here: {build.why_not(name)}")
    monkeypatch.setenv(build.ISA_ENV, name)
    build.reselect()
    request.addfinalizer(build.reselect)
    return name


def test_the_ci_machine_runs_it():
    # The development and CI machines have gcc and AVX2 (some AVX512-BF16 too): a silent fallback there would
    # leave every test below skipped and the engine on a slower path.
    if os.environ.get("CI_EXPECTS_NATIVE", "1") == "1":
        for choice in build.ISAS:
            if choice.cpu_flags <= build._cpu_flags():
                assert build.load(choice.name) is not None, f"{choice.name}: {build.why_not(choice.name)}"


def test_the_best_build_runs_unless_one_is_named(monkeypatch):
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    build.reselect()
    try:
        if build.load() is not None:
            assert build.selected_isa() == build.available_isas()[-1]
        monkeypatch.setenv(build.ISA_ENV, "amx")  # no AMX build: refused by name, never quietly replaced
        build.reselect()
        assert build.load() is None and build.why_not() == "SPECD_NATIVE_ISA='amx' is not one of avx2, avx512bf16"
        monkeypatch.setenv(build.ISA_ENV, " AVX2")  # read case- and space-insensitively
        build.reselect()
        assert build.selected_isa() == "avx2" and (build.load() is not None or build.why_not().startswith("SPECD"))
        if "avx512_bf16" not in build._cpu_flags():
            monkeypatch.setenv(build.ISA_ENV, "avx512bf16")
            build.reselect()
            assert build.load() is None and "the CPU lacks" in build.why_not() and "avx512_bf16" in build.why_not()
            assert pool_of(llama(bf16_weights=True), runner="auto").forward_pass.name == "lean"
    finally:
        monkeypatch.delenv(build.ISA_ENV, raising=False)
        build.reselect()


# Logits against transformers in float64: float32 products agree to float32 rounding; bfloat16 products round
# each activation to bfloat16 first (a relative 2^-9), which moves these logits (spread about 1.3) by 0.01 on
# average and 0.12 at most over three seeds. A wrong pair order, panel or tail is off by the logits' own scale.
FLOAT32_PRODUCTS = dict(atol=2e-4, mean=2e-5)
BFLOAT16_PRODUCTS = dict(atol=0.25, mean=0.03)


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["float32-panels", "bfloat16-panels"])
def test_same_logits_as_transformers(bf16_weights, isa):
    model = llama(bf16_weights=bf16_weights)
    pool = pool_of(model)
    assert isinstance(pool.forward_pass, NativePass) and pool.forward_pass.native.bf16 == bf16_weights
    # the dot-product build runs bfloat16 weights only; float32 weights take its AVX2 products
    kernel = "avx512bf16" if isa == "avx512bf16" and bf16_weights else "avx2"
    assert pool.forward_pass.kernel == kernel
    tolerance = BFLOAT16_PRODUCTS if kernel == "avx512bf16" else FLOAT32_PRODUCTS
    fast = pool.open()
    # the reference: transformers' forward on the same weights in float64
    slow = open_sequence(from_objects(llama(bf16_weights=bf16_weights).double(), None, "slow", runner="transformers"))
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (37, 1, 6, 1, 9)]
    argmaxes = 0
    for i, tokens in enumerate(steps):
        if i == 3:  # roll back 4 tokens first
            fast.truncate(fast.length - 4)
            slow.truncate(slow.length - 4)
        got, expected = fast.forward(tokens), slow.forward(tokens)
        error = (got.double() - expected).abs()
        assert error.max() <= tolerance["atol"] and error.mean() <= tolerance["mean"], (i, error.max(), error.mean())
        top2 = expected.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tolerance["atol"]  # argmaxes apart by more than the error can move
        assert (got.argmax(-1) == expected.argmax(-1))[clear].all()
        argmaxes += int(clear.sum())
        for a, b in zip(fast.cached_keys(), slow.cached_keys(), strict=True):
            key_error = (a.double() - b).abs()
            assert key_error.max() <= tolerance["atol"] and key_error.mean() <= tolerance["mean"]
    assert argmaxes >= 10  # most positions have a clear argmax: the comparison above was not vacuous


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["float32-panels", "bfloat16-panels"])
def test_a_tokens_logits_do_not_depend_on_what_shares_its_pass(bf16_weights, isa, request):
    """One token at a time, as a (K+1)-token verification, and in a ragged batch beside other sequences: the
    same bits."""
    torch.set_num_threads(2)  # the panels split between two threads (conftest runs tests on one)
    request.addfinalizer(lambda: torch.set_num_threads(1))
    pool = pool_of(llama(bf16_weights=bf16_weights), slots=4)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (30,), generator=generator)
    tokens = torch.randint(0, VOCAB, (9,), generator=generator)
    a, b, c = pool.open(), pool.open(), pool.open()
    for seq in (a, b):
        seq.forward(prompt)
    c.forward(torch.randint(0, VOCAB, (11,), generator=generator))

    alone = torch.cat([a.forward(tokens[i : i + 1]) for i in range(len(tokens))])
    verified = b.forward(tokens)  # 9 rows: the multi-token kernels (6 + 3 tokens in AVX2, one tile of 9 in BF16)
    assert torch.equal(alone, verified)
    for width in (2, 5, 7):
        b.truncate(30)
        assert torch.equal(b.forward(tokens[:width]), alone[:width]), width
    long = pool.open()  # 27 rows: two full tiles of 12 and a tail (BF16), four of 6 and a tail (AVX2)
    long.forward(prompt)
    more = torch.randint(0, VOCAB, (27,), generator=generator)
    stepped = torch.cat([long.forward(more[i : i + 1]) for i in range(len(more))])
    long.truncate(30)
    assert torch.equal(long.forward(more), stepped)
    b.truncate(30)
    other = torch.randint(0, VOCAB, (4,), generator=generator)
    rows = pool.forward_many([(c, other), (b, tokens[:5])])  # ragged: 4 + 5 tokens, two slots
    assert torch.equal(rows[1], alone[:5])
    assert pool.forward_many([(b, tokens[5:6])], logits_to_keep=1)[0].equal(alone[5:6])


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every weight moved by noise of 15 % of its mean magnitude (in place): a draft that agrees
    with its unperturbed twin often, not always."""
    with torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15 * p.abs().mean())
    return model


def greedy_pair(tokenizer, seed: int) -> tuple:
    vocab = len(tokenizer)
    target = from_objects(llama(seed=seed, bf16_weights=True, vocab_size=vocab), tokenizer, "target")
    draft = llama(seed=seed + 100, num_hidden_layers=1, bf16_weights=True, vocab_size=vocab)
    # A draft that sometimes agrees: the target's own weights, lightly perturbed.
    sometimes = perturbed(llama(seed=seed, bf16_weights=True, vocab_size=vocab), seed + 1)
    drafts = {
        "disagrees": from_objects(draft, tokenizer, "draft"),
        "sometimes": from_objects(sometimes, tokenizer, "s"),
    }
    return target, drafts


def test_speculative_greedy_equals_target_only_exactly(tokenizer, isa):
    """No tie allowance: the verification pass computes each position's logits with the same instructions as a
    one-token step, so even a near-tie resolves the same way."""
    rules = StopConditions(max_new_tokens=24)
    target, drafts = greedy_pair(tokenizer, seed=4)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, len(tokenizer)) for _ in range(rng.randint(2, 20))] for _ in range(4)]
    prompts += [p * 3 for p in prompts[:2]]  # repetitive: prompt lookup finds matches
    accepted = {}
    for name, draft in drafts.items():
        decoder = SpeculativeDecoder(target, draft)
        assert decoder.generate(prompts[0], "none", 0, SamplingParams(), rules).token_ids  # warm
        for k in (1, 2, 4, 8):
            for prompt in prompts:
                expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules).token_ids
                for drafter in ("draft", "prompt_lookup"):
                    got = decoder.generate(prompt, drafter, k, SamplingParams(), rules)
                    assert got.token_ids == expected, f"{name} {drafter} K={k} prompt={prompt}"
                    key = (name, drafter)
                    accepted[key] = accepted.get(key, 0) + got.stats.num_accepted
    # the draft that sometimes agrees and prompt lookup had tokens accepted, so verification decided outputs
    assert accepted["sometimes", "draft"] > 0 and accepted["sometimes", "prompt_lookup"] > 0, accepted


def test_batched_greedy_equals_single_exactly(tokenizer, isa):
    rules = StopConditions(max_new_tokens=20)
    target, drafts = greedy_pair(tokenizer, seed=8)
    engine = BatchEngine(target, drafts["sometimes"], max_batch=4)
    assert engine.draft_pool is not None
    assert engine.target_pool.forward_pass.name == engine.draft_pool.forward_pass.name == "native"
    assert engine.target_pool.forward_pass.kernel == isa  # bfloat16 weights: the build's own products
    assert_batched_equals_single(engine, rules, len(tokenizer))


def assert_batched_equals_single(engine: BatchEngine, rules: StopConditions, vocab: int) -> None:
    """Four prompts decoded together with the draft, K varying per sequence and round (each its own cycle of
    1..4), give each one's target-only greedy output."""
    rng = random.Random(9)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 15))] for _ in range(4)]
    single = [engine.generate(p, "none", 0, SamplingParams(), rules).token_ids for p in prompts]
    plans = [requested("draft", 4, k_schedule=[1 + (i + r) % 4 for r in range(3 + i)]) for i in range(len(prompts))]
    sessions = [engine.open(p, SamplingParams(), rules, plan) for p, plan in zip(prompts, plans, strict=True)]
    while any(s.finish_reason is None for s in sessions):
        engine.step([s for s in sessions if s.finish_reason is None])
    assert [s.generated for s in sessions] == single
    for s in sessions:
        engine.close(s)


def assert_speculative_equals_target_only(decoder: SpeculativeDecoder, vocab: int) -> None:
    """Greedy output with the draft and with prompt lookup, K 1, 4 and 8, is target-only output token for token, on
    three random prompts and one that holds its own continuation (prompt lookup proposes it); some drafts were
    accepted (multi-row verifications decided outputs: accepted drafts, and rejected ones whose row 0 gave the
    token)."""
    rules = StopConditions(max_new_tokens=24)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    echo = prompts[0] + decoder.generate(prompts[0], "none", 0, SamplingParams(), rules).token_ids + prompts[0]
    prompts.append(echo)
    accepted, drafted = dict.fromkeys(("draft", "prompt_lookup"), 0), dict.fromkeys(("draft", "prompt_lookup"), 0)
    for prompt in prompts:
        expected = decoder.generate(prompt, "none", 0, SamplingParams(), rules).token_ids
        for drafter in accepted:
            for k in (1, 4, 8):
                got = decoder.generate(prompt, drafter, k, SamplingParams(), rules)
                assert got.token_ids == expected, f"{drafter} K={k} prompt={prompt}"
                accepted[drafter] += got.stats.num_accepted
                drafted[drafter] += got.stats.num_drafted
    assert accepted["draft"] > 0 and drafted["prompt_lookup"] > 0, (accepted, drafted)


def test_pair_panels_hold_the_weights_in_the_dot_product_order():
    weight = torch.arange(20 * 4, dtype=torch.float32).reshape(20, 4)  # 20 outputs, 4 inputs: 2 panels of 2 pairs
    panels = pack_pair_panels(weight)
    assert panels.shape == (2, 2, 16, 2) and panels.dtype == torch.bfloat16
    for q in range(2):  # pair q of a panel: (w[j][2q], w[j][2q + 1]) for its 16 outputs j
        assert torch.equal(panels[0, q].float(), weight[:16, 2 * q : 2 * q + 2])
        assert torch.equal(panels[1, q, :4].float(), weight[16:, 2 * q : 2 * q + 2])
    assert not panels[1, :, 4:].float().any()


def test_panels_hold_the_weights_in_the_kernels_order():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)  # 20 outputs: 2 panels, the second padded
    panels = pack_panels(weight, bf16=False)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, :, :], weight[:16].T)
    assert torch.equal(panels[1, :, :4], weight[16:].T) and not panels[1, :, 4:].any()
    bf16 = pack_panels(weight, bf16=True)
    assert bf16.dtype == torch.bfloat16
    # stored order 0-3, 8-11, 4-7, 12-15 (the kernel's unpacklo/unpackhi lanes)
    assert bf16[0, 1].float().tolist() == [
        weight[j, 1].item() for j in (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
    ]


def test_models_the_kernel_does_not_cover_take_the_pytorch_pass():
    why: list[str] = []
    assert NativeLlama.create(llama().double(), why) is None and "float64" in why[0]
    why.clear()
    assert NativeLlama.create(llama(head_dim=12), why) is None and "head_dim 12" in why[0]
    pool = pool_of(llama().double(), runner="auto")
    assert pool.forward_pass.name == "lean"  # falls back quietly
    with pytest.raises(ValueError, match=r"native: the native pass does not apply: .*float64"):
        pool_of(llama().double(), runner="native")
    assert pool_of(llama(), runner="lean").forward_pass.name == "lean"


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    build._status.cache_clear()
    try:
        assert build.load() is None and build.why_not() == "SPECD_NATIVE=0"
        assert pool_of(llama(), runner="auto").forward_pass.name == "lean"
    finally:
        monkeypatch.delenv(build.DISABLE_ENV)
        build._status.cache_clear()


@needs_native
def test_weights_changed_in_place_are_repacked():
    """A fused optimizer step writes the weights without moving torch's version counter; the packed copy must
    not outlive them (``specd distill`` evaluates α between steps of fused AdamW)."""
    model = llama()
    tokens = torch.arange(5)
    before = pool_of(model).open().forward(tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    after = pool_of(model).open().forward(tokens)
    expected = pool_of(model, runner="lean").open().forward(tokens)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-3)


@needs_native
def test_a_bad_token_id_is_refused_not_read():
    pool = pool_of(llama())
    seq = pool.open()
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            seq.forward(torch.tensor([3, bad]))
    assert seq.forward(torch.tensor([3, 4])).shape == (2, VOCAB)  # the sequence is still usable


@needs_native
def test_two_pools_of_one_model_keep_their_own_caches():
    """The packed weights are shared per model; each pool's cache is its own (a target that is its own draft)."""
    model = llama()
    first, second = pool_of(model, slots=1).open(), pool_of(model, slots=2).open()
    alone = pool_of(llama(), slots=1).open()  # the same weights in another model object: nothing shared
    generator = torch.Generator().manual_seed(3)
    a, b, t = (torch.randint(0, VOCAB, (n,), generator=generator) for n in (12, 7, 1))
    first.forward(a)
    second.forward(b)  # the second pool of the same model, used after the first
    alone.forward(a)
    assert torch.equal(first.forward(t), alone.forward(t))
    assert torch.equal(second.forward(t), pool_of(llama(), slots=1).open().forward(torch.cat([b, t]))[-1:])
