"""NATS helpers with CPD's rules (DESIGN.md §4).

* :func:`connect` - a client that reconnects forever and logs its state changes.
* :class:`Bus` - typed publish / request / *streaming* request over that client:
  messages are :mod:`cpd.wire` structs, W3C trace context rides in the headers, every
  message passes a header-aware size guard, no-responders (503) and timeouts become
  :mod:`cpd.errors` exceptions, and a ``wire.Error`` reply is raised as one.
* :class:`ReplyStream` - the sending half of a streamed reply: sequence numbers and an
  explicit final or error message, after which nothing more can be sent.
* :class:`Service` - base of every CPD service: endpoints (queue groups, concurrent
  handlers, typed errors for bad input), NATS micro health/info/stats
  (``$SRV.PING|INFO|STATS``), and a graceful start, drain and stop on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.micro
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import telemetry, wire
from .config import BusSettings, NatsSettings, Settings
from .errors import (
    Cancelled,
    CpdError,
    ErrorCode,
    NoResponders,
    PayloadTooLarge,
    RequestTimeout,
    StreamGap,
    error_from_wire,
)

__all__ = [
    "Bus",
    "ReplyStream",
    "Service",
    "StreamReader",
    "connect",
    "encoded_size",
]

T = TypeVar("T", bound=wire.Message)

_STATUS = "Status"
_NO_RESPONDERS = "503"
_HEADER_PREAMBLE = len(b"NATS/1.0\r\n") + len(b"\r\n")

log = telemetry.get_logger("cpd.bus")


async def connect(settings: NatsSettings, name: str, *, url: str | None = None) -> NatsClient:
    """Connect to NATS with reconnect handling and state-change logging."""

    async def on_error(e: Exception) -> None:
        log.warning("nats.error", client=name, error=repr(e))

    async def on_disconnect() -> None:
        nc = holder.get("nc")
        if nc is None or not (nc.is_closed or nc.is_draining):  # not our own close()
            log.warning("nats.disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats.reconnected", client=name)

    options: dict[str, Any] = {
        "servers": [url or settings.url],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "reconnect_time_wait": settings.reconnect_wait_s,
        "max_reconnect_attempts": settings.max_reconnect_attempts,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "drain_timeout": settings.drain_timeout_s,
    }
    if settings.user:
        options["user"], options["password"] = settings.user, settings.password
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    holder: dict[str, NatsClient] = {}
    try:
        holder["nc"] = await nats.connect(**options)
        return holder["nc"]
    except (OSError, nats.errors.Error) as e:
        raise CpdError(f"cannot connect to NATS at {options['servers'][0]}: {e!r}",
                       code=ErrorCode.UNAVAILABLE, retryable=True) from e


def encoded_size(payload: bytes, headers: dict[str, str] | None) -> int:
    """Bytes the server counts against its limit: payload plus encoded headers."""
    if not headers:
        return len(payload)
    hdr = sum(len(k.encode()) + len(str(v).encode()) + 4 for k, v in headers.items())
    return len(payload) + _HEADER_PREAMBLE + hdr


class Bus:
    """A NATS connection that speaks :mod:`cpd.wire`."""

    def __init__(self, nc: NatsClient, settings: BusSettings | None = None) -> None:
        self.nc = nc
        self.settings = settings or BusSettings()

    @classmethod
    async def open(cls, settings: Settings, name: str, *, url: str | None = None) -> Bus:
        """Connect and wrap; ``url`` overrides ``settings.nats.url``."""
        return cls(await connect(settings.nats, name, url=url), settings.bus)

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
        await self.nc.publish(subject, payload, reply=reply, headers=hdrs or None)

    async def request(self, subject: str, msg: wire.Message, *, expect: type[T],
                      timeout: float | None = None) -> T:
        """One request, one reply of kind ``expect`` (a ``wire.Error`` reply is raised)."""
        payload, hdrs = self._prepare(msg, None)
        timeout = timeout or self.settings.request_timeout_s
        try:
            reply = await self.nc.request(subject, payload, timeout=timeout, headers=hdrs)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"no responders on {subject}") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"no reply on {subject} within {timeout}s") from None
        answer = wire.decode(reply.data)
        if isinstance(answer, wire.Error):
            raise error_from_wire(answer.code, answer.message, answer.retryable)
        if not isinstance(answer, expect):
            raise CpdError(f"expected {expect.__name__} from {subject}, got "
                           f"{type(answer).__name__}", code=ErrorCode.MALFORMED)
        return answer

    async def stream(self, subject: str, msg: wire.Message, *, timeout: float,
                     idle_timeout: float | None = None) -> AsyncIterator[wire.Message]:
        """A streaming request: yields every reply message in ``seq`` order up to and
        including the final one; a ``wire.Error`` is raised, not yielded.

        Replies may come from several publishers (the first token from a prefill node,
        the rest from decode), so out-of-order arrivals are buffered and re-ordered; a
        missing sequence number that does not arrive within the idle timeout raises
        :class:`~cpd.errors.StreamGap`. The whole stream must end before ``timeout``.
        """
        idle = idle_timeout or self.settings.stream_idle_timeout_s
        deadline = time.monotonic() + timeout
        reader = StreamReader(self, idle_timeout=idle, subject=subject)
        inbox = await reader.open()
        try:
            payload, hdrs = self._prepare(msg, None)
            await self.nc.publish(subject, payload, reply=inbox, headers=hdrs)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"stream on {subject} did not end within {timeout}s")
                reply = await reader.next(min(left, idle))
                if reply is None:
                    if reader.gap_pending or time.monotonic() >= deadline:
                        continue  # reported by next() or by the deadline check
                    raise RequestTimeout(f"stream on {subject} idle for {idle}s")
                yield reply
                if isinstance(reply, wire.Final):
                    return
        finally:
            await reader.close()

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


class StreamReader:
    """The receiving half of a streamed reply: an inbox whose messages come out in
    ``seq`` order, whoever published them.

    A ``wire.Error`` in order is raised as its typed exception; a sequence number that
    stays missing for ``idle_timeout`` while later ones wait raises
    :class:`~cpd.errors.StreamGap`; a NATS no-responders status raises
    :class:`~cpd.errors.NoResponders`.
    """

    def __init__(self, bus: Bus, *, idle_timeout: float, subject: str = "") -> None:
        self.bus = bus
        self.idle_timeout = idle_timeout
        self.subject = subject
        self.inbox = ""
        self._sub: Any = None
        self._expected = 0
        self._early: dict[int, wire.Message] = {}
        self._gap_since = 0.0

    async def open(self) -> str:
        """Subscribe; returns the inbox to name as the stream's destination."""
        self.inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(self.inbox)
        return self.inbox

    @property
    def gap_pending(self) -> bool:
        """Later messages wait for a missing one."""
        return bool(self._early)

    async def next(self, timeout: float) -> wire.Message | None:
        """The next message in order, or ``None`` when none came within ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            if self._expected in self._early:
                reply = self._early.pop(self._expected)
                self._expected += 1
                self._gap_since = time.monotonic() if self._early else 0.0
                if isinstance(reply, wire.Error):
                    raise error_from_wire(reply.code, reply.message, reply.retryable)
                return reply
            now = time.monotonic()
            if self._early and now - self._gap_since >= self.idle_timeout:
                raise StreamGap(f"stream on {self.subject or self.inbox}: message "
                                f"{self._expected} never came (have {sorted(self._early)})")
            left = end - now
            if self._early:
                left = min(left, self._gap_since + self.idle_timeout - now)
            if left <= 0:
                return None
            try:
                raw = await self._sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                continue
            if raw.headers and raw.headers.get(_STATUS) == _NO_RESPONDERS:
                raise NoResponders(f"no responders on {self.subject or self.inbox}")
            reply = wire.decode(raw.data)
            seq = getattr(reply, "seq", self._expected)
            if isinstance(reply, wire.Error) and seq <= self._expected:
                raise error_from_wire(reply.code, reply.message, reply.retryable)
            if seq < self._expected:
                continue  # duplicate delivery
            if not self._early:
                self._gap_since = time.monotonic()
            self._early[seq] = reply

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


class ReplyStream:
    """The sending half of one streamed reply (to ``reply_to``)."""

    def __init__(self, bus: Bus, reply_to: str, request_id: str, seq_start: int = 0) -> None:
        self.bus = bus
        self.reply_to = reply_to
        self.request_id = request_id
        self.seq = seq_start
        self.closed = False

    async def _send(self, msg: wire.Message) -> None:
        if self.closed:
            raise CpdError(f"stream of {self.request_id} already ended")
        self.seq += 1
        await self.bus.publish(self.reply_to, msg)

    async def tokens(self, token_ids: list[int], text: str = "") -> None:
        """Send generated tokens."""
        await self._send(wire.TokenChunk(request_id=self.request_id, seq=self.seq,
                                         token_ids=token_ids, text=text))

    async def final(self, **fields: Any) -> None:
        """End the stream successfully (usage, timings, route...)."""
        await self._send(wire.Final(request_id=self.request_id, seq=self.seq, **fields))
        self.closed = True

    async def error(self, exc: BaseException) -> None:
        """End the stream with a typed error (no-op when already ended)."""
        if self.closed:
            return
        err = _error_message(exc, self.request_id, self.seq)
        self.closed = True
        with contextlib.suppress(Exception):
            await self.bus.publish(self.reply_to, err)


def _error_message(exc: BaseException, request_id: str = "", seq: int = 0) -> wire.Error:
    if isinstance(exc, CpdError):
        return wire.Error(request_id=request_id, seq=seq, code=exc.code.value,
                          message=exc.message, retryable=exc.retryable)
    if isinstance(exc, asyncio.CancelledError):
        return wire.Error(request_id=request_id, seq=seq, code=Cancelled.code.value,
                          message="request cancelled (service stopping)", retryable=True)
    return wire.Error(request_id=request_id, seq=seq, code=ErrorCode.INTERNAL.value,
                      message=f"internal error: {exc!r}", retryable=False)


Handler = Callable[[Any, "Request"], Awaitable[wire.Message | None]]


class Request:
    """What a handler gets besides the decoded message."""

    def __init__(self, service: Service, msg: Msg) -> None:
        self.service = service
        self.subject = msg.subject
        self.reply_to = msg.reply
        self.headers = msg.headers or {}

    def stream(self, request_id: str, seq_start: int = 0) -> ReplyStream:
        """A reply stream to this request's inbox."""
        return ReplyStream(self.service.bus, self.reply_to, request_id, seq_start)


class Service:
    """Base of every CPD service process.

    Subclasses implement :meth:`setup` and call :meth:`add_endpoint` there. A handler
    receives the decoded message and a :class:`Request`; what it returns (if anything)
    is sent as the single reply. Bad input never reaches it: undecodable, foreign-version
    or wrong-kind messages are answered with a typed ``wire.Error`` and counted.
    """

    name: str = "service"
    version: str = "0.1.0"

    def __init__(self, settings: Settings, *, nats_url: str | None = None) -> None:
        self.settings = settings
        self.node_id = settings.node.node_id
        self.nats_url = nats_url
        self.bus: Bus
        self._micro: nats.micro.Service | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self.rejected = 0
        self.log = telemetry.get_logger(f"cpd.{self.name}", node=self.node_id)
        self._rejections = telemetry.meter().create_counter(
            "cpd_rejected_messages_total", description="messages refused as bad input")

    # -- lifecycle -------------------------------------------------------------------

    async def prepare(self) -> None:
        """Slow local start-up before NATS is connected, e.g. loading an engine (override).

        A connection whose event loop is blocked for minutes is dropped by the server as
        stale; doing such work before connecting avoids that.
        """

    async def setup(self) -> None:
        """Register endpoints and subscriptions (override)."""

    async def on_stop(self) -> None:
        """Release resources after endpoints stopped and in-flight work drained (override)."""

    async def start(self) -> None:
        """Prepare, connect, register endpoints, and announce the service."""
        await self.prepare()
        self.bus = await Bus.open(self.settings, f"cpd-{self.name}-{self.node_id}",
                                  url=self.nats_url)
        self._micro = await nats.micro.add_service(
            self.bus.nc, name=f"cpd-{self.name}", version=self.version,
            description=f"CPD {self.name}", metadata={"node": self.node_id},
        )
        await self.setup()
        # Subscriptions are registered on the server once start() returns.
        await self.bus.nc.flush()
        self.log.info("service.started", nats=self.nats_url or self.settings.nats.url)

    async def stop(self) -> None:
        """Graceful stop: stop taking work, let in-flight handlers finish, drain, close."""
        if self._stopped.is_set():
            return
        self._stopping.set()
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
        for task in self._background:
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks,
                                            timeout=self.settings.nats.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        with contextlib.suppress(Exception):
            await self.on_stop()
        await self.bus.close()
        self._stopped.set()
        self.log.info("service.stopped")

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop (signal handlers call this)."""
        self._stopping.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or :meth:`request_stop`), then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except BaseException:
            # A start that failed part-way may hold engines, files or a connection.
            with contextlib.suppress(Exception):
                await self.on_stop()
            if hasattr(self, "bus"):
                await self.bus.close()
            raise
        try:
            await self._stopping.wait()
        finally:
            await self.stop()

    # -- endpoints -------------------------------------------------------------------

    async def add_endpoint(self, name: str, subject: str, handler: Handler, *,
                           expect: type[wire.Message], queue: str | None = None,
                           inline: bool = False) -> None:
        """Serve ``subject`` (in queue group ``queue``, else a per-node group).

        Handlers run as tasks so slow ones do not block the subscription; ``inline``
        handlers (fast, CPU-only, e.g. index lookups) run in the subscription callback,
        which saves a task per message.
        """
        assert self._micro is not None, "call add_endpoint from setup()"

        async def on_request(req: nats.micro.Request) -> None:
            if self._stopping.is_set():
                await self._reply_error(req._msg, CpdError("service is stopping",
                                                           code=ErrorCode.UNAVAILABLE,
                                                           retryable=True))
                return
            if inline:
                await self._dispatch(name, req._msg, handler, expect)
                return
            task = asyncio.create_task(self._dispatch(name, req._msg, handler, expect))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        await self._micro.add_endpoint(name=name, subject=subject, handler=on_request,
                                       queue_group=queue or f"{self.name}-{self.node_id}")

    async def _dispatch(self, name: str, msg: Msg, handler: Handler,
                        expect: type[wire.Message]) -> None:
        ctx = telemetry.extract(msg.headers)
        with telemetry.tracer().start_as_current_span(
            f"{self.name}.{name}", context=ctx, kind=SpanKind.SERVER,
            attributes={"messaging.destination": msg.subject, "cpd.node": self.node_id},
        ) as span:
            try:
                request = wire.decode(msg.data, expect)
            except CpdError as e:
                self.rejected += 1
                self._rejections.add(1, {"service": self.name, "reason": e.code.value})
                self.log.warning("message.rejected", endpoint=name, error=e.code.value,
                                 detail=e.message)
                span.set_status(Status(StatusCode.ERROR, e.code.value))
                await self._reply_error(msg, e)
                return
            request_id = getattr(request, "request_id", "")
            with telemetry.bound_request(request_id):
                try:
                    answer = await handler(request, Request(self, msg))
                except Exception as e:  # every failure becomes a typed reply
                    span.record_exception(e)
                    span.set_status(Status(StatusCode.ERROR, repr(e)))
                    if not isinstance(e, CpdError):
                        self.log.exception("handler.failed", endpoint=name)
                    await self._reply_error(msg, e, request_id)
                    return
                if answer is not None and msg.reply:
                    try:
                        await self.bus.publish(msg.reply, answer, trace=False)
                    except CpdError as e:
                        await self._reply_error(msg, e, request_id)

    async def _reply_error(self, msg: Msg, exc: BaseException, request_id: str = "") -> None:
        if not msg.reply:
            return
        with contextlib.suppress(Exception):
            await self.bus.publish(msg.reply, _error_message(exc, request_id), trace=False)

    def spawn(self, coro: Awaitable[None], name: str = "", *,
              background: bool = True) -> asyncio.Task[None]:
        """Run work owned by the service. ``background`` loops (sweepers, reporters) are
        cancelled at stop; other tasks are in-flight work that stop lets finish first."""
        task = asyncio.ensure_future(coro)
        group = self._background if background else self._tasks
        group.add(task)
        task.add_done_callback(group.discard)
        if name:
            task.set_name(name)
        return task

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()


def run_service(service: Service) -> None:
    """Run ``service`` until SIGTERM/SIGINT on uvloop when available (a faster event
    loop; the stdlib one otherwise)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(service.run())
    else:
        uvloop.run(service.run())


def current_span() -> trace.Span:
    """The span of the request being handled (for attributes and events)."""
    return trace.get_current_span()
