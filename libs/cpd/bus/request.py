"""Typed publish, request and streaming request over one NATS connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from cpd.bus.local import LocalHub, send
from cpd.bus.replymux import ReplyMux, StreamInbox
from cpd.ops import telemetry
from cpd.ops.config import BusSettings, Settings
from cpd.protocol import wire
from cpd.protocol.errors import (
    CpdError,
    ErrorCode,
    PayloadTooLarge,
    RequestTimeout,
    error_from_wire,
)

from .connection import connect
from .stream import StreamReader

T = TypeVar("T", bound=wire.Message)

log = telemetry.get_logger("cpd.bus")


_HEADER_PREAMBLE = len(b"NATS/1.0\r\n") + len(b"\r\n")


def encoded_size(payload: bytes, headers: dict[str, str] | None) -> int:
    """Bytes the server counts against its limit: payload plus encoded headers."""
    if not headers:
        return len(payload)
    hdr = sum(len(k.encode()) + len(str(v).encode()) + 4 for k, v in headers.items())
    return len(payload) + _HEADER_PREAMBLE + hdr


class Bus:
    """A NATS connection that speaks :mod:`cpd.protocol.wire`; with a ``hub``, what it
    sends to another service of this process is delivered without NATS
    (:mod:`cpd.bus.local`)."""

    def __init__(self, nc: NatsClient, settings: BusSettings | None = None, *,
                 hub: LocalHub | None = None) -> None:
        self.nc = nc
        self.settings = settings or BusSettings()
        self.hub = hub
        self._replies = ReplyMux(nc, hub)

    @classmethod
    async def open(cls, settings: Settings, name: str, *, url: str | None = None,
                   hub: LocalHub | None = None) -> Bus:
        """Connect and wrap; ``url`` (one server) replaces ``settings.nats.servers``."""
        return cls(await connect(settings.nats, name, url=url), settings.bus, hub=hub)

    async def reply_prefix(self) -> str:
        """The subject prefix every reply to this connection's requests arrives on."""
        return await self._replies.inbox_prefix()

    async def stream_inbox(self) -> StreamInbox:
        """A new inbox for a streamed reply, under :meth:`reply_prefix`."""
        return await self._replies.open_stream()

    def close_stream_inbox(self, box: StreamInbox) -> None:
        """Close a stream's inbox (:meth:`stream_inbox`)."""
        self._replies.close_stream(box)

    @property
    def max_message_bytes(self) -> int:
        """The effective limit: ours, or the server's when that is smaller."""
        return min(self.settings.max_message_bytes, self.nc.max_payload or 1 << 62)

    def _prepare(self, msg: wire.Message, headers: dict[str, str] | None,
                 trace: bool = True) -> tuple[bytes, dict[str, str] | None]:
        payload = wire.encode(msg)
        hdrs = telemetry.inject(dict(headers or {})) if trace else headers
        size = encoded_size(payload, hdrs)
        if size > self.max_message_bytes:
            raise PayloadTooLarge(
                f"{msg.__struct_config__.tag} message is {size} bytes with headers; "
                f"the limit is {self.max_message_bytes}"
            )
        return payload, hdrs

    async def publish(self, subject: str, msg: wire.Message, *, reply: str = "",
                      headers: dict[str, str] | None = None, trace: bool = True) -> None:
        """Publish one message (size-checked; with trace context unless ``trace`` is off,
        as for a reply, whose receiver already holds the trace)."""
        payload, hdrs = self._prepare(msg, headers, trace)
        await send(self.nc, self.hub, subject, payload, reply=reply, headers=hdrs)

    async def request(self, subject: str, msg: wire.Message, *, expect: type[T],
                      timeout: float | None = None) -> T:
        """One request, one reply of kind ``expect`` (a ``wire.Error`` reply is raised)."""
        payload, hdrs = self._prepare(msg, None)
        reply = await self._replies.request(
            subject, payload, timeout=timeout or self.settings.request_timeout_s,
            headers=hdrs)
        answer = wire.decode(reply.data)
        if isinstance(answer, wire.Error):
            raise error_from_wire(answer.code, answer.message, answer.retryable, answer.node)
        if not isinstance(answer, expect):
            raise CpdError(f"expected {expect.__name__} from {subject}, got "
                           f"{type(answer).__name__}", code=ErrorCode.MALFORMED)
        return answer

    async def request_bytes(self, subject: str, data: bytes, *, timeout: float) -> Msg:
        """One request of raw bytes (e.g. a fuzzer's), its reply as received; replies
        arrive under :meth:`reply_prefix`. Raises ``NoResponders`` and
        ``RequestTimeout`` like :meth:`request`."""
        return await self._replies.request(subject, data, timeout=timeout)

    async def stream(self, subject: str, msg: wire.Message, *, timeout: float,
                     idle_timeout: float | None = None, silence_limit: float | None = None,
                     keepalive_misses: int = 0,
                     abandoned: tuple[str, Callable[[str], wire.Message]] | None = None
                     ) -> AsyncIterator[wire.Message]:
        """A streaming request: yields every reply message in ``seq`` order up to and
        including the final one; a ``wire.Error`` is raised, not yielded.

        Replies may come from several publishers (the first token from a prefill node,
        the rest from decode), so out-of-order arrivals are buffered and re-ordered; a
        missing sequence number that does not arrive within the idle timeout raises
        :class:`~cpd.protocol.errors.StreamGap`. The whole stream must end before ``timeout``.
        ``silence_limit`` and ``keepalive_misses``: the sender's keep-alive watchdog
        (:class:`StreamReader`). ``abandoned``: a subject and the message (built from the
        stream's inbox) published there when the caller stops reading before the end,
        so the sender can stop too.
        """
        idle = idle_timeout or self.settings.stream_idle_timeout_s
        deadline = time.monotonic() + timeout
        reader = StreamReader(self, idle_timeout=idle, subject=subject,
                              silence_limit=silence_limit, keepalive_misses=keepalive_misses)
        inbox = await reader.open()
        ended = False  # a final message or an error: the sender is done
        try:
            payload, hdrs = self._prepare(msg, None)
            await send(self.nc, self.hub, subject, payload, reply=inbox, headers=hdrs)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    ended = True
                    raise RequestTimeout(f"stream on {subject} did not end within {timeout}s")
                try:
                    reply = await reader.next(min(left, idle))
                except CpdError:
                    ended = True
                    raise
                if reply is None:
                    if reader.gap_pending or time.monotonic() >= deadline:
                        continue  # reported by next() or by the deadline check
                    ended = True
                    raise RequestTimeout(f"stream on {subject} idle for {idle}s")
                ended = isinstance(reply, wire.Final)
                yield reply
                if ended:
                    return
        finally:
            await reader.close()
            if not ended and abandoned is not None and self.nc.is_connected:
                with contextlib.suppress(Exception):
                    await self.publish(abandoned[0], abandoned[1](inbox))

    async def close(self) -> None:
        """Drain (when connected) and close the connection, even with NATS gone: a
        client left reconnecting keeps its tasks alive and the process never exits."""
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), self.nc.options["drain_timeout"] + 1)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()


