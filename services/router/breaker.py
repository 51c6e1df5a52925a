"""A circuit breaker per KV source: a peer whose data plane failed a planned load is not
planned as a source again for a while, so a dead, blackholed or corrupt peer costs one
failed load (one timeout at most), not one per request.

Pure logic with an injected clock. The router feeds it every route's load error (the
prefill node's typed ``wire.LoadError``: which peer, and why) and every load that
succeeded, and drops open peers from kvindex's answer before the policy plans. A peer's
breaker opens on a failure that says the peer cannot serve — unreachable, timed out,
gone, refusing, or serving bytes that differ from what their writer sealed — not on
blocks it merely no longer holds (kvindex catches up with evictions by itself). It
stays open ``open_s``, doubled on each failure in a row up to ``max_open_s``; then one
decision may plan the peer again (half-open), and a load it served closes the breaker.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

from cpd.protocol import wire
from cpd.protocol.errors import ErrorCode
from services.router.hits import Hits

# Load errors that say the peer cannot serve (ErrorCode values, as LoadError.code).
OPENING_CODES = frozenset(c.value for c in (
    ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.DEADLINE_EXCEEDED,
    ErrorCode.PEER_GONE, ErrorCode.CHECKSUM_MISMATCH, ErrorCode.CAPABILITY_DENIED,
    ErrorCode.MALFORMED, ErrorCode.INTERNAL))


_V = TypeVar("_V")


@dataclass
class _Peer:
    failures: int = 0        # in a row
    open_until: float = 0.0  # monotonic


class SourceBreaker:
    """Open and closed KV sources of one router."""

    def __init__(self, *, open_s: float = 2.0, max_open_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.open_s = open_s
        self.max_open_s = max_open_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self.opened = 0  # times a breaker opened (cpd status, metrics)

    def observe(self, route: wire.Route) -> None:
        """Learn from a finished route: its load error, or the loads it made."""
        err = route.load_error
        if err is not None and err.code in OPENING_CODES:
            self._failed(err.peer)
        elif err is None and route.remote_node:
            self._peers.pop(route.remote_node, None)  # it served: closed

    def open_peers(self, holders: Collection[str] | None = None) -> frozenset[str]:
        """Peers not to plan as sources now. Once a peer's open time is over, one
        decision may plan it again (half-open): the next ones leave it out for
        ``open_s`` more, unless its route came back and closed or reopened it. Only a
        decision whose prompt the peer holds (it is in ``holders``; None: any decision)
        spends the trial: one that could not load from it would say nothing about it,
        and under traffic the peer would stay shut for good."""
        now = self.clock()
        shut = []
        for name, p in self._peers.items():
            if now < p.open_until:
                shut.append(name)
            elif holders is None or name in holders:
                p.open_until = now + self.open_s  # this decision's trial
        return frozenset(shut)

    def filter(self, hits: Hits) -> Hits:
        """``hits`` without the open peers' DRAM and disk copies."""
        if not self._peers:
            return hits
        shut = self.open_peers(hits.dram.keys() | hits.disk.keys())
        if not shut:
            return hits
        return dataclasses.replace(
            hits, dram=_without(hits.dram, shut), disk=_without(hits.disk, shut),
            caps=_without(hits.caps, shut))

    def _failed(self, peer: str) -> None:
        p = self._peers.setdefault(peer, _Peer())
        p.failures += 1
        p.open_until = self.clock() + min(self.max_open_s,
                                          self.open_s * 2 ** (p.failures - 1))
        self.opened += 1


def _without(d: Mapping[str, _V], shut: frozenset[str]) -> dict[str, _V]:
    return {k: v for k, v in d.items() if k not in shut}
