"""Deadlines across hosts whose clocks disagree (pure rules, table-driven)."""

from __future__ import annotations

import pytest

from cpd.protocol import deadlines


@pytest.mark.parametrize("deadline, now, budget", [
    (10_000, 4_000, 6_000),
    (10_000, 10_000, 0),
    (10_000, 12_000, 0),    # passed: nothing left, never negative
])
def test_the_budget_is_the_time_left(deadline: int, now: int, budget: int) -> None:
    assert deadlines.budget_ms(deadline, now) == budget


@pytest.mark.parametrize("deadline, budget, now, local", [
    # The sender's clock 2 min behind ours: its instant has passed here, its budget not.
    (100_000 - 120_000 + 60_000, 60_000, 100_000, 160_000),
    # The sender's clock ahead: the instant looks far off, but nothing was left.
    (100_000 + 120_000, 0, 100_000, 100_000),
    # A sender that sends only the instant: it stands.
    (130_000, None, 100_000, 130_000),
])
def test_a_received_deadline_is_on_the_receivers_clock(deadline: int, budget: int | None,
                                                       now: int, local: int) -> None:
    assert deadlines.local_deadline_ms(deadline, budget, now) == local
