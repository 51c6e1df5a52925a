"""Requests a client may cancel: which task serves each stream this router relays.

A client that stops reading (its HTTP client left) publishes ``CancelGenerate`` to every
router; the one serving that request *for that inbox* cancels its task, whose try then
cancels its nodes' work (``Cancel``) and ends without an error to the client (there is
nobody to send it to). The inbox is the proof of ownership: only the client that sent
the request knows it.

A client whose gateway died resumes its request at another gateway, which publishes
``SupersedeGenerate``: the earlier streams of that request and tenant have no reader
left, and end the same way. Only gateways may publish it (it names a tenant), and it
spares the stream that resumed it and any later one: those began with as many resumed
tokens as it holds, the earlier ones with fewer.

A client or gateway that died and never resumes leaves a stream that nobody reads; the
router's keep-alive ticker finds its inbox without a subscriber (``KeepAlives`` reader
checks) and ends it as ``reader_gone``.
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
    """The running requests of one router, by request id and reply inbox."""

    def __init__(self) -> None:
        # request id → reply inbox → (task, tenant, tokens it resumed from)
        self._tasks: dict[str, dict[str, tuple[asyncio.Task[object], str, int]]] = {}
        self._cancelled: dict[asyncio.Task[object], wire.CancelReason] = {}

    @contextmanager
    def running(self, req: wire.GenerateRequest, reply_to: str) -> Iterator[None]:
        """The current task serves ``req`` to ``reply_to`` while in the block."""
        task = asyncio.current_task()
        assert task is not None
        streams = self._tasks.setdefault(req.request_id, {})
        streams[reply_to] = (task, req.tenant, len(wire.unpack_tokens(req.resume_tokens)))
        try:
            yield
        finally:
            if streams.get(reply_to, (None,))[0] is task:
                del streams[reply_to]
                if not streams and self._tasks.get(req.request_id) is streams:
                    del self._tasks[req.request_id]
            self._cancelled.pop(task, None)

    def cancel(self, msg: wire.CancelGenerate | wire.SupersedeGenerate) -> int:
        """Cancel what ``msg`` names here: the stream of its request to its inbox (a
        client that left), or every stream of its request and tenant that began with
        fewer resumed tokens than it holds (a client that resumed elsewhere). How many."""
        if isinstance(msg, wire.CancelGenerate):
            return self._stream(msg.request_id, msg.reply_to, wire.CancelReason.CLIENT_GONE)
        streams = self._tasks.get(msg.request_id, {})
        return self._end([task for task, tenant, resumed in streams.values()
                          if tenant == msg.tenant and resumed < msg.resumed_tokens],
                         wire.CancelReason.SUPERSEDED)

    def reader_gone(self, request_id: str, reply_to: str) -> int:
        """Cancel the stream of ``request_id`` to ``reply_to``, which nothing subscribes
        to any more (a gateway or client that died without a word). How many (0 or 1)."""
        return self._stream(request_id, reply_to, wire.CancelReason.READER_GONE)

    def _stream(self, request_id: str, reply_to: str, reason: wire.CancelReason) -> int:
        found = self._tasks.get(request_id, {}).get(reply_to)
        return self._end([found[0]] if found else [], reason)

    def _end(self, doomed: list[asyncio.Task[object]], reason: wire.CancelReason) -> int:
        doomed = [t for t in doomed if not t.done()]
        for task in doomed:
            self._cancelled[task] = reason
            task.cancel()
        return len(doomed)

    def by_client(self) -> wire.CancelReason | None:
        """Why the current task was cancelled by a client's message (None: it was not;
        its router is stopping)."""
        task = asyncio.current_task()
        return None if task is None else self._cancelled.get(task)


async def cancel_nodes(bus: Bus, request_id: str, nodes: list[str],
                       choice: int | None = None) -> None:
    """Tell ``nodes`` to stop generating ``request_id`` (or only its ``choice``; at most
    once delivered: a node that misses it generates to the end into an inbox nobody
    reads)."""
    for node in filter(None, nodes):
        with contextlib.suppress(CpdError):
            await bus.publish(subjects.cancel(node),
                              wire.Cancel(request_id=request_id, choice=choice))
