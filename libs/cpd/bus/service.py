"""The base of every CPD service: endpoints (queue groups, concurrent handlers, typed errors
for bad input), NATS micro health/info/stats, and a graceful start, drain and stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from nats.aio.msg import Msg
from opentelemetry.trace import Status, StatusCode

from cpd.ops import metrics, telemetry
from cpd.ops.config import Settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import (
    CpdError,
    ErrorCode,
    NatsRefused,
    PermissionDenied,
)

from .connection import (
    flush_all,
    identity_desc,
    permission_denials,
    wait_denied,
)
from .local import LocalHub
from .micro import MicroService
from .request import Bus
from .stream import ReplyStream, error_message

T = TypeVar("T", bound=wire.Message)
S = TypeVar("S", wire.Heartbeat, wire.LoadReport, wire.KvEvent)  # messages naming a node

log = telemetry.get_logger("cpd.bus")


Handler = Callable[[Any, "Request"], Awaitable[wire.Message | None]]


class Request:
    """What a handler gets besides the decoded message."""

    def __init__(self, service: Service, msg: Msg) -> None:
        self.service = service
        self.subject = msg.subject
        self.reply_to = msg.reply
        self.headers = msg.headers or {}
        # The error a stream to this request's inbox ended with (the endpoint's stats
        # count the request as failed even though the handler returned).
        self.error: wire.Error | None = None

    def stream(self, request_id: str, seq_start: int = 0) -> ReplyStream:
        """A reply stream to this request's inbox."""
        return ReplyStream(self.service.bus, self.reply_to, request_id, seq_start,
                           on_error=self._ended_with)

    def _ended_with(self, error: wire.Error) -> None:
        self.error = error


class Service:
    """Base of every CPD service process.

    Subclasses implement :meth:`setup` and call :meth:`add_endpoint` there. A handler
    receives the decoded message and a :class:`Request`; what it returns (if anything)
    is sent as the single reply. Bad input never reaches it: undecodable, foreign-version
    or wrong-kind messages are answered with a typed ``wire.Error`` and counted.
    """

    name: str = "service"
    version: str = "0.1.0"

    def __init__(self, settings: Settings, *, nats_url: str | None = None,
                 hub: LocalHub | None = None) -> None:
        """``hub``: the other services of this process, reached without NATS
        (:mod:`cpd.bus.local`)."""
        self.settings = settings
        self.node_id = settings.node.node_id
        self.nats_url = nats_url
        self.hub = hub
        self.bus: Bus
        self._micro: MicroService | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self.rejected = 0
        self.log = telemetry.get_logger(f"cpd.{self.name}", node=self.node_id)
        self._rejections = metrics.counter(telemetry.meter(), metrics.REJECTED_MESSAGES)

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
        """Prepare, connect, register endpoints, and announce the service. A start that
        fails part-way releases what it took (engines, files, the connection)."""
        try:
            await self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.on_stop()
            if hasattr(self, "bus"):
                await self.bus.close()
            raise

    async def _start(self) -> None:
        await self.prepare()
        self.bus = await Bus.open(self.settings, f"cpd-{self.name}-{self.node_id}",
                                  url=self.nats_url, hub=self.hub)
        self._micro = MicroService(self.bus.nc, name=f"cpd-{self.name}",
                                   version=self.version, description=f"CPD {self.name}",
                                   metadata={"node": self.node_id})
        await self._micro.start()
        # A process holding another identity's credentials is refused rights its job
        # needs: fail at once with a typed error rather than half-work (or wait out a
        # request the server dropped).
        setup = asyncio.ensure_future(self.setup())
        denied = asyncio.ensure_future(wait_denied(self.bus.nc))
        try:
            await asyncio.wait({setup, denied}, return_when=asyncio.FIRST_COMPLETED)
            if not denied.done():
                await setup  # raises what setup raised
                # Subscriptions are registered on the server once start() returns.
                await flush_all(self.bus.nc)
        finally:
            for task in (setup, denied):
                task.cancel()
            await asyncio.gather(setup, denied, return_exceptions=True)
        if refused := permission_denials(self.bus.nc):
            raise PermissionDenied(
                f"{self.name} {self.node_id}: NATS refused {refused[0]} - this process's "
                f"identity ({identity_desc(self.settings.nats)}) lacks a right the "
                f"service needs (another service's credentials?)")
        where = self.bus.nc.connected_url
        self.log.info("service.started", nats=where.netloc if where else "")

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

    async def stop_requested(self) -> None:
        """Return once a stop is asked (:meth:`request_stop`, or the service's own
        failure)."""
        await self._stopping.wait()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or :meth:`request_stop`), then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        await self.start()
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
        which saves a task per message. ``$SRV.STATS`` counts each request as it arrives
        and times it until its handler (the task) ends; a request answered with an error
        (bad input, a handler's error, a refusal while stopping) counts as an error.
        """
        assert self._micro is not None, "call add_endpoint from setup()"

        async def on_request(msg: Msg) -> str | None:
            if self._stopping.is_set():
                return await self._reply_error(msg, CpdError("service is stopping",
                                                             code=ErrorCode.UNAVAILABLE,
                                                             retryable=True))
            return await self._dispatch(name, msg, handler, expect)

        endpoint = await self._micro.add_endpoint(
            name, subject, on_request, queue_group=queue or f"{self.name}-{self.node_id}",
            spawn=None if inline else functools.partial(self.spawn, background=False))
        if self.hub is not None:
            self.hub.add_endpoint(endpoint)

    async def _dispatch(self, name: str, msg: Msg, handler: Handler,
                        expect: type[wire.Message]) -> str | None:
        """Decode ``msg``, run ``handler`` and send its answer; returns ``None``, or the
        error (``"<code>: <message>"``) the request was answered with."""
        with telemetry.server_span(
            f"{self.name}.{name}", msg.headers,
            {"messaging.destination": msg.subject, "cpd.node": self.node_id},
        ) as span:
            try:
                request = wire.decode(msg.data, expect)
            except CpdError as e:
                self.reject(msg.subject, e)
                span.set_status(Status(StatusCode.ERROR, e.code.value))
                return await self._reply_error(msg, e)
            request_id = getattr(request, "request_id", "")
            with telemetry.bound_request(request_id):
                r = Request(self, msg)
                try:
                    answer = await handler(request, r)
                except Exception as e:  # every failure becomes a typed reply
                    span.record_exception(e)
                    span.set_status(Status(StatusCode.ERROR, repr(e)))
                    if not isinstance(e, CpdError):
                        self.log.exception("handler.failed", endpoint=name)
                    elif e.code in BAD_INPUT:  # decodable but refused: bad input too
                        self.reject(msg.subject, e)
                    return await self._reply_error(msg, e, request_id)
                if answer is not None and msg.reply:
                    try:
                        await self.bus.publish(msg.reply, answer, trace=False)
                    except CpdError as e:
                        return await self._reply_error(msg, e, request_id)
                if r.error is not None:  # a stream the handler ended with an error
                    return f"{r.error.code}: {r.error.message}"
        return None

    def reject(self, subject: str, error: CpdError) -> None:
        """Count and log one message refused as bad input (``cpd_rejected_messages_total``
        by service, subject and reason): endpoints do it for what they refuse, and
        plain subscriptions (heartbeats, load reports, acks) for what they drop."""
        self.rejected += 1
        self._rejections.add(1, {"service": self.name, "subject": _subject_label(subject),
                                 "reason": error.code.value})
        self.log.warning("message.rejected", subject=subject[:200], error=error.code.value,
                         detail=error.message[:500])

    def decode_or_reject(self, msg: Msg, expect: type[T]) -> T | None:
        """``msg`` decoded as ``expect``, or ``None`` after :meth:`reject` (for
        subscriptions without a reply: a bad message is dropped, counted and logged)."""
        try:
            return wire.decode(msg.data, expect)
        except CpdError as e:
            self.reject(msg.subject, e)
            return None

    def decode_from_sender(self, msg: Msg, expect: type[S]) -> S | None:
        """``msg`` decoded as ``expect`` when the node it names is the node whose subject
        it came on (heartbeats, load reports, KV events: only that node may publish
        there), else ``None`` after :meth:`reject` (``forged_sender`` for a mismatch)."""
        m = self.decode_or_reject(msg, expect)
        if m is None:
            return None
        try:
            wire.check_sender(msg.subject, m)
        except CpdError as e:
            self.reject(msg.subject, e)
            return None
        return m

    async def _reply_error(self, msg: Msg, exc: BaseException, request_id: str = "") -> str:
        """Answer ``msg`` (when it has a reply subject) with ``exc`` as a typed
        ``wire.Error``; returns ``"<code>: <message>"`` for the endpoint's stats."""
        error = error_message(exc, request_id)
        if msg.reply:
            with contextlib.suppress(Exception):
                await self.bus.publish(msg.reply, error, trace=False)
        return f"{error.code}: {error.message}"

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


BAD_INPUT = frozenset({ErrorCode.MALFORMED, ErrorCode.SCHEMA_VERSION, ErrorCode.UNKNOWN_KIND,
                       ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.INVALID_REQUEST,
                       ErrorCode.UNKNOWN_NAMESPACE, ErrorCode.PROMPT_TOO_LONG,
                       ErrorCode.FORGED_SENDER})
"""Error codes that mean "the sender's message was wrong" (counted as rejections)."""


def _subject_label(subject: str) -> str:
    """A bounded metric label for ``subject``: per-node subjects keep their pattern
    (``cpd.v1.node.heartbeat.*``), not one series per node id a sender made up."""
    for pattern in (subjects.HEARTBEAT_ALL, subjects.LOAD_ALL, subjects.KV_EVENTS_ALL):
        if subject.startswith(pattern[:-1]):
            return pattern
    return subject if subject.startswith(subjects.PREFIX) else "other"


EXIT_REFUSED = 78
"""Exit status of a service NATS refused (EX_CONFIG): ``cpd up`` does not restart it."""


class Runnable(Protocol):
    """What :func:`run_service` runs: a :class:`Service`, or several in one process."""

    name: str
    log: Any

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop."""


def run_service(service: Runnable) -> None:
    """Run ``service`` until SIGTERM/SIGINT on uvloop when available (a faster event
    loop; the stdlib one otherwise). A service NATS refuses (credentials, TLS,
    permissions) exits with :data:`EXIT_REFUSED` and one clear line, not a traceback."""
    try:
        import uvloop
    except ImportError:
        runner: Callable[[Any], None] = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(service.run())
    except NatsRefused as e:
        service.log.error("service.refused", error=e.code.value, detail=e.message)
        print(f"{service.name}: refused by NATS: {e.message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
