"""How a router replica learns the live workers before it takes requests, and forgets
the ones that died long ago. The node table itself (:mod:`services.router.nodes`) is
fed by heartbeats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.router.nodes import NodeTable

# Every worker heartbeats once per interval: after this many, a replica has heard them all.
DISCOVERY_INTERVALS = 1.5
_POLL_S = 0.02
# Nodes silent this many lease lengths are dropped from the table (and from `cpd status`).
FORGET_AFTER_LEASES = 60


async def await_workers(nodes: NodeTable, heartbeat_interval_s: float) -> None:
    """Until live nodes can serve a request end to end, or one round of heartbeats went
    by. A replica that starts beside running ones (or restarts after a crash) shares their
    queue group: without this, its first requests would be refused (``no decode node is
    up``) only because it has not yet heard the workers that serve them."""
    end = time.monotonic() + DISCOVERY_INTERVALS * heartbeat_interval_s
    while time.monotonic() < end and not nodes.serves_every_role(time.monotonic()):
        await asyncio.sleep(_POLL_S)


async def forget_dead(nodes: NodeTable, lease_ttl_s: float,
                      stopping: Callable[[], bool]) -> None:
    """Every lease length, drop nodes silent for ``FORGET_AFTER_LEASES`` leases."""
    while not stopping():
        await asyncio.sleep(lease_ttl_s)
        nodes.forget_dead(time.monotonic(), lease_ttl_s * FORGET_AFTER_LEASES)
