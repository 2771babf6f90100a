"""The ``eagle`` drafter (decoder/drafters/eagle.py) over a tiny Llama and a random EAGLE-3 head.

- Exact: greedy output with ``eagle`` equals target-only on every pass that hands states (native, lean, invariant,
  transformers), alone and in a batch; a head trained on the target's own text drafts tokens it accepts.
- The head's incremental cache drafts what a fresh head fed every state at once drafts, round after round (the
  states the verification passes hand are the right ones, and rollback drops exactly the drafted entries).
- Its folder (speculators layout) round-trips, and a head for another target is refused by name and by size.
"""

from __future__ import annotations

import json

import pytest
import torch

import decoder.drafters.eagle as eagle
from decoder.batch_engine import BatchEngine
from decoder.drafters.eagle import EagleDrafter
from decoder.engine import SpeculativeDecoder
from decoder.heads import EagleHead, HeadShape, LoadedHead, load_head, save_head
from decoder.models import LoadedModel, from_objects
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.runners.base import FeatureTap
from decoder.sampling import SamplingParams
from decoder.tiny import build_model
from specd_api.errors import ModelLoadError
from tests.decoder.distribution import PROMPT as SMALL_PROMPT
from tests.decoder.distribution import (
    REJECT_BELOW,
    chi_square_pvalue,
    exact_after_first,
    small_vocab_lm,
    small_vocab_tokenizer,
)
from tests.decoder.distribution import VOCAB as SMALL

VOCAB = 48
PASSES = ("native", "lean", "invariant", "transformers")
PROMPT = [3, 7, 1, 9, 4, 11, 2, 5, 3, 7, 1]


def words() -> object:
    """Token i is the word "t{i}"."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))


def target(runner: str = "lean", name: str = "tiny-target") -> LoadedModel:
    model = build_model("llama", VOCAB, seed=11, hidden=64, layers=4).eval()
    loaded = from_objects(model, words(), f"models/{name}", runner=runner)
    if runner == "native" and KVPool(loaded, 1).forward_pass.name != "native":
        pytest.skip("the native pass does not run here (no gcc or no AVX2)")
    return loaded


def random_head(seed: int = 0, draft_vocab: int = 32, norm_before_residual: bool = False) -> LoadedHead:
    shape = HeadShape(
        hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=VOCAB, draft_vocab=draft_vocab,
        target_hidden=64, aux_layers=(0, 2, 3), norm_before_residual=norm_before_residual,
    )  # fmt: skip
    torch.manual_seed(seed)
    head = EagleHead(shape)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
        ids = torch.randperm(VOCAB)[:draft_vocab].sort().values  # the draft vocabulary: target ids, ascending
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    return LoadedHead(head.eval(), "models/tiny-target", "random")


def rules(n: int = 24) -> StopConditions:
    return StopConditions(max_new_tokens=n)


@pytest.mark.parametrize("runner", PASSES)
def test_greedy_eagle_equals_target_only(runner):
    lm = target(runner)
    decoder = SpeculativeDecoder(lm, head=random_head())
    plain = decoder.generate(PROMPT, "none", 0, SamplingParams(), rules())
    for k in (1, 3, 5):
        spec = decoder.generate(PROMPT, "eagle", k, SamplingParams(), rules())
        assert spec.token_ids == plain.token_ids, (runner, k)
        assert spec.stats.num_drafted > 0


def test_a_batch_of_eagle_sequences_equals_each_alone():
    lm = target("native")
    engine = BatchEngine(lm, max_batch=3, head=random_head())
    prompts = [PROMPT, PROMPT[:5], [9, 9, 4, 2, 7, 30, 31, 2]]
    alone = [engine.generate(p, "none", 0, SamplingParams(), rules()).token_ids for p in prompts]
    from specd_api.plan import requested

    sessions = [engine.open(p, SamplingParams(), rules(), requested("eagle", 4)) for p in prompts]
    while any(s.finish_reason is None for s in sessions):
        engine.step([s for s in sessions if s.finish_reason is None])
    assert [s.generated for s in sessions] == alone
    for s in sessions:
        engine.close(s)


def fresh_draft(lm: LoadedModel, head: LoadedHead, context: torch.Tensor, k: int) -> list[int]:
    """What a head that has seen nothing drafts after ``context``, given the states of all but its last token."""
    tap = FeatureTap(head.shape.aux_layers)
    with torch.inference_mode():
        KVPool(lm, 1).open().forward(context[:-1], tap=tap)
    drafter = EagleDrafter(head, SamplingParams(), None)
    assert tap.rows is not None
    drafter.observe(tap.rows[0])
    return drafter.propose(context, k).tokens.tolist()


@pytest.mark.parametrize("runner", ("native", "transformers"))
def test_each_round_drafts_what_a_fresh_head_drafts(runner):
    lm = target(runner)
    head = random_head(seed=3)
    decoder = SpeculativeDecoder(lm, head=head)
    from specd_api.plan import requested

    session = decoder.session(PROMPT, SamplingParams(), rules(30), requested("eagle", 4))
    session.prefill()
    rounds = 0
    while session.finish_reason is None:
        expected = fresh_draft(lm, head, session.context, 4)
        drafted = session.drafter.propose(session.context, 4).tokens.tolist()
        assert drafted == expected, f"round {rounds}"
        session.drafter.rollback(session.context)  # the probe's drafted entries go, as a verified round's do
        session.step()
        rounds += 1
    assert rounds > 3


def test_the_head_folder_round_trips_and_refuses_another_target(tmp_path):
    lm = target("lean")
    head = random_head(seed=5)
    save_head(head.head, tmp_path / "head", "models/tiny-target", ["LlamaForCausalLM"])
    loaded = load_head(tmp_path / "head", lm)
    context = torch.tensor(PROMPT)
    assert fresh_draft(lm, loaded, context, 5) == fresh_draft(lm, bf16_rounded(head), context, 5)

    with pytest.raises(ModelLoadError, match=r"verifier.name_or_path: the head was trained for 'models/tiny-target'"):
        load_head(tmp_path / "head", target("lean", name="another"))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["target_hidden_size"] = 128
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"field target_hidden_size: the head has 128, the target .* 64"):
        load_head(tmp_path / "head", lm)
    config["speculators_config"]["algorithm"] = "medusa"
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"speculators_config.algorithm: 'medusa' is not 'eagle3'"):
        load_head(tmp_path / "head", lm)


def bf16_rounded(loaded: LoadedHead) -> LoadedHead:
    """The head as its folder stores it: weights rounded to bfloat16, computed in float32."""
    head = EagleHead(loaded.shape)
    head.load_state_dict({n: v.bfloat16().float() if v.is_floating_point() else v
                          for n, v in loaded.head.state_dict().items()})  # fmt: skip
    return LoadedHead(head.eval(), loaded.verifier, loaded.name)


# -- sampled: the target's distribution, whatever the head drafts ------------------------------------------------


def small_vocab_head() -> LoadedHead:
    """A random head over distribution.py's 6-token target (2 layers): it drafts 5 of the 6 tokens, so q is 0 on one
    token the target may still emit."""
    shape = HeadShape(hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=SMALL, draft_vocab=SMALL - 1,
                      target_hidden=64, aux_layers=(0, 1, 1))  # fmt: skip
    torch.manual_seed(7)
    head = EagleHead(shape).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
        ids = torch.tensor([0, 1, 2, 4, 5])
        head.d2t.copy_(ids - torch.arange(SMALL - 1))
        head.t2d.zero_()
        head.t2d[ids] = True
    return LoadedHead(head.eval(), "target", "random")


def sampled_after_first(decoder: SpeculativeDecoder, samples: int = 1000) -> list[tuple[int, ...]]:
    rules = StopConditions(max_new_tokens=4)
    return [
        tuple(decoder.generate(list(SMALL_PROMPT), "eagle", 3, SamplingParams(temperature=1.0, seed=s), rules)
              .token_ids[1:3])
        for s in range(samples)
    ]  # fmt: skip


def test_sampled_eagle_keeps_the_targets_distribution():
    small = small_vocab_lm(small_vocab_tokenizer(), 0, "target")
    decoder = SpeculativeDecoder(small, head=small_vocab_head())
    exact = exact_after_first(small, SMALL_PROMPT, SamplingParams(temperature=1.0), 2)
    pvalue = chi_square_pvalue(sampled_after_first(decoder), exact)
    assert pvalue > REJECT_BELOW, f"eagle's samples do not follow the target's distribution (p = {pvalue:.2e})"


def test_a_head_whose_q_is_off_by_one_id_is_detected(monkeypatch):
    # q carried one id off the tokens it was drawn from (a draft-to-target id mapping applied to the token only):
    # rejection sampling then accepts by the wrong ratio. (A q dropped altogether, one-hot, stays exact.)
    real = eagle.pick_token

    def shifted(*args, **kwargs):
        token, q = real(*args, **kwargs)  # type: ignore[misc]
        return token, q.roll(1, dims=-1)

    monkeypatch.setattr(eagle, "pick_token", shifted)
    small = small_vocab_lm(small_vocab_tokenizer(), 0, "target")
    decoder = SpeculativeDecoder(small, head=small_vocab_head())
    exact = exact_after_first(small, SMALL_PROMPT, SamplingParams(temperature=1.0), 2)
    pvalue = chi_square_pvalue(sampled_after_first(decoder), exact)
    assert pvalue < REJECT_BELOW, f"the test cannot tell a q one id off (p = {pvalue:.2e})"


# -- the native kernel's head against PyTorch's ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "norm_first"), [(False, False), (True, False), (False, True)],
    ids=["float32-weights", "bf16-weights", "norm-before-residual"],
)  # fmt: skip
def test_the_native_head_computes_what_pytorch_computes(stored, norm_first):
    from decoder.heads.runner import NativeHead, NativeRunner, TorchRunner
    from decoder.native import build

    head = random_head(seed=9, norm_before_residual=norm_first).head
    if stored:
        head = bf16_rounded(LoadedHead(head, "", "")).head
    native = NativeHead.create(head)
    if native is None:
        pytest.skip(f"the native kernel does not run here: {build.why_not() or 'not covered'}")
    dot_products = stored and build.selected_isa() == "avx512bf16"  # inputs rounded to bfloat16 by the products
    tolerance = 5e-2 if dot_products else 1e-4
    torch.manual_seed(1)
    features = torch.randn(12, head.shape.features)
    tokens = torch.randint(0, VOCAB, (12,))
    runners = [NativeRunner(native), TorchRunner(head)]
    with torch.inference_mode():
        outs = [r.feed(features[:9], tokens[:9]) for r in runners]
        for step in range(3):
            torch.testing.assert_close(outs[0][0], outs[1][0], rtol=tolerance, atol=tolerance, msg=f"out {step}")
            torch.testing.assert_close(outs[0][1], outs[1][1], rtol=tolerance, atol=tolerance, msg=f"logits {step}")
            outs = [r.step(out, tokens[9 + step : 10 + step]) for r, (out, _) in zip(runners, outs, strict=True)]
        for r in runners:  # a rollback, then entries fed again from the target's states
            r.truncate(4)
        again = [r.feed(features[4:12], tokens[4:12]) for r in runners]
    assert runners[0].length == runners[1].length == 12
    torch.testing.assert_close(again[0][1], again[1][1], rtol=tolerance, atol=tolerance)


def test_a_head_trained_in_place_is_packed_again():
    from decoder.heads.runner import NativeRunner, TorchRunner, runner_for

    head = random_head(seed=2).head
    if not isinstance(runner_for(head), NativeRunner):
        pytest.skip("the native kernel does not run here")
    features, tokens = torch.randn(5, head.shape.features), torch.randint(0, VOCAB, (5,))
    with torch.no_grad():
        head.lm_head.weight.mul_(-2.0)  # as an optimizer step does: in place
    with torch.inference_mode():
        _, native = runner_for(head).feed(features, tokens)
        _, reference = TorchRunner(head).feed(features, tokens)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)


def test_a_head_on_a_pass_without_states_is_refused_by_name():
    lm = from_objects(target("lean").model, words(), "models/tiny-target", runner="graphs")
    with pytest.raises(ModelLoadError, match="the target's graphs pass hands no hidden states"):
        SpeculativeDecoder(lm, head=random_head())


def test_the_native_heads_cache_grows_past_its_first_capacity():
    from decoder.heads.runner import NativeRunner, TorchRunner, runner_for
    from decoder.runners.kv import INITIAL_CAPACITY

    head = random_head(seed=4).head
    native = runner_for(head)
    if not isinstance(native, NativeRunner):
        pytest.skip("the native kernel does not run here")
    torch.manual_seed(2)
    n = INITIAL_CAPACITY + 40
    features, tokens = torch.randn(n, head.shape.features), torch.randint(0, VOCAB, (n,))
    reference = TorchRunner(head)
    with torch.inference_mode():
        for runner in (native, reference):
            runner.feed(features[:200], tokens[:200])
        outs = [runner.feed(features[200:], tokens[200:]) for runner in (native, reference)]  # past 256 entries
    assert native.length == n and native.cache.capacity >= n
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)
