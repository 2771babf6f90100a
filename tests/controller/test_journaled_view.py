"""The journaled view on its own (storage/journaled_view.py): a journaled report is shown until the snapshot that
holds it is installed, then taken off, never twice and never missed; a retry journaled twice is shown twice until
both copies are replayed; a previous run's report (never shown) is ignored when replayed."""

from __future__ import annotations

from controller.storage.journaled_view import JournaledView, report_counts
from tests.controller.test_journal import aggregate


def rounds(view: JournaledView, segment: str) -> float:
    counts = view.segment(segment)
    return 0.0 if counts is None else sum(item.rounds for item in counts.by_k.values())


def test_a_journaled_report_is_shown_until_the_snapshot_holds_it() -> None:
    view = JournaledView()
    assert view.journaled("r1", report_counts([aggregate(10, "chat")])) == {"chat"}
    assert view.journaled("r2", report_counts([aggregate(5, "code")])) == {"code"}
    assert rounds(view, "chat") == 10 and rounds(view, "code") == 5 and view.segments() == {"chat", "code"}

    view.replayed("r1", report_counts([aggregate(10, "chat")]))
    assert rounds(view, "chat") == 10  # sent, but no snapshot holds it yet: still shown
    assert view.snapshot_installed(journal_empty=False) == {"chat"}
    assert rounds(view, "chat") == 0 and rounds(view, "code") == 5  # r2 is still journaled
    assert view.segments() == {"code"}  # no report shown names "chat": it leaves the view whole, no zeros kept
    assert view.snapshot_installed(journal_empty=False) == set()  # nothing replayed since: nothing moves

    view.replayed("r2", report_counts([aggregate(5, "code")]))
    assert view.snapshot_installed(journal_empty=True) == {"code"}
    assert view.segments() == set() and view.costs().drafted == {}


def test_a_retry_journaled_twice_is_shown_twice_until_both_are_replayed() -> None:
    view = JournaledView()
    report = [aggregate(4, "chat")]
    view.journaled("r", report_counts(report))
    view.journaled("r", report_counts(report))
    assert rounds(view, "chat") == 8
    view.replayed("r", report_counts(report))
    view.snapshot_installed(journal_empty=False)
    assert rounds(view, "chat") == 4
    view.replayed("r", report_counts(report))
    view.snapshot_installed(journal_empty=False)
    assert rounds(view, "chat") == 0 and view.segments() == set()


def test_a_previous_runs_report_is_never_taken_off() -> None:
    view = JournaledView()
    view.journaled("mine", report_counts([aggregate(3, "chat")]))
    # in the journal file before this run: never shown
    view.replayed("earlier-run", report_counts([aggregate(7, "chat")]))
    assert view.snapshot_installed(journal_empty=False) == set()
    assert rounds(view, "chat") == 3


def test_counts_never_go_below_zero_after_subtractions() -> None:
    view = JournaledView()
    report = [aggregate(3, "chat")]
    view.journaled("r", report_counts(report))
    view.journaled("still-journaled", report_counts([aggregate(1, "chat")]))  # keeps "chat" in the view
    # more taken off than shown (a rounding, at worst, in practice)
    view.replayed("r", report_counts([aggregate(5, "chat")]))
    view.snapshot_installed(journal_empty=False)
    counts = view.segment("chat")
    assert counts is not None
    assert all(item.rounds >= 0 for item in counts.by_k.values())
    assert all(value >= 0 for value in view.costs().drafted.values())


def test_a_withdrawn_report_a_replay_already_took_off_is_not_taken_off_twice() -> None:
    """A previous run's copy of report X is replayed while this run's retry of X is being written; the write then
    fails: the view must not lose another shown report's counts."""
    view = JournaledView()
    view.journaled("other", report_counts([aggregate(5, "chat")]))
    retry = report_counts([aggregate(3, "chat")])
    view.journaled("x", retry)
    view.replayed("x", retry)  # the earlier copy, replayed: this run's shown copy leaves with the next snapshot
    view.snapshot_installed(journal_empty=False)
    assert rounds(view, "chat") == 5
    view.withdrawn("x", retry)  # the retry's write failed after all: nothing of it is shown any more
    assert rounds(view, "chat") == 5 and view.segments() == {"chat"}


def test_replayed_reports_are_taken_off_as_one_sum() -> None:
    view = JournaledView()
    view.journaled("a", report_counts([aggregate(2, "chat"), aggregate(1, "code")]))
    view.journaled("b", report_counts([aggregate(3, "chat")]))
    view.journaled("c", report_counts([aggregate(4, "chat")]))
    view.replayed("a", report_counts([aggregate(2, "chat"), aggregate(1, "code")]))
    view.replayed("b", report_counts([aggregate(3, "chat")]))
    replayed = view.replayed_counts()
    assert (replayed.reports, dict(replayed.naming)) == (2, {"chat": 2, "code": 1})
    assert view.snapshot_installed(journal_empty=False, replayed=replayed) == {"chat", "code"}
    assert rounds(view, "chat") == 4 and view.segments() == {"chat"}  # c's alone; code left whole
    assert view.replayed_counts().reports == 0
