"""The fault drill's scenarios that no other test covers with real processes (benchmarks/faults.py): a standalone
Redis SIGKILLed under load and one that is not there when the controller starts, a frozen controller, a killed
worker. Each scenario checks its own invariants (0 failed requests, rounds reported = stored, only in-flight requests
lost with a worker); a broken one names them. Its timing bounds (the share of decisions that fell back at the
deadline, p99 during the fault) depend on the machine's load as much as on the code: the drill reports them (SLOW),
this test prints them. The controller SIGKILLed is tests/e2e/test_fail_open.py; the bad policies at full rate and the
soak run with the drill itself (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import pytest

from benchmarks.faults import SCENARIOS, quiet


@pytest.mark.parametrize("name", ["redis-kill", "redis-late", "controller-stop", "worker-kill"])
def test_the_fault_is_survived(name, tmp_path):
    with quiet():
        row = SCENARIOS[name](tmp_path / name)
    print(f"\n{row}")
    assert not row.violations, row.violations
    assert row.requests > 0 and row.rounds_stored > 0
