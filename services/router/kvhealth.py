"""The router's view of kvindex, from its own lookups (pure logic).

A lookup that misses its deadline is a miss for that request either way, but one slow
answer under load is not an index that is down: the state says ``slow`` until
``down_after`` lookups in a row missed, and only then ``unavailable``. Nobody listening
(NATS says no responders) is ``unavailable`` at once; any answer ends the streak.

An answer from an index more than ``max_lag`` events behind the ``CPD_KV`` stream is
``lagging`` and used as a miss, as a recovering one is: it may list blocks evicted or
invalidated since, and pulls planned on them would fail over to recompute one by one.
"""

from __future__ import annotations

from cpd.protocol.errors import ErrorCode
from cpd.protocol.wire import KvIndexState, LookupReply


class KvIndexHealth:
    """kvindex's state as this router's lookups found it."""

    def __init__(self, down_after: int, max_lag: int) -> None:
        if down_after < 1 or max_lag < 0:
            raise ValueError("down_after must be at least 1, max_lag at least 0")
        self.down_after = down_after
        self.max_lag = max_lag
        self.state = KvIndexState.OK
        self._missed = 0  # lookups in a row without an answer

    def answered(self, reply: LookupReply) -> KvIndexState:
        """A lookup answered; returns the new state (the answer counts as a hit list
        only when it is :attr:`~KvIndexState.OK`)."""
        self._missed = 0
        if reply.status == "recovering":
            self.state = KvIndexState.RECOVERING
        elif reply.lag_events > self.max_lag:
            self.state = KvIndexState.LAGGING
        else:
            self.state = KvIndexState.OK
        return self.state

    def missed(self, code: ErrorCode) -> bool:
        """A lookup got no answer (``code`` says why); returns whether kvindex became
        :attr:`~KvIndexState.UNAVAILABLE` with it (the moment to say so in the log)."""
        self._missed += 1
        was = self.state
        if code is ErrorCode.NO_RESPONDERS or self._missed >= self.down_after:
            self.state = KvIndexState.UNAVAILABLE
        elif was is not KvIndexState.UNAVAILABLE:
            self.state = KvIndexState.SLOW
        return self.state is KvIndexState.UNAVAILABLE and was is not KvIndexState.UNAVAILABLE
