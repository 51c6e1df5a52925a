"""The router's view of kvindex from its lookups: one slow lookup is ``slow``, only a
streak of them (or nobody listening) is ``unavailable``, any answer ends it, and an
answer too far behind the event stream is ``lagging``."""

from __future__ import annotations

import pytest

from cpd.protocol.errors import ErrorCode
from cpd.protocol.wire import KvIndexState, LookupReply
from services.router.kvhealth import KvIndexHealth

OK = LookupReply(status="ok")
RECOVERING = LookupReply(status="recovering")
BEHIND = LookupReply(status="ok", lag_events=101)   # over the limit of 100
AT_LIMIT = LookupReply(status="ok", lag_events=100)
T, NR = ErrorCode.TIMEOUT, ErrorCode.NO_RESPONDERS

S = KvIndexState


@pytest.mark.parametrize(("events", "states", "announced"), [
    ([T], [S.SLOW], []),
    ([T, T], [S.SLOW, S.SLOW], []),
    ([T, T, T], [S.SLOW, S.SLOW, S.UNAVAILABLE], [2]),
    ([T, T, OK, T, T], [S.SLOW, S.SLOW, S.OK, S.SLOW, S.SLOW], []),
    ([NR], [S.UNAVAILABLE], [0]),
    ([T, NR, T, NR], [S.SLOW, S.UNAVAILABLE, S.UNAVAILABLE, S.UNAVAILABLE], [1]),
    ([NR, RECOVERING, OK], [S.UNAVAILABLE, S.RECOVERING, S.OK], [0]),
    ([T, T, T, T, OK, NR], [S.SLOW, S.SLOW, S.UNAVAILABLE, S.UNAVAILABLE, S.OK,
                            S.UNAVAILABLE], [2, 5]),
    ([ErrorCode.INTERNAL] * 3, [S.SLOW, S.SLOW, S.UNAVAILABLE], [2]),
    ([BEHIND, AT_LIMIT, BEHIND, OK], [S.LAGGING, S.OK, S.LAGGING, S.OK], []),
    ([T, T, BEHIND, T, T], [S.SLOW, S.SLOW, S.LAGGING, S.SLOW, S.SLOW], []),
    ([NR, BEHIND], [S.UNAVAILABLE, S.LAGGING], [0]),
])
def test_state_after_each_lookup(events: list, states: list[KvIndexState],
                                 announced: list[int]) -> None:
    h = KvIndexHealth(down_after=3, max_lag=100)
    seen, told = [], []
    for i, e in enumerate(events):
        if isinstance(e, LookupReply):
            h.answered(e)
        elif h.missed(e):
            told.append(i)
        seen.append(h.state)
    assert seen == states
    assert told == announced  # said once per outage, when it starts


def test_down_after_one_is_the_old_rule() -> None:
    h = KvIndexHealth(down_after=1, max_lag=0)
    assert h.missed(T) and h.state is S.UNAVAILABLE
    assert h.answered(LookupReply(lag_events=1)) is S.LAGGING
    for bad in ({"down_after": 0, "max_lag": 0}, {"down_after": 1, "max_lag": -1}):
        with pytest.raises(ValueError):
            KvIndexHealth(**bad)
