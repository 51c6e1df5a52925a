"""Single-flight waiters woken by kvindex's visibility events, not by polling.

A request the policy told to wait (``Decision.wait``) waits for one block: the last of
the prefix another node is computing. kvindex publishes ``BlocksVisible`` for every
block it makes visible and ``BlocksInvalidated`` for every block it drops; the router
hands each to :meth:`PrefixWaiters.visible` / :meth:`PrefixWaiters.invalidated`, which
wake the waiters of that namespace and node at once: the awaited block turned visible,
or the node dropped blocks (its write may have failed), so the router looks again.
Events are at-most-once (core NATS), so a waiter also looks again at a slow safety
interval of its own; the waiters themselves are pure bookkeeping with no I/O.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from cpd.protocol import wire


class PrefixWaiters:
    """Who waits for which block of which node (see the module doc)."""

    def __init__(self) -> None:
        # (namespace, node) -> awaited block hash -> events of its waiters
        self._by_node: dict[tuple[str, str], dict[bytes, list[asyncio.Event]]] = (
            defaultdict(lambda: defaultdict(list)))
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, namespace: str, node: str, block: bytes) -> asyncio.Event:
        """Wait for ``block`` to turn visible on ``node``; the event is set when it does
        (or when ``node`` drops blocks of the namespace). Call :meth:`discard` after."""
        ev = asyncio.Event()
        self._by_node[(namespace, node)][block].append(ev)
        self._count += 1
        return ev

    def discard(self, namespace: str, node: str, block: bytes, ev: asyncio.Event) -> None:
        """Stop waiting (woken or not)."""
        blocks = self._by_node.get((namespace, node))
        if blocks is None:
            return
        evs = blocks.get(block)
        if evs is not None and ev in evs:
            evs.remove(ev)
            self._count -= 1
            if not evs:
                del blocks[block]
        if not blocks:
            del self._by_node[(namespace, node)]

    def visible(self, msg: wire.BlocksVisible) -> int:
        """Wake the waiters of blocks in ``msg``; how many were woken."""
        blocks = self._by_node.get((msg.namespace, msg.node))
        if not blocks or msg.tier != wire.Tier.DRAM:
            return 0
        woken = 0
        for h in wire.split_hashes(msg.block_hashes):
            for ev in blocks.get(h, ()):
                ev.set()
                woken += 1
        return woken

    def invalidated(self, msg: wire.BlocksInvalidated) -> int:
        """Wake every waiter on the node (of the namespace, or all when the message
        names none): what it was writing may be gone."""
        woken = 0
        for (ns, node), blocks in self._by_node.items():
            if node == msg.node and (not msg.namespace or ns == msg.namespace):
                for evs in blocks.values():
                    for ev in evs:
                        ev.set()
                        woken += 1
        return woken
