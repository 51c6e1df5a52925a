"""Deadlines that cross hosts without their clocks having to agree.

A request's deadline travels as the sender's wall-clock instant (``deadline_unix_ms``)
and as the time left when it was sent (``budget_ms``). The receiver's deadline is its
own clock plus the budget: a host whose clock runs seconds ahead of the router's does not
take fresh requests for expired ones, and one behind does not keep expired ones alive.
The bus's transit time (well under a millisecond between services) is not subtracted.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """This host's wall clock in ms."""
    return int(time.time() * 1000)


def budget_ms(deadline_unix_ms: int, now: int) -> int:
    """The time left until ``deadline_unix_ms`` at ``now`` (0 once it has passed)."""
    return max(0, deadline_unix_ms - now)


def local_deadline_ms(deadline_unix_ms: int, budget: int | None, now: int) -> int:
    """A received deadline on this host's clock: ``now`` plus the sender's ``budget``;
    without one (a sender that sends only the instant), the instant itself."""
    return deadline_unix_ms if budget is None else now + budget
