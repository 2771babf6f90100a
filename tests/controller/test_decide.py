"""decide() as a table: each row is a situation and the plan it must produce, with why."""

from __future__ import annotations

import random

import pytest

from controller.decision.cost_model import BucketCosts
from controller.decision.counts import PositionCounts, SegmentCounts
from controller.decision.decide import (
    DrafterEstimate,
    Request,
    SharedDraws,
    best_arm,
    beta_draw,
    beta_mean,
    decide,
    deliberate,
    estimate_drafter,
    mean_arm,
)
from controller.decision.policy import Settings, SettingsOverride, apply_override
from specd_api.plan import Plan
from specd_api.speedup import speedup_curve

BOTH = ("draft", "prompt_lookup")
N = 1e6  # so many observations that the prior does not matter
GPU = BucketCosts(1, 0.01, verify=tuple(1.0 + 0.02 * n for n in range(65)))  # v(n) = 1 + 0.02 n
# v(n) as measured on a CPU in float32 (relative to v(0)): dear at 1-3 drafts, cheap again at 4, dear beyond.
CPU = BucketCosts(1, 0.0045, verify=(1.0, 1.39, 1.71, 1.58, 1.21, *(1.9 + 0.4 * i for i in range(60))))


def counts(served: bool = True, **rates: tuple[float, float]) -> SegmentCounts:
    """Counts where drafter d has conditional acceptance a and proposal rate π at every position."""
    c = SegmentCounts()
    table = c.positions if served else c.counterfactual
    for drafter, (a, pi) in rates.items():
        for i in range(16):
            table[(drafter, i)] = PositionCounts(offered=N, proposed=pi * N, verified=pi * N, accepted=a * pi * N)
    return c


def run(
    seg: SegmentCounts,
    settings: Settings | None = None,
    previous: Plan | None = None,
    seed: int = 0,
    c_draft: float = 0.05,
    costs: BucketCosts = GPU,
    **request: object,
) -> Plan:
    settings = settings or Settings(exploration_rate=0.0)
    req = Request(**{"segment": "s", "batch_size": 1, "drafters": BOTH, "max_new_tokens": 128, **request})  # type: ignore[arg-type]
    estimates = {
        d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.5, 0.5, settings.prior_strength, c)
        for d, c in (("draft", c_draft), ("prompt_lookup", 0.0))
    }
    return decide(settings, "v1", req, estimates, costs, previous, random.Random(seed))


def with_(**changes: object) -> Settings:
    return apply_override(Settings(exploration_rate=0.0), SettingsOverride(**changes))  # type: ignore[arg-type]


GOOD_DRAFT = counts(draft=(0.9, 1.0), prompt_lookup=(0.3, 0.3))


@pytest.mark.parametrize(
    ("kwargs", "drafter", "reason", "why"),
    [
        ({"batch_size": 9}, "none", "batch_size_above_threshold", "default threshold 8: batch 9 is off"),
        ({"batch_size": 8}, "draft", "best_expected_speedup", "batch 8 is still on"),
        ({"settings": with_(force="none")}, "none", "policy_off", "the policy switches the segment off"),
        ({"settings": with_(force="prompt_lookup", force_k=3)}, "prompt_lookup", "policy_forced", "forced drafter"),
        ({"drafters": ()}, "none", "no_drafter_available", "the worker has no drafter"),
        ({"drafters": ("prompt_lookup",)}, "prompt_lookup", "best_expected_speedup", "only what the worker has"),
        ({"max_new_tokens": 3}, "none", "request_too_short", "below min_new_tokens (4)"),
        ({"settings": with_(drafters={"draft": {"enabled": False}})}, "prompt_lookup", "best_expected_speedup",
         "a disabled drafter is never chosen"),
    ],
)  # fmt: skip
def test_rules(kwargs, drafter, reason, why):
    plan = run(GOOD_DRAFT, **kwargs)
    assert (plan.drafter, plan.reason) == (drafter, reason), why
    assert plan.policy_version == "v1"


def test_forced_k_is_used_and_not_adapted():
    plan = run(GOOD_DRAFT, settings=with_(force="prompt_lookup", force_k=3))
    assert plan.k == 3 and not plan.adaptive  # every round at 3


@pytest.mark.parametrize(
    ("seg", "c_draft", "drafter", "reason", "why"),
    [
        (counts(draft=(0.9, 1.0), prompt_lookup=(0.3, 0.3)), 0.05, "draft", "best_expected_speedup", "high α draft"),
        (counts(draft=(0.5, 1.0), prompt_lookup=(0.95, 0.9)), 0.05, "prompt_lookup", "best_expected_speedup",
         "extractive: lookup proposes and is accepted, at no drafting cost"),
        (counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05)), 0.05, "none", "low_expected_speedup",
         "nothing agrees with the target: off"),
        (counts(draft=(0.45, 1.0), prompt_lookup=(0.05, 0.05)), 0.05, "draft", "best_expected_speedup",
         "α 0.45 pays with c = 0.05 (about 1.3x at K = 2): no α floor may veto an arm that clears min_speedup"),
        (counts(draft=(0.45, 1.0), prompt_lookup=(0.05, 0.05)), 0.4, "none", "low_expected_speedup",
         "the same α with a draft 8x dearer does not pay: the costs decide"),
        (counts(False, prompt_lookup=(0.95, 0.9)), 0.05, "prompt_lookup", "best_expected_speedup",
         "prompt lookup never served here, but its counterfactual record is enough"),
    ],
)  # fmt: skip
def test_learned_choice(seg, c_draft, drafter, reason, why):
    plan = run(seg, c_draft=c_draft)
    assert (plan.drafter, plan.reason) == (drafter, reason), why


def test_best_k_grows_with_alpha():
    ks = [
        run(counts(draft=(a, 1.0), prompt_lookup=(0.0, 0.0)), settings=with_(k_headroom=0)).k for a in (0.6, 0.8, 0.95)
    ]
    assert ks == sorted(ks) and ks[0] < ks[-1], ks


def test_the_best_k_follows_the_measured_verify_costs():
    # On the CPU's v(n) a 0.8 draft with c 0.1 is best at K = 4 (v(4) = 1.21 is cheaper than v(2) = 1.71), not at
    # the largest K allowed, and not where a line through v(n) would put it.
    seg = counts(draft=(0.8, 1.0), prompt_lookup=(0.0, 0.0))
    plan = run(seg, c_draft=0.1, costs=CPU, settings=with_(k_headroom=0))
    curve = speedup_curve([0.8] * 8, [1.0] * 8, 8, 0.1, CPU.verify)
    assert plan.k == 4 == 1 + max(range(8), key=lambda i: curve[i])
    assert plan.expected_speedup == pytest.approx(curve[3], rel=1e-3)


def test_the_plan_carries_what_the_worker_adapts_with():
    plan = run(GOOD_DRAFT, costs=CPU, c_draft=0.1)
    assert plan.adaptive and plan.k <= 8
    assert len(plan.acceptance) == len(plan.proposal) == plan.k and len(plan.verify_cost) == plan.k + 1
    assert plan.acceptance[0] == pytest.approx(0.9, abs=1e-3) and plan.verify_cost == CPU.verify[: plan.k + 1]
    assert plan.cost_ratio == 0.1 and plan.prior_strength == Settings().plan_prior_rounds
    lookup_k = Settings().drafter("prompt_lookup").k_max
    assert plan.counterfactual_ceiling("prompt_lookup") == lookup_k  # lookup is scored on every round


def test_the_ceiling_leaves_headroom_above_the_best_k():
    tight = run(GOOD_DRAFT, costs=CPU, settings=with_(k_headroom=0))
    roomy = run(GOOD_DRAFT, costs=CPU, settings=with_(k_headroom=2))
    assert roomy.k == min(tight.k + 2, 8) and roomy.expected_speedup == tight.expected_speedup


def test_off_plans_still_score_prompt_lookup():
    plan = run(counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05)))
    assert plan.drafter == "none" and plan.counterfactual_ceiling("prompt_lookup") > 0
    assert run(GOOD_DRAFT, settings=with_(counterfactual=False)).counterfactual_ceiling("prompt_lookup") == 0
    assert run(GOOD_DRAFT, drafters=("draft",)).counterfactual_ceiling("prompt_lookup") == 0  # the worker cannot run it


def test_expected_speedup_is_reported():
    assert run(GOOD_DRAFT).expected_speedup > 2.0  # α 0.9, c 0.05: several tokens per round


def test_hysteresis_keeps_a_nearly_as_good_previous_drafter():
    # lookup at 0.91 x 0.88 is 3.6% better than a free 0.9 draft (5.47x vs 5.28x), within the 5% margin: a
    # segment that has been served by either stays with it
    seg = counts(draft=(0.9, 1.0), prompt_lookup=(0.91, 0.88))
    best = run(seg, c_draft=0.0)
    other = "prompt_lookup" if best.drafter == "draft" else "draft"
    plan = run(seg, c_draft=0.0, previous=Plan(other, 4, "best_expected_speedup", "v1"))
    assert (plan.drafter, plan.reason) == (other, "kept_previous")


def test_hysteresis_switches_when_the_gain_is_large():
    previous = Plan("prompt_lookup", 2, "best_expected_speedup", "v1")
    assert run(GOOD_DRAFT, previous=previous).drafter == "draft"


def test_switched_off_segment_needs_the_margin_to_come_back():
    # α 0.55, c 0.42: K = 1 gives 1.55 / (0.42 + 1.02) = 1.076, above 1.05 but below 1.05 x 1.05
    seg = counts(draft=(0.55, 1.0), prompt_lookup=(0.0, 0.0))
    fresh = run(seg, c_draft=0.42)
    assert fresh.drafter == "draft" and 1.05 <= fresh.expected_speedup < 1.05 * 1.05, fresh
    was_off = Plan("none", 0, "low_expected_speedup", "v1")
    assert run(seg, c_draft=0.42, previous=was_off).reason == "low_expected_speedup"


def test_a_sure_segment_is_probed_only_at_the_floor():
    # A million rounds say the draft is hopeless here: no posterior draw disagrees, so only the floor for
    # switched-off segments probes (2% of requests), so that a change of traffic can still be seen.
    seg = counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05))
    plans = [run(seg, settings=with_(exploration_rate=0.5), seed=s) for s in range(2000)]
    probes = [p for p in plans if p.exploration]
    assert 0.02 * 2000 - 3 * (2000 * 0.02) ** 0.5 <= len(probes) <= 0.02 * 2000 + 3 * (2000 * 0.02) ** 0.5
    assert not any(
        p.exploration for p in (run(seg, settings=with_(min_exploration_rate=0), seed=s) for s in range(300))
    )
    # prompt lookup is scored on every round, so it is never probed: its rate is known for free
    assert all(p.drafter == "draft" for p in probes)
    lookup_only = {"drafters": ("prompt_lookup",)}
    assert not any(
        run(seg, settings=with_(exploration_rate=0.5), seed=s, **lookup_only).exploration for s in range(500)
    )
    unscored = with_(exploration_rate=0.5, counterfactual=False)  # not scored: it has to be probed
    assert any(run(seg, settings=unscored, seed=s, **lookup_only).exploration for s in range(500))


def test_an_uncertain_segment_is_probed_at_k_max_within_the_cap():
    # No data: the prior (α 0.5 over 20 pseudo-counts) leaves the draft's speedup uncertain around 1; Thompson
    # draws disagree with "off" often, and at most exploration_rate of requests probe.
    settings = with_(exploration_rate=0.1)
    plans = [run(SegmentCounts(), settings=settings, seed=s, c_draft=0.4, drafters=("draft",)) for s in range(2000)]
    probes = [p for p in plans if p.exploration]
    assert plans[0].reason in ("low_expected_speedup", "exploration", "best_expected_speedup")
    assert 0 < len(probes) <= 0.1 * 2000 + 3 * (2000 * 0.1 * 0.9) ** 0.5
    assert all(p.reason == "exploration" and p.drafter == "draft" for p in probes)
    assert all(p.k == settings.drafter("draft").k_max and p.probe_rounds == settings.probe_rounds for p in probes)


class CountingRandom(random.Random):
    """A seeded random.Random that counts the Beta draws made from it (a posterior draw makes one per position)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.betas = 0

    def betavariate(self, alpha: float, beta: float) -> float:
        self.betas += 1
        return super().betavariate(alpha, beta)


def test_a_decision_draws_the_posterior_only_when_it_may_probe():
    # An uncertain segment (no data): a request probes only within exploration_rate, so the other requests need no
    # posterior draw at all. Drawing it on every Decide would be half a Decide's work.
    settings = with_(exploration_rate=0.1, min_exploration_rate=0.0)
    req = Request("s", 1, ("draft",), 128)
    estimates = {"draft": estimate_drafter(SegmentCounts(), "draft", 8, 0.5, 0.5, settings.prior_strength, 0.4)}
    deliberation = deliberate(settings, "v1", req, estimates, GPU, None)
    assert deliberation.may_probe
    drew = probed = 0
    for seed in range(2000):
        rng = CountingRandom(seed)
        probed += deliberation.draw(rng).exploration
        drew += rng.betas > 0
    assert 0 < probed <= drew, (probed, drew)
    assert drew <= 0.1 * 2000 + 3 * (2000 * 0.1 * 0.9) ** 0.5, drew  # about exploration_rate of them, not all


def test_a_tables_buckets_share_their_draws_and_each_probes_at_its_own_rate(monkeypatch: pytest.MonkeyPatch):
    """A decision table's batch buckets share each decision's exploration gate and posterior draws (common random
    numbers, ``SharedDraws``): the posteriors are drawn once per decision, not once per bucket, and each bucket
    still probes at the rate its own independent draws give (the shares stay unbiased)."""
    settings = with_(exploration_rate=0.3, min_exploration_rate=0.0)
    estimates = {
        d: estimate_drafter(SegmentCounts(), d, 8, 0.5, 0.5, settings.prior_strength, 0.4)
        for d in ("draft", "prompt_lookup")
    }  # fmt: skip
    buckets = [deliberate(settings, "v1", Request("s", b, ("draft", "prompt_lookup"), 128), estimates, GPU, None)
               for b in (1, 2, 4)]  # fmt: skip
    assert all(d.may_probe for d in buckets)
    sampled = []
    sample = DrafterEstimate.sample
    monkeypatch.setattr(DrafterEstimate, "sample", lambda self, rng: sampled.append(self.drafter) or sample(self, rng))
    draws, tables = 64, 40
    shared_probes, own_probes = [0] * len(buckets), [0] * len(buckets)
    for table in range(tables):  # each bucket's probe rate, with the table's shared draws and with its own
        shared = SharedDraws(random.Random(table), draws)
        for b, deliberation in enumerate(buckets):
            rng, own = random.Random(f"{table}|{b}"), random.Random(f"own|{table}|{b}")
            for index in range(draws):
                shared_probes[b] += deliberation.draw(rng, (shared, index)).exploration
                own_probes[b] += deliberation.draw(own).exploration
    sampled.clear()  # one table: each drafter's posterior sampled at most once per decision, whatever the buckets
    shared = SharedDraws(random.Random(0), draws)
    for b, deliberation in enumerate(buckets):
        for index in range(draws):
            deliberation.draw(random.Random(f"{b}|{index}"), (shared, index))
    assert 0 < len(sampled) <= draws * len(estimates), len(sampled)
    drawn = len(sampled)
    for b, deliberation in enumerate(buckets):
        for index in range(draws):
            deliberation.draw(random.Random(f"again|{b}|{index}"), (shared, index))
    assert len(sampled) == drawn, "every decision's posterior draws were made already"
    n = draws * tables
    for b in range(len(buckets)):
        p = own_probes[b] / n
        assert 0.02 < p < 0.98, p
        assert abs(shared_probes[b] / n - p) < 5 * (2 * p * (1 - p) / n) ** 0.5, (b, shared_probes[b] / n, p)


def test_shared_draws_are_kept_per_posterior_not_per_drafter():
    """A table's shared draw of a drafter serves only the posterior it was drawn from: another posterior of the same
    drafter (a bucket whose estimate differed) gets its own draw, from its own distribution."""
    high = estimate_drafter(counts(draft=(0.95, 1.0)), "draft", 4, 0.5, 0.5, 20.0, 0.05)
    low = estimate_drafter(counts(draft=(0.05, 1.0)), "draft", 4, 0.5, 0.5, 20.0, 0.05)
    shared = SharedDraws(random.Random(0), 8)
    for index in range(8):
        assert min(shared.rates(index, high)[0]) > 0.5 and max(shared.rates(index, low)[0]) < 0.5
        assert shared.rates(index, high) is shared.rates(index, high)


def test_the_mean_arm_is_kept_per_verify_table():
    # The exploit arm is kept on the (cached) estimate, keyed by what it reads besides it: the K bounds and the
    # verify table. The same estimate under another cost model (a refresh moved v(n)) gets that model's arm.
    estimate = estimate_drafter(counts(draft=(0.9, 1.0)), "draft", 8, 0.5, 0.5, 20.0, 0.05)
    for costs, bounds in ((GPU, (1, 8)), (CPU, (1, 8)), (GPU, (1, 8)), (GPU, (2, 3)), (CPU, (1, 8))):
        assert mean_arm(estimate, *bounds, costs) == best_arm(estimate, estimate.means(), *bounds, costs)
    assert mean_arm(estimate, 1, 8, GPU).k != mean_arm(estimate, 1, 8, CPU).k  # the tables disagree on K here


def test_no_exploration_when_the_rate_is_zero():
    assert not any(run(SegmentCounts(), seed=s, c_draft=0.4).exploration for s in range(300))
    off = counts(draft=(0.1, 1.0), prompt_lookup=(0.05, 0.05))
    assert not any(run(off, seed=s, settings=with_(min_exploration_rate=0.5)).exploration for s in range(300))


def test_long_prompt_short_answer_does_not_repay_a_draft_prefill():
    seg = counts(draft=(0.7, 1.0), prompt_lookup=(0.0, 0.0))
    # 20,000 prompt tokens x c 0.05 x 0.02 = 20 steps of draft prefill; 8 new tokens save fewer than that
    assert run(seg, max_new_tokens=8, prompt_tokens=20_000, drafters=("draft",)).reason == "request_too_short"
    assert run(seg, max_new_tokens=8, prompt_tokens=100, drafters=("draft",)).drafter == "draft"


def test_k_never_exceeds_what_the_request_can_use():
    assert run(GOOD_DRAFT, max_new_tokens=5).k <= 4


def test_prior_decides_for_an_unseen_segment():
    # no data at all: prior α 0.5 per position, c 0.05 -> a short draft still pays
    plan = run(SegmentCounts(), drafters=("draft",))
    assert plan.drafter == "draft" and plan.reason == "best_expected_speedup"


@pytest.mark.parametrize(
    ("successes", "failures", "why"),
    [
        (
            6e307,
            9.5e307,
            "random.betavariate never returns here (2 * alpha overflows): a prior_strength of 1e308 hung Decide",
        ),
        (1e13, 1e13, "past POINT_MASS_WEIGHT: the mean, the spread being below 1e-6"),
        (float("nan"), 1.0, "not a number: the mean, never a draw that cannot end"),
    ],
)
def test_a_beta_draw_always_returns(successes: float, failures: float, why: str):
    beta, mean = (successes, failures), beta_mean((successes, failures))
    drawn = beta_draw(beta, random.Random(0))
    assert drawn == mean or (drawn != drawn and mean != mean), why


def test_suffix_is_a_drafter_the_policy_allows_or_forbids_per_segment():
    """Suffix decoding is learned like any drafter (per segment, from its rounds and its measured c): where its
    acceptance is high it is chosen, and a segment rule that disables it (a tenant whose requests must not read other
    requests' outputs) keeps it out, as a policy that forces it puts it in."""
    seg = counts(draft=(0.5, 1.0), prompt_lookup=(0.05, 0.05), suffix=(0.95, 0.9))
    drafters = ("draft", "prompt_lookup", "suffix")

    def plan_for(settings: Settings) -> Plan:
        req = Request("s", 1, drafters, 128)
        estimates = {
            d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.5, 0.5, settings.prior_strength, c)
            for d, c in (("draft", 0.05), ("prompt_lookup", 0.0), ("suffix", 0.001))
        }
        return decide(settings, "v1", req, estimates, GPU, None, random.Random(0))

    assert Settings().drafter("suffix").k_max == 16 and Settings().drafter("suffix").cost_ratio == 0.0
    chosen = plan_for(Settings(exploration_rate=0.0))
    assert (chosen.drafter, chosen.reason) == ("suffix", "best_expected_speedup")
    assert chosen.k > 8, "suffix's K ceiling is its own (k_max 16), not the draft model's"
    forbidden = plan_for(with_(drafters={"suffix": {"enabled": False}}))
    assert forbidden.drafter == "draft", "a disabled suffix is never chosen"
    forced = plan_for(with_(force="suffix", force_k=4))
    assert (forced.drafter, forced.k, forced.reason) == ("suffix", 4, "policy_forced")


def run_suffix(seg: SegmentCounts, settings: Settings, seed: int, drafters: tuple[str, ...] = ("suffix",)) -> Plan:
    """decide() for a worker that offers suffix decoding (and ``drafters``), with the policy's suffix settings."""
    req = Request(segment="s", batch_size=1, drafters=drafters, max_new_tokens=128)
    estimates = {d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.3, 0.5, settings.prior_strength, 0.0)
                 for d in drafters}  # fmt: skip
    return decide(settings, "v1", req, estimates, GPU, None, random.Random(seed))


def test_suffix_decoding_learned_from_its_counterfactual_rounds_is_not_probed():
    # Suffix decoding scored over a million rounds says it is hopeless here: the segment is off, and its floor of
    # probes would go to suffix decoding, the only drafter. Scored on every request asked, it is seen for free.
    scored = counts(served=False, suffix=(0.05, 0.05))
    explore = with_(exploration_rate=0.5)
    plans = [run_suffix(scored, explore, s) for s in range(500)]
    assert all(p.drafter == "none" and p.counterfactual_ceiling("suffix") == 16 for p in plans)
    assert not any(p.exploration for p in plans)
    # Not scored (the policy says so), or scored by no worker yet (a worker whose suffix.counterfactual_share is 0
    # offers it and never scores it): only probes can show it, so the floor probes it.
    unscored = with_(exploration_rate=0.5, counterfactual=False)
    assert run_suffix(scored, unscored, 0).counterfactual_ks == ()
    assert any(run_suffix(scored, unscored, s).exploration for s in range(500))
    served_only = counts(served=True, suffix=(0.05, 0.05))
    assert any(run_suffix(served_only, explore, s).exploration for s in range(500))


def test_the_plan_asks_every_scorable_drafter_the_worker_offers_scored():
    plan = run_suffix(counts(draft=(0.9, 1.0)), with_(), 0, drafters=("draft", "prompt_lookup", "suffix"))
    assert plan.counterfactual_ks == (("prompt_lookup", 10), ("suffix", 16))  # each at its k_max
    assert run_suffix(counts(draft=(0.9, 1.0)), with_(), 0, drafters=("draft",)).counterfactual_ks == ()


def test_a_draft_head_is_chosen_by_what_it_costs_and_accepts():
    # eagle is an arm like any other: chosen where its α at its c pays most, never where the worker lacks a head,
    # and dropped when its drafting costs more than its acceptance repays (c 2.0: two target steps per token).
    seg = counts(draft=(0.6, 1.0), eagle=(0.85, 1.0), prompt_lookup=(0.1, 0.1))
    settings = Settings(exploration_rate=0.0)

    def plan(c_eagle: float, drafters: tuple[str, ...]) -> Plan:
        req = Request(segment="s", batch_size=1, drafters=drafters, max_new_tokens=128)
        estimates = {
            d: estimate_drafter(seg, d, settings.drafter(d).k_max, 0.5, 0.5, settings.prior_strength, c)
            for d, c in (("draft", 0.1), ("prompt_lookup", 0.0), ("eagle", c_eagle))
        }
        return decide(settings, "v1", req, estimates, GPU, None, random.Random(0))

    assert plan(0.1, (*BOTH, "eagle")).drafter == "eagle"
    assert plan(0.1, BOTH).drafter == "draft"  # no head on this worker
    assert plan(2.0, (*BOTH, "eagle")).drafter == "draft"
