"""Keep-alives on a service's open reply streams: one ticker keeps every open stream
from being silent longer than the keep-alive interval, so a reader whose sender died,
or whose later messages were lost, fails fast and typed (:class:`~cpd.bus.StreamReader`
with ``keepalive_misses``) instead of at its deadline: the router's client streams
(``cpd.client``) and the workers' streams to the router. One ticker for all streams: a
task per stream would double the tasks of a busy service.

With ``reader_check_s``, the ticker also asks, that often, whether each stream still has
a reader (:meth:`ReplyStream.probe`): a client or gateway killed outright sends no
cancel, and its streams would otherwise run to their end for nobody."""

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
                 log: Any, before_first: bool = True, reader_check_s: float = 0.0,
                 reader_misses: int = 2,
                 reader_gone: Callable[[ReplyStream], None] = lambda out: None) -> None:
        self.interval_s = interval_s
        self._sent = sent
        self._log = log
        self.before_first = before_first
        self._open: set[ReplyStream] = set()
        # Reader checks: every reader_check_s (0: never), reader_gone(out) once a
        # stream's inbox had no subscriber at reader_misses checks in a row.
        self.reader_check_s = reader_check_s
        self._reader_misses = reader_misses
        self._reader_gone = reader_gone
        self._misses: dict[ReplyStream, int] = {}
        self._probes: set[asyncio.Task[None]] = set()
        self._checked = time.monotonic()

    @contextlib.contextmanager
    def watching(self, out: ReplyStream) -> Iterator[ReplyStream]:
        """``out`` kept alive for the duration of the block."""
        self._open.add(out)
        try:
            yield out
        finally:
            self._open.discard(out)
            self._misses.pop(out, None)

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Tick until ``stopping()``."""
        interval = self.interval_s
        ms = int(interval * 1000)
        try:
            while not stopping():
                # Every half interval, to streams silent for half an interval or more: the
                # gap a client sees stays within one interval, so its limit of
                # keepalive_misses intervals leaves slack for a briefly stalled event loop.
                await asyncio.sleep(interval / 2)
                now = time.monotonic()
                await self._keep_alive(now, ms)
                if self.reader_check_s and now - self._checked >= self.reader_check_s:
                    self._checked = now
                    self._check_readers(ms)
        finally:
            for task in self._probes:
                task.cancel()

    async def _keep_alive(self, now: float, ms: int) -> None:
        for out in list(self._open):
            if out.closed or not (self.before_first or out.sent_any):
                continue
            if now - out.last_sent >= self.interval_s / 2:
                try:
                    await out.keepalive(ms)
                except Exception as e:
                    # E.g. NATS reconnecting with a full buffer: skip this one; the
                    # ticker must outlive it, or every client would give up on us.
                    self._log.debug("keepalive_failed", error=repr(e))
                    continue
                self._sent()

    def _check_readers(self, ms: int) -> None:
        """One probe per open stream, each a task of its own: a probe waits out its
        timeout when the keep-alive was delivered."""
        timeout = min(1.0, self.reader_check_s / 2)
        for out in list(self._open):
            if not out.closed and out.sent_any:
                task = asyncio.create_task(self._probe(out, ms, timeout))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, out: ReplyStream, ms: int, timeout: float) -> None:
        try:
            read = await out.probe(ms, timeout)
        except Exception as e:  # e.g. NATS reconnecting: this check is unknown
            self._log.debug("reader_check_failed", error=repr(e))
            return
        if out not in self._open:
            return
        misses = 0 if read else self._misses.get(out, 0) + 1
        self._misses[out] = misses
        if misses == self._reader_misses:
            self._log.info("stream.reader_gone", request_id=out.request_id, checks=misses)
            self._reader_gone(out)
