"""Keep-alives on a service's open reply streams: one ticker keeps every open stream
from being silent longer than the keep-alive interval, so a reader whose sender died,
or whose later messages were lost, fails fast and typed (:class:`~cpd.bus.StreamReader`
with ``keepalive_misses``) instead of at its deadline: the router's client streams
(``cpd.client``) and the workers' streams to the router. One ticker for all streams: a
task per stream would double the tasks of a busy service."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from cpd.bus.stream import ReplyStream


class KeepAlives:
    """The open streams and their ticker (``interval_s``; ``sent`` is called for each
    keep-alive that went out). With ``before_first``, a stream that has sent nothing
    yet gets one too, in band (the router's client streams: it arms the client's
    watchdog); without, keep-alives start after a stream's first message, so they never
    take a seq (the workers' streams, whose readers count their messages)."""

    def __init__(self, interval_s: float, *, sent: Callable[[], None] = lambda: None,
                 log: Any, before_first: bool = True) -> None:
        self.interval_s = interval_s
        self._sent = sent
        self._log = log
        self.before_first = before_first
        self._open: set[ReplyStream] = set()

    @contextlib.contextmanager
    def watching(self, out: ReplyStream) -> Iterator[ReplyStream]:
        """``out`` kept alive for the duration of the block."""
        self._open.add(out)
        try:
            yield out
        finally:
            self._open.discard(out)

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Tick until ``stopping()``."""
        interval = self.interval_s
        ms = int(interval * 1000)
        while not stopping():
            # Every half interval, to streams silent for half an interval or more: the
            # gap a client sees stays within one interval, so its limit of
            # keepalive_misses intervals leaves slack for a briefly stalled event loop.
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for out in list(self._open):
                if out.closed or not (self.before_first or out.sent_any):
                    continue
                if now - out.last_sent >= interval / 2:
                    try:
                        await out.keepalive(ms)
                    except Exception as e:
                        # E.g. NATS reconnecting with a full buffer: skip this one; the
                        # ticker must outlive it, or every client would give up on us.
                        self._log.debug("keepalive_failed", error=repr(e))
                        continue
                    self._sent()
