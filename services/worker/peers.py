"""The peers a worker may pull KV blocks from: their UCX addresses as their heartbeats
announce them, a bounded wait for a peer a plan names before its first heartbeat got
here, and dialling new peers ahead of need."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.roles import PREFILL_ROLES, WORKER_ROLES
from cpd.transfer import TransferClient


class Peers:
    """Peer addresses of one worker (``node`` in ``role``)."""

    def __init__(self, node: str, role: str, *, heartbeat_interval_s: float,
                 connect_ahead_delay_s: float, log: Any = None) -> None:
        self.node = node
        self.role = role
        self.addresses: dict[str, bytes] = {}
        self._wait_s = 2 * heartbeat_interval_s
        self._delay_s = connect_ahead_delay_s
        self._waits: dict[str, asyncio.Event] = {}
        # Peers to dial ahead of need: (node, address, when its heartbeat was first seen).
        self._ahead: asyncio.Queue[tuple[str, bytes, float]] = asyncio.Queue()
        self._log = log or telemetry.get_logger("cpd.worker", node=node)

    def may_pull_from(self, role: str) -> bool:
        """Prefill roles pull prefixes from any worker; decode pulls only hand-offs."""
        return role in WORKER_ROLES and (self.role in PREFILL_ROLES or role in PREFILL_ROLES)

    def heard(self, hb: wire.Heartbeat) -> None:
        """A peer's heartbeat (its address already checked): remember where it listens,
        queue a new address to be dialled ahead, wake requests waiting for it."""
        if (self.addresses.get(hb.node) != hb.ucx_address and hb.node != self.node
                and self.may_pull_from(hb.role)):
            self._ahead.put_nowait((hb.node, hb.ucx_address, time.monotonic()))
        self.addresses[hb.node] = hb.ucx_address
        if (waiting := self._waits.pop(hb.node, None)) is not None:
            waiting.set()

    @property
    def dials_queued(self) -> int:
        """New peer addresses waiting to be dialled ahead."""
        return self._ahead.qsize()

    async def address(self, node: str) -> bytes | None:
        """The UCX address of ``node``. A plan may name a peer this worker has not heard
        yet (the router heard its heartbeat first): wait up to two heartbeat intervals
        for it rather than recompute what the peer holds."""
        if (address := self.addresses.get(node)) is not None:
            return address
        seen = self._waits.setdefault(node, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), self._wait_s)
        return self.addresses.get(node)

    async def connect_ahead(self, client: TransferClient, stopping: Callable[[], bool]) -> None:
        """Dial each new peer once its listener had a moment to settle, one at a time (a
        burst of concurrent handshakes with a just-restarted peer is what UCX handles
        worst), so the first warm request does not pay the connection set-up."""
        while not stopping():
            node, address, seen = await self._ahead.get()
            await asyncio.sleep(max(0.0, seen + self._delay_s - time.monotonic()))
            if self.addresses.get(node) == address and await client.connect_ahead(address):
                self._log.info("worker.peer_connected", peer=node)
