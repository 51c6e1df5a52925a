"""Requests a client may cancel: which task serves each stream this router relays.

A client that stops reading (its HTTP client left) publishes ``CancelGenerate`` to every
router; the one serving that request *for that inbox* cancels its task, whose try then
cancels its nodes' work (``Cancel``) and ends without an error to the client (there is
nobody to send it to). The inbox is the proof of ownership: only the client that sent
the request knows it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

from cpd.bus import Bus
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError


class Cancels:
    """The running requests of one router, by (request id, reply inbox)."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, str], asyncio.Task[object]] = {}
        self._cancelled: set[asyncio.Task[object]] = set()

    @contextmanager
    def running(self, request_id: str, reply_to: str) -> Iterator[None]:
        """The current task serves ``request_id`` to ``reply_to`` while in the block."""
        task = asyncio.current_task()
        assert task is not None
        key = (request_id, reply_to)
        self._tasks[key] = task
        try:
            yield
        finally:
            if self._tasks.get(key) is task:
                del self._tasks[key]
            self._cancelled.discard(task)

    def cancel(self, msg: wire.CancelGenerate) -> bool:
        """Cancel the request ``msg`` names, if it runs here for that inbox."""
        task = self._tasks.get((msg.request_id, msg.reply_to))
        if task is None or task.done():
            return False
        self._cancelled.add(task)
        task.cancel()
        return True

    def by_client(self) -> bool:
        """Whether the current task's cancellation came from its client (not a stop)."""
        return asyncio.current_task() in self._cancelled


async def cancel_nodes(bus: Bus, request_id: str, nodes: list[str],
                       choice: int | None = None) -> None:
    """Tell ``nodes`` to stop generating ``request_id`` (or only its ``choice``; at most
    once delivered: a node that misses it generates to the end into an inbox nobody
    reads)."""
    for node in filter(None, nodes):
        with contextlib.suppress(CpdError):
            await bus.publish(subjects.cancel(node),
                              wire.Cancel(request_id=request_id, choice=choice))
