"""Request/reply and streamed replies over one wildcard inbox subscription: the engine
of ``Bus.request`` and of :class:`~cpd.bus.stream.StreamReader`.

nats-py's ``Client.request`` works the same way (one ``<inbox>.*`` subscription, a
future per request), but spends about 30 µs more of CPU on each call: a NUID plus two
random bytes from the OS per token, the subjects validated twice, ``asyncio.wait_for``.
On the hottest request of the system, the router's kvindex lookup, that was a third of
the caller's CPU (docs/benchmarks/kvindex.md: 85 → 57 µs per request at 5,000/s).
Here a token is 64 random bits (about 1 µs: a peer that sees one reply subject, as
every worker the router dispatches to does, cannot guess another request's and answer
it), and the deadline is one timer handle.

A stream's inbox (:class:`StreamInbox`) is a token under the same subscription. nats-py's
own per-stream subscription costs a SUB and an UNSUB per stream and, per message, a
NUID, two tasks and ``asyncio.wait_for`` in ``next_msg`` (30-60 µs measured on a
two-core host; a token passes two streams, worker to router and router to gateway).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from cpd.bus.local import LocalHub, send
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode, NoResponders, RequestTimeout

__all__ = ["ReplyMux", "StreamInbox", "is_no_reader", "is_no_responders"]

_STATUS = "Status"
_NO_RESPONDERS = "503"


def is_no_responders(msg: Msg) -> bool:
    """Whether ``msg`` is the server's 503 status: nothing subscribes to the subject."""
    return bool(msg.headers) and msg.headers.get(_STATUS) == _NO_RESPONDERS


# A deadline timer that fires this late (s) found the event loop busy past it (a burst
# of requests being admitted): the reply may have come in time and sit unread.
_LATE_S = 0.01
_GRACE_MAX_S = 1.0


def _expire(fut: asyncio.Future[Msg], due: float, again: bool = True) -> None:
    """Fail ``fut`` at its deadline ``due`` (loop time). A timer that fires late first
    lets the loop read what arrived meanwhile, once: the timer runs before the loop
    polls its sockets, so a reply that came in time would otherwise count as missing."""
    if fut.done():
        return
    loop = fut.get_loop()
    late = loop.time() - due
    if again and late >= _LATE_S:
        grace = min(late, _GRACE_MAX_S)  # as long again as the loop was late
        loop.call_later(grace, _expire, fut, loop.time() + grace, False)
        return
    fut.set_exception(TimeoutError())


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_NO_READER = wire.encode(wire.Error(code=ErrorCode.NO_RESPONDERS,
                                    message="the stream's reader closed its inbox"))


def is_no_reader(msg: Msg) -> bool:
    """Whether ``msg`` is a connection's answer to a reader check on a stream inbox it
    closed ("nothing reads this stream"; a gone connection's is NATS' no-responders
    status, which :meth:`ReplyMux.request` raises)."""
    try:
        answer = wire.decode(msg.data)
    except CpdError:
        return False
    return isinstance(answer, wire.Error) and answer.code == ErrorCode.NO_RESPONDERS


class StreamInbox:
    """The inbox of one streamed reply: its messages queue here in arrival order.

    A waiting reader is woken, not handed the message: the message stays queued until
    the reader takes it, so a reader cancelled in the same loop turn as a message lands
    loses no message and still sees its cancellation."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self._queue: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, msg: Msg) -> None:
        """Queue ``msg`` and wake the reader."""
        self._queue.append(msg)
        if self._waiter is not None:
            _wake(self._waiter)

    async def get(self, timeout: float) -> Msg | None:
        """The next message, or ``None`` when none came within ``timeout`` seconds."""
        if not self._queue:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._queue.popleft() if self._queue else None


class ReplyMux:
    """Sends requests on one NATS connection and matches their replies by token.

    The subscription is made on the first request; nats-py re-subscribes it after a
    reconnect, so requests keep working across one. With a ``hub``, requests to
    endpoints of this process and replies from them skip NATS (:mod:`cpd.bus.local`)."""

    def __init__(self, nc: NatsClient, hub: LocalHub | None = None) -> None:
        self._nc = nc
        self._hub = hub
        self._prefix = ""
        self._starting = asyncio.Lock()
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._streams: dict[str, StreamInbox] = {}

    async def inbox_prefix(self) -> str:
        """The subject prefix of this connection's replies (subscribed on first use)."""
        if not self._prefix:
            await self._start()
        return self._prefix

    @property
    def pending(self) -> int:
        """Requests waiting for their reply."""
        return len(self._pending)

    async def _start(self) -> None:
        # Concurrent first requests must share one subscription, not race to make two.
        async with self._starting:
            if not self._prefix:
                prefix = self._nc.new_inbox() + "."
                await self._nc.subscribe(prefix + "*", cb=self._on_reply)
                self._prefix = prefix
                if self._hub is not None:
                    self._hub.add_inboxes(prefix, self)

    @property
    def streams(self) -> int:
        """Stream inboxes open."""
        return len(self._streams)

    def deliver(self, msg: Msg) -> bool:
        """Hand ``msg`` to the request or the stream its subject names; ``False`` when
        none of them is open here."""
        token = msg.subject[len(self._prefix):]
        fut = self._pending.pop(token, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(msg)
        elif (box := self._streams.get(token)) is not None:
            box.put(msg)
        else:
            return False
        return True

    async def _on_reply(self, msg: Msg) -> None:
        if not self.deliver(msg) and msg.reply:
            # A sender's reader check (a keep-alive sent as a request) on a stream this
            # connection closed: the subscription lives on for other streams, so NATS
            # cannot answer "no responders" for it; the answer says so instead.
            await self._nc.publish(msg.reply, _NO_READER)

    async def open_stream(self) -> StreamInbox:
        """A new stream inbox under this connection's prefix (its token unguessable);
        its messages queue until :meth:`close_stream`."""
        if not self._prefix:
            await self._start()
        token = secrets.token_hex(8)
        box = self._streams[token] = StreamInbox(self._prefix + token)
        return box

    def close_stream(self, box: StreamInbox) -> None:
        """Stop queueing ``box``'s messages: later ones are dropped, as after an UNSUB."""
        self._streams.pop(box.subject[len(self._prefix):], None)

    async def request(self, subject: str, payload: bytes, *, timeout: float,
                      headers: dict[str, Any] | None = None) -> Msg:
        """Publish ``payload`` on ``subject`` and return the reply.

        Raises :class:`~cpd.protocol.errors.NoResponders` when nothing subscribes to ``subject``
        (the server's 503 status) and :class:`~cpd.protocol.errors.RequestTimeout` when no reply
        came within ``timeout`` seconds."""
        if not self._prefix:
            await self._start()
        token = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = fut
        timer = loop.call_later(timeout, _expire, fut, loop.time() + timeout)
        try:
            await send(self._nc, self._hub, subject, payload, reply=self._prefix + token,
                       headers=headers)
            msg = await fut
        except TimeoutError:
            raise RequestTimeout(f"no reply on {subject} within {timeout}s") from None
        finally:
            timer.cancel()
            self._pending.pop(token, None)
        if is_no_responders(msg):
            raise NoResponders(f"no responders on {subject}")
        return msg
