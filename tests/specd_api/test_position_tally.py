"""The per-position tally: acceptance is a prefix, counted in one place. Each row says why its counts are right."""

from __future__ import annotations

import pytest

from specd_api.position_tally import PositionTally


@pytest.mark.parametrize(
    ("rounds", "verifiable", "expected", "why"),
    [
        ([(4, 2)], None, ([1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]),
         "0 and 1 kept, 2 checked and rejected, 3 never checked: nothing after a rejection is"),
        ([(3, 3)], None, ([1, 1, 1], [1, 1, 1], [1, 1, 1]), "all kept: every position verified, none past the draft"),
        ([(3, 0)], None, ([1, 1, 1], [1, 0, 0], [0, 0, 0]), "the first rejected: only position 0 was verified"),
        ([(0, 0)], None, ([], [], []), "a round that proposed nothing counts as a round, at no position"),
        ([(4, 2), (2, 2), (0, 0)], None, ([2, 2, 1, 1], [2, 2, 1, 0], [2, 2, 0, 0]), "rounds add up per position"),
        ([(5, 1)], 1, ([1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]),
         "the text ended after one token: position 1 was proposed but had nothing to be checked against"),
        ([(5, 1)], 3, ([1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]),
         "text enough to check more: the prefix rule, not the text, stops verification"),
    ],
)  # fmt: skip
def test_add_counts_the_accepted_prefix(rounds, verifiable, expected, why):
    tally = PositionTally()
    for drafted, accepted in rounds:
        tally.add(drafted, accepted, verifiable)
    assert (tally.rounds, tally.proposed, tally.verified, tally.accepted) == (len(rounds), *expected), why


def test_totals_and_pairs_read_the_lists():
    tally = PositionTally()
    tally.add(4, 2)
    tally.add(2, 1)
    assert (tally.num_drafted, tally.num_accepted) == (6, 3), "4 + 2 proposed, 2 + 1 accepted"
    assert tally.proposed_and_accepted() == [(2, 2), (2, 1), (1, 0), (1, 0)]


def test_a_tally_of_width_k_keeps_k_positions():
    tally = PositionTally.of_width(4)
    tally.add(1, 1)
    assert (tally.proposed, tally.verified, tally.accepted) == ([1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]), (
        "an aggregate's lists are k long even when no round drafted k"
    )


def test_merge_equals_adding_every_round_to_one_tally():
    rounds = [(4, 2), (1, 0), (6, 6), (0, 0), (3, 1)]
    whole, first, second = PositionTally(), PositionTally(), PositionTally.of_width(2)
    for i, (drafted, accepted) in enumerate(rounds):
        whole.add(drafted, accepted)
        (first if i % 2 else second).add(drafted, accepted)
    first.merge(second)
    assert first == whole, "the longer tally widens the shorter one; counts add per position"
