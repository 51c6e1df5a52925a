"""Streamed replies: the reading half (sequence numbers checked, an explicit end) and the
sending half (:class:`ReplyStream`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from cpd.bus.replymux import StreamInbox, is_no_reader, is_no_responders
from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import (
    Cancelled,
    CpdError,
    ErrorCode,
    NoResponders,
    RouterGone,
    StreamGap,
    error_from_wire,
)

if TYPE_CHECKING:
    from .request import Bus

T = TypeVar("T", bound=wire.Message)

log = telemetry.get_logger("cpd.bus")


class StreamReader:
    """The receiving half of a streamed reply: an inbox whose messages come out in
    ``seq`` order, whoever published them.

    A ``wire.Error`` in order is raised as its typed exception; a sequence number that
    stays missing for ``idle_timeout`` while later ones wait raises
    :class:`~cpd.protocol.errors.StreamGap`; a NATS no-responders status raises
    :class:`~cpd.protocol.errors.NoResponders`.

    Keep-alives (``TokenChunk.keepalive_ms``; the router's, ReplyStream.keepalive) are
    consumed here, never returned. With ``silence_limit`` set, nothing at all received
    for that long raises :class:`~cpd.protocol.errors.RouterGone`, and a gap is given at most that
    long; each keep-alive resets the limit to ``keepalive_misses`` of its interval.
    """

    def __init__(self, bus: Bus, *, idle_timeout: float, subject: str = "",
                 silence_limit: float | None = None, keepalive_misses: int = 0) -> None:
        self.bus = bus
        self.idle_timeout = idle_timeout
        self.subject = subject
        self.silence_limit = silence_limit
        self.keepalive_misses = keepalive_misses
        self.inbox = ""
        self._box: StreamInbox | None = None
        self._expected = 0
        self._early: dict[int, wire.Message] = {}
        self._gap_since = 0.0
        self._heard = 0.0
        # The highest seq the sender proved it sent (an out-of-band keep-alive repeats
        # it): at or past _expected, a message was lost even with nothing queued behind.
        self._sent_upto = -1

    async def open(self) -> str:
        """Open the stream's inbox (a token under the connection's reply subscription,
        unguessable to a peer that has seen another stream's); returns it, to name as
        the stream's destination."""
        self._box = await self.bus.stream_inbox()
        self.inbox = self._box.subject
        self._heard = time.monotonic()
        return self.inbox

    @property
    def gap_pending(self) -> bool:
        """Later messages wait for a missing one."""
        return bool(self._early) or self._expected <= self._sent_upto

    def _keepalive(self, msg: wire.TokenChunk) -> None:
        """Take a keep-alive: the first one of a stream is in band (seq 0), later ones
        repeat the last seq sent (older readers drop them as duplicates)."""
        if self.keepalive_misses:
            self.silence_limit = msg.keepalive_ms / 1000 * self.keepalive_misses
        if msg.seq == 0 and self._expected == 0:
            self._expected = 1
            self._gap_since = time.monotonic() if self._early else 0.0
        elif msg.seq >= self._expected and msg.seq > self._sent_upto:
            if not self.gap_pending:
                self._gap_since = time.monotonic()
            self._sent_upto = msg.seq

    async def next(self, timeout: float) -> wire.Message | None:
        """The next message in order, or ``None`` when none came within ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            if self._expected in self._early:
                reply = self._early.pop(self._expected)
                self._expected += 1
                self._gap_since = time.monotonic() if self.gap_pending else 0.0
                if isinstance(reply, wire.Error):
                    raise error_from_wire(reply.code, reply.message, reply.retryable,
                                          reply.node)
                return reply
            now = time.monotonic()
            gap_limit = min(self.idle_timeout, self.silence_limit or self.idle_timeout)
            if self.gap_pending and now - self._gap_since >= gap_limit:
                raise StreamGap(f"stream on {self.subject or self.inbox}: message "
                                f"{self._expected} never came (have {sorted(self._early)})")
            if self.silence_limit is not None and now - self._heard >= self.silence_limit:
                raise RouterGone(f"nothing on {self.subject or self.inbox} for "
                                 f"{self.silence_limit:.1f}s, keep-alives included: its "
                                 f"sender died or is cut off")
            if end - now <= 0:
                return None
            left = end - now
            if self.gap_pending:
                left = min(left, self._gap_since + gap_limit - now)
            if self.silence_limit is not None:
                left = min(left, self._heard + self.silence_limit - now)
            if self._box is None:
                raise CpdError(f"stream on {self.subject or self.inbox}: the reader is "
                               "not open")
            raw = await self._box.get(max(left, 0.001))
            if raw is None:
                if self.bus.nc.is_closed:
                    raise CpdError(f"stream on {self.subject or self.inbox}: the NATS "
                                   "connection is closed", code=ErrorCode.UNAVAILABLE,
                                   retryable=True)
                continue
            self._heard = time.monotonic()
            if is_no_responders(raw):
                raise NoResponders(f"no responders on {self.subject or self.inbox}")
            reply = wire.decode(raw.data)
            if isinstance(reply, wire.TokenChunk) and reply.keepalive_ms:
                self._keepalive(reply)
                continue
            seq = getattr(reply, "seq", self._expected)
            if isinstance(reply, wire.Error) and seq <= self._expected:
                raise error_from_wire(reply.code, reply.message, reply.retryable, reply.node)
            if seq < self._expected:
                continue  # duplicate delivery
            if not self._early:
                self._gap_since = time.monotonic()
            self._early[seq] = reply

    async def close(self) -> None:
        """Close the inbox: what arrives later is dropped."""
        if self._box is not None:
            self.bus.close_stream_inbox(self._box)
            self._box = None


class ReplyStream:
    """The sending half of one streamed reply (to ``reply_to``)."""

    def __init__(self, bus: Bus, reply_to: str, request_id: str, seq_start: int = 0, *,
                 on_error: Callable[[wire.Error], None] | None = None) -> None:
        self.bus = bus
        self._on_error = on_error  # told of the error the stream ends with
        self.reply_to = reply_to
        self.request_id = request_id
        self.seq = seq_start
        self.closed = False
        self.last_sent = time.monotonic()  # for keep-alives on silent streams

    @property
    def sent_any(self) -> bool:
        """Whether the stream has a message on it (this sender's, or, for a stream this
        sender continues, the previous sender's): a keep-alive then repeats the last seq,
        out of band."""
        return self.seq > 0

    async def _send(self, msg: wire.Message) -> None:
        if self.closed:
            raise CpdError(f"stream of {self.request_id} already ended")
        self.seq += 1
        self.last_sent = time.monotonic()
        await self.bus.publish(self.reply_to, msg)

    async def keepalive(self, interval_ms: int) -> None:
        """Tell the receiver this sender is alive and will send something at least every
        ``interval_ms`` (an empty TokenChunk with ``keepalive_ms``; no-op once ended).

        The first message of a stream takes seq 0 (older readers see an empty chunk);
        every later keep-alive repeats the last seq sent, out of band: losing one opens
        no gap, older readers drop it as a duplicate, and one that arrives ahead of a
        missing message proves that message lost (StreamReader)."""
        if self.closed:
            return
        if self.seq == 0:
            await self._send(wire.TokenChunk(request_id=self.request_id, seq=0,
                                             token_ids=[], keepalive_ms=interval_ms))
            return
        self.last_sent = time.monotonic()
        await self.bus.publish(self.reply_to, self._keepalive(interval_ms))

    def _keepalive(self, interval_ms: int) -> wire.TokenChunk:
        return wire.TokenChunk(request_id=self.request_id, seq=self.seq - 1, token_ids=[],
                               keepalive_ms=interval_ms)

    async def probe(self, interval_ms: int, timeout_s: float) -> bool:
        """Whether anything still reads this stream: a keep-alive (as :meth:`keepalive`
        sends once the stream has a message) published as a request: NATS answers it
        with its no-responders status when the reader's connection is gone, and that
        connection answers it for an inbox its reader closed (both False). An open
        reader never answers it: a keep-alive delivered, or no answer either way, is
        True, as is a stream that ended or has sent nothing yet."""
        if self.closed or self.seq == 0:
            return True
        self.last_sent = time.monotonic()
        try:
            answer = await self.bus.request_bytes(self.reply_to, wire.encode(
                self._keepalive(interval_ms)), timeout=timeout_s)
        except NoResponders:
            return False
        except CpdError:  # no answer: delivered (or the connection is down: unknown)
            return True
        return not is_no_reader(answer)  # a closed inbox's answer (ReplyMux)

    async def tokens(self, token_ids: list[int], text: str = "", *,
                     ends_with_stop_token: bool = False,
                     logprobs: list[wire.TokenLogprob] | None = None,
                     index: int = 0) -> None:
        """Send generated tokens of choice ``index`` (the last one the stop token that
        ended it, when ``ends_with_stop_token``), with their log probabilities when
        asked."""
        await self._send(wire.TokenChunk(request_id=self.request_id, seq=self.seq,
                                         token_ids=token_ids, text=text,
                                         ends_with_stop_token=ends_with_stop_token,
                                         logprobs=logprobs or [], index=index))

    async def handoff_accepted(self, node: str) -> None:
        """Say on the stream that ``node`` took the hand-off and owns the rest of it."""
        await self._send(wire.HandoffAccepted(request_id=self.request_id, seq=self.seq,
                                              node=node))

    async def report(self, kind: type[wire.PrefillReport] | type[wire.DecodeReport],
                     **fields: Any) -> None:
        """Send this sender's report of its part of the request (its fields)."""
        await self._send(kind(request_id=self.request_id, seq=self.seq, **fields))

    def hand_over(self) -> None:
        """This sender's part ended without a final message: another node took the
        request and continues the stream (from :attr:`seq`); nothing more goes out here,
        not even an error."""
        self.closed = True

    async def final(self, **fields: Any) -> None:
        """End the stream successfully (usage, timings, route...)."""
        await self._send(wire.Final(request_id=self.request_id, seq=self.seq, **fields))
        self.closed = True

    async def error(self, exc: BaseException) -> None:
        """End the stream with a typed error (no-op when already ended). An exception
        that is not a :class:`CpdError` is a bug: it is logged with its traceback here,
        where it is still known, and reaches the receiver as ``internal``."""
        if self.closed:
            return
        if not isinstance(exc, CpdError | asyncio.CancelledError):
            log.error("stream.failed", request_id=self.request_id, exc_info=exc)
        err = error_message(exc, self.request_id, self.seq)
        self.closed = True
        if self._on_error is not None:
            self._on_error(err)
        with contextlib.suppress(Exception):
            await self.bus.publish(self.reply_to, err)


def error_message(exc: BaseException, request_id: str = "", seq: int = 0) -> wire.Error:
    if isinstance(exc, CpdError):
        return wire.Error(request_id=request_id, seq=seq, code=exc.code.value,
                          message=exc.message, retryable=exc.retryable, node=exc.node)
    if isinstance(exc, asyncio.CancelledError):
        return wire.Error(request_id=request_id, seq=seq, code=Cancelled.code.value,
                          message="request cancelled (service stopping)", retryable=True)
    return wire.Error(request_id=request_id, seq=seq, code=ErrorCode.INTERNAL.value,
                      message=f"internal error: {exc!r}", retryable=False)


