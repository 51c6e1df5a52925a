"""Admission control (docs/architecture.md, "Routing"): at most ``max_inflight`` requests run, at
most
``max_queue`` wait for a slot (higher priority first, then arrival order), and the rest
are refused at once with a typed, retryable :class:`~cpd.protocol.errors.Overloaded` — never left
waiting in silence."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator

from cpd.protocol.errors import DeadlineExceeded, Overloaded


class Admission:
    """A priority semaphore with a bounded wait queue and per-request deadlines."""

    def __init__(self, max_inflight: int, max_queue: int) -> None:
        if max_inflight < 1 or max_queue < 0:
            raise ValueError("max_inflight must be >= 1 and max_queue >= 0")
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.in_flight = 0
        # (-priority, arrival number, future): a min-heap pops the most urgent, oldest.
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float, priority: int = 0) -> AsyncIterator[float]:
        """Hold one slot for the body; yields the seconds spent waiting for it.

        ``deadline`` is a ``time.monotonic()`` instant: a request still queued then
        fails with ``deadline_exceeded``. Among waiters, higher ``priority`` goes first.
        """
        t0 = time.monotonic()
        await self._acquire(deadline, priority)
        try:
            yield time.monotonic() - t0
        finally:
            self._release()

    async def _acquire(self, deadline: float, priority: int) -> None:
        if self.in_flight < self.max_inflight and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(f"router busy: {self.in_flight} requests running and "
                             f"{len(self._waiters)} queued (limits {self.max_inflight}/"
                             f"{self.max_queue}); retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (-priority, next(self._arrivals), fut)
        heapq.heappush(self._waiters, entry)
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                self._release()  # granted in the same instant the wait timed out
            raise DeadlineExceeded("deadline passed while queued for admission") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()
            raise
        finally:
            if not fut.done() or fut.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)

    def _release(self) -> None:
        # Hand the slot straight to the next waiter: arrivals cannot jump the queue.
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self.in_flight -= 1
