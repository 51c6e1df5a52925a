"""A node's lifecycle events on their way into ``CPD_KV``, published behind the caller.

A block store changes state on the request path (slots taken, blocks allocated, written,
sealed); kvindex must learn each change, in order, but nothing on that path needs
JetStream's acknowledgement before going on: a pull lands and the engine loads it
whether or not kvindex has heard yet. Waiting for each ack there cost a round trip to
the NATS server per transition, several per request. The outbox keeps the events in
order and one task publishes them, one at a time (stream order is ``seq`` order); a
caller that must know they are stored (a re-announce, a hand-off that relies on
kvindex's record, shutting down) awaits :meth:`EventOutbox.settled`.

A publish that fails (NATS unreachable past the publisher's retry window) keeps its
events queued, in order, and is tried again after a pause. A store whose queue grows
past its bound while NATS stays away replaces it by its whole state (a re-announce:
``NodeCleared``, then every block it holds), so memory stays bounded and kvindex still
learns the state as it is once NATS is back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable

from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode

from .events import KvEventPublisher

log = telemetry.get_logger("cpd.kvstore")

__all__ = ["EventOutbox"]


class EventOutbox:
    """Ordered, background publishing of one store's lifecycle events."""

    def __init__(self, publisher: KvEventPublisher, *, retry_pause_s: float = 1.0) -> None:
        self.publisher = publisher
        self.retry_pause_s = retry_pause_s
        self._queue: deque[wire.KvEvent] = deque()
        self._put = 0        # events ever put
        self._stored = 0     # events stored or dropped by clear() (a prefix of those put)
        self._publishing = False  # the queue's head is being published
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Events put and not yet stored."""
        return self._put - self._stored

    def put(self, events: Iterable[wire.KvEvent]) -> None:
        """Queue ``events`` after those already queued; returns at once."""
        before = self._put
        for event in events:
            self._queue.append(event)
            self._put += 1
        if self._put == before:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kv-events-{self.publisher.node}")
        self._wake.set()

    def clear(self) -> int:
        """Drop the queued events not being published (they count as done); returns
        how many. For a store whose state replaces them (a re-announce)."""
        keep = 1 if self._publishing and self._queue else 0
        dropped = len(self._queue) - keep
        for _ in range(dropped):
            self._queue.pop()
        self._stored += dropped
        self._resolve(None)
        return dropped

    async def settled(self) -> None:
        """Wait until every event put so far is stored. Raises the publisher's
        :class:`CpdError` when a publish fails meanwhile (the events stay queued)."""
        if self._stored >= self._put:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((self._put, fut))
        await fut

    async def close(self) -> None:
        """Stop publishing (what is still queued stays unpublished)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _, fut in self._waiters:
            fut.cancel()
        self._waiters.clear()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                self._publishing = True
                try:
                    await self.publisher.publish(self._queue[0])
                except Exception as e:  # the connection closed, JetStream gone: retry later
                    error = e if isinstance(e, CpdError) else CpdError(
                        f"cannot store kv events of {self.publisher.node}: {e!r}",
                        code=ErrorCode.UNAVAILABLE, retryable=True)
                    log.warning("kvstore.events_unpublished", node=self.publisher.node,
                                queued=len(self._queue), error=error.code.value)
                    self._resolve(error)
                    await asyncio.sleep(self.retry_pause_s)
                    continue
                finally:
                    self._publishing = False
                self._queue.popleft()
                self._stored += 1
                self._resolve(None)

    def _resolve(self, error: CpdError | None) -> None:
        """Wake the waiters whose events are all stored, or fail them all on ``error``."""
        keep = []
        for target, fut in self._waiters:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            elif self._stored >= target:
                fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep
