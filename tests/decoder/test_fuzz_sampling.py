"""Sampling parameters at the limits of the dtypes they meet (hypothesis): a request's ``temperature``,
``top_p`` and ``top_k`` arrive as JSON doubles and integers and are used against float32, bfloat16 or float16
logits, where a positive double can be 0 (``top_p: 1e-46`` must not drop every token and kill the decode loop), a
temperature can overflow the logits it divides, and ``top_k`` can exceed the vocabulary or int32.

Whatever the parameters the worker accepts, and whatever finite-or-masked logits a model gives:

- the warped distribution is finite, non-negative and sums to 1, and with the temperature alone it is softmax(x / T)
  computed in float64;
- a row with +inf entries (a float16 model's overflow) draws among those alone, alike;
- a token the model masked (-inf) never gets mass, and one of the most likely tokens always keeps some;
- a more likely token never gets less mass than a less likely one (the masks keep a prefix of the sorted order);
- a drawn token, and the token rejection sampling emits after a draft from other logits, has mass under the target.

Pure functions on the CPU, so it runs a few hundred examples in seconds; the worker's HTTP fuzz
(tests/worker/test_fuzz_http.py) sends the same limits through the real decode loop.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from decoder.acceptance import rejection_sample
from decoder.sampling import GREEDY_BELOW, SamplingParams, logits_to_probs, sample
from tests.fuzzing import DTYPE_LIMITS, fuzz_settings

# The values where a double's meaning changes on its way to a tensor (tests/fuzzing.py), and the greedy threshold's
DTYPE_EDGES = [*DTYPE_LIMITS, GREEDY_BELOW, math.nextafter(GREEDY_BELOW, 0), math.nextafter(GREEDY_BELOW, 1)]
MAX_TEMPERATURE = 2.0  # the worker's bound (decoder/worker/openai_api.py)
temperatures = st.sampled_from([0.0, *(v for v in DTYPE_EDGES if v <= MAX_TEMPERATURE)]) | st.floats(0, MAX_TEMPERATURE)
top_ps = st.sampled_from([1.0, *(v for v in DTYPE_EDGES if v <= 1)]) | st.floats(0, 1, exclude_min=True)
top_ks = st.sampled_from([0, 1, 2, 2**31 - 1, 2**63 - 1]) | st.integers(0, 40)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def logit_rows(draw: st.DrawFn) -> torch.Tensor:
    """[n, vocab] logits in one dtype: spreads from ties to the dtype's range, some entries masked to -inf (never a
    whole row: a model always leaves a token)."""
    dtype = draw(st.sampled_from(DTYPES))
    n, vocab = draw(st.integers(1, 3)), draw(st.integers(2, 40))
    largest = torch.finfo(dtype).max
    scale = draw(st.sampled_from([0.0, 1e-6, 1.0, 30.0, 1e4, largest / 4]))
    seed = draw(st.integers(0, 2**32 - 1))
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale).clamp(-largest, largest)
    masked = torch.rand(n, vocab, generator=torch.Generator().manual_seed(seed + 1)) < draw(st.sampled_from([0, 0.5]))
    masked[:, draw(st.integers(0, vocab - 1))] = False
    logits = logits.masked_fill(masked, -math.inf)
    if draw(st.integers(0, 7)) == 0:  # a float16 model's overflow: some entries +inf
        overflowed = torch.rand(n, vocab, generator=torch.Generator().manual_seed(seed + 2)) < 0.2
        overflowed[:, draw(st.integers(0, vocab - 1))] = True
        logits = logits.masked_fill(overflowed, math.inf)
    return logits.to(dtype)


def params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def check_distribution(logits: torch.Tensor, probs: torch.Tensor, sampling: SamplingParams) -> None:
    wide = logits.float()
    assert probs.dtype == torch.float32 and probs.shape == wide.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]), atol=1e-4, rtol=0)
    assert (probs[wide == -math.inf] == 0).all(), "a masked token got mass"
    for row, p in zip(wide, probs, strict=True):
        infinite = torch.isposinf(row)
        if infinite.any():  # the row's limit: its +inf tokens alone, alike (top-k and top-p may keep fewer of them)
            kept = p[p > 0]
            assert infinite[p > 0].all() and torch.allclose(kept, kept[0].expand_as(kept)), (row, p)
            continue
        check_finite_row(row, p, sampling)


def check_finite_row(row: torch.Tensor, p: torch.Tensor, sampling: SamplingParams) -> None:
    # "most likely" is after the temperature: two logits a few ulps apart can round to one value over it (a tie)
    scaled = row if sampling.is_greedy else (row - row.amax()) / sampling.temperature
    assert (p[scaled == scaled.amax()] > 0).any(), "every most likely token lost its mass"
    # more likely -> at least as much mass: for every pair (i, j) with scaled_i > scaled_j, p_i >= p_j
    assert not ((scaled.unsqueeze(-1) > scaled.unsqueeze(-2)) & (p.unsqueeze(-1) < p.unsqueeze(-2))).any(), (row, p)
    if not sampling.is_greedy and not sampling.top_k and sampling.top_p == 1.0:  # the warping is the temperature alone
        reference = torch.softmax(row.double() / sampling.temperature, dim=-1)  # in float64, unshifted
        torch.testing.assert_close(p.double(), reference, atol=1e-5, rtol=1e-4)


@given(logits=logit_rows(), temperature=temperatures, top_k=top_ks, top_p=top_ps, seed=st.integers(0, 2**63 - 1))
@example(logits=torch.tensor([[0.0, 1.0, 2.0]]), temperature=1.0, top_k=0, top_p=1e-46, seed=0)  # 0 in float32
@example(logits=torch.tensor([[0.0, 1.0, 2.0]]), temperature=GREEDY_BELOW, top_k=0, top_p=1.0, seed=0)
@example(logits=torch.tensor([[-3e38, 3e38, 0.0]]), temperature=GREEDY_BELOW, top_k=2, top_p=0.5, seed=0)
@example(logits=torch.tensor([[0.0, 1.0, math.log(3.0) + 1]]), temperature=0.5, top_k=0, top_p=1.0, seed=0)
@example(logits=torch.tensor([[1.0, math.inf, 0.0, math.inf]]), temperature=0.7, top_k=0, top_p=1.0, seed=0)
@fuzz_settings(400)
def test_any_accepted_parameters_give_a_distribution_and_a_token_it_allows(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int
):
    sampling = params(temperature, top_k, top_p)
    warped = logits_to_probs(logits, sampling)
    check_distribution(logits, warped, sampling)
    drawn = sample(warped, torch.Generator().manual_seed(seed))
    assert (warped.gather(-1, drawn.unsqueeze(-1)) > 0).all(), (warped, drawn)


@given(target=logit_rows(), draft_seed=st.integers(0, 2**32 - 1), temperature=temperatures, top_k=top_ks,
       top_p=top_ps, one_hot=st.booleans(), seed=st.integers(0, 2**63 - 1))  # fmt: skip
@fuzz_settings(300)
def test_rejection_sampling_emits_a_token_the_target_allows(
    target: torch.Tensor, draft_seed: int, temperature: float, top_k: int, top_p: float, one_hot: bool, seed: int
):
    """K = rows - 1 drafts from other logits under the same warping (or a deterministic drafter's one-hot q): the
    emitted token has mass under the target's distribution at its position, and the count kept is within 0..K."""
    sampling = params(temperature, top_k, top_p)
    p = logits_to_probs(target, sampling)
    k = p.shape[0] - 1
    generator = torch.Generator().manual_seed(seed)
    other = torch.randn(max(k, 1), p.shape[1], generator=torch.Generator().manual_seed(draft_seed)) * 10
    q = logits_to_probs(other.to(target.dtype), sampling)[:k]
    draft_tokens = sample(q, generator) if k else torch.zeros(0, dtype=torch.int64)
    verdict = rejection_sample(draft_tokens, None if one_hot else q, p, generator)
    assert 0 <= verdict.num_accepted <= k
    assert p[verdict.num_accepted, verdict.next_token] > 0, (p, verdict)
