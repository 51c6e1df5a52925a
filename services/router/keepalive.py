"""Keep-alives on the router's client streams: one ticker keeps every open stream from
being silent longer than the keep-alive interval, so a client whose router died fails
fast and typed (``cpd.client``) instead of at its deadline. One ticker for all streams:
a task per stream would double the tasks of a busy router."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from cpd.bus import ReplyStream


class KeepAlives:
    """The open client streams and their ticker (``interval_s``; ``sent`` is called for
    each keep-alive that went out)."""

    def __init__(self, interval_s: float, *, sent: Callable[[], None], log: Any) -> None:
        self.interval_s = interval_s
        self._sent = sent
        self._log = log
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
                if not out.closed and now - out.last_sent >= interval / 2:
                    try:
                        await out.keepalive(ms)
                    except Exception as e:
                        # E.g. NATS reconnecting with a full buffer: skip this one; the
                        # ticker must outlive it, or every client would give up on us.
                        self._log.debug("router.keepalive_failed", error=repr(e))
                        continue
                    self._sent()
