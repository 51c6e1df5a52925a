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
import functools
import signal
import ssl
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.micro
import nkeys
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from . import subjects, telemetry, wire
from .config import BusSettings, NatsSettings, Settings
from .errors import (
    Cancelled,
    CpdError,
    ErrorCode,
    NatsAuthFailed,
    NatsRefused,
    NoResponders,
    PayloadTooLarge,
    PermissionDenied,
    RequestTimeout,
    RouterGone,
    StreamGap,
    error_from_wire,
)
from .replymux import ReplyMux, is_no_responders

__all__ = [
    "Bus",
    "ReplyStream",
    "Service",
    "StreamReader",
    "connect",
    "encoded_size",
]

T = TypeVar("T", bound=wire.Message)

_HEADER_PREAMBLE = len(b"NATS/1.0\r\n") + len(b"\r\n")

log = telemetry.get_logger("cpd.bus")


async def connect(settings: NatsSettings, name: str, *, url: str | None = None,
                  **extra: Any) -> NatsClient:
    """Connect to NATS with reconnect handling and state-change logging, as the identity
    ``settings`` names (user/password or nkey, TLS, inbox prefix; cpd.security).

    Credentials or TLS the server refuses raise :class:`~cpd.errors.NatsAuthFailed`
    naming the setting (instead of retrying forever); a publish or subscribe the server
    refuses later is logged, counted and kept for :func:`permission_denials`. ``extra``
    goes to ``nats.connect`` as is (e.g. ``pending_size``).
    """
    target = url or settings.url
    denials = _Denials()

    async def on_error(e: Exception) -> None:
        text = str(e)
        if _PERMISSION_VIOLATION in text.lower():
            denials.add(name, text)
            return
        nc = holder.get("nc")
        if nc is None and _refused(e):
            # Still connecting: the server said no to who we are, which no retry fixes.
            raise NatsAuthFailed(_refusal_message(settings, target, e))
        log.warning("nats.error", client=name, error=repr(e))

    async def on_disconnect() -> None:
        nc = holder.get("nc")
        if nc is None or not (nc.is_closed or nc.is_draining):  # not our own close()
            log.warning("nats.disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats.reconnected", client=name)

    options: dict[str, Any] = {
        "servers": [target],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "reconnect_time_wait": settings.reconnect_wait_s,
        "max_reconnect_attempts": settings.max_reconnect_attempts,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "drain_timeout": settings.drain_timeout_s,
        **identity_options(settings),
        **extra,
    }
    holder: dict[str, NatsClient] = {}
    try:
        nc = await nats.connect(**options)
    except NatsRefused:
        raise
    except (OSError, nats.errors.Error) as e:
        raise CpdError(f"cannot connect to NATS at {target}: {e!r}",
                       code=ErrorCode.UNAVAILABLE, retryable=True) from e
    holder["nc"] = nc
    _DENIALS[nc] = denials
    return nc


_PERMISSION_VIOLATION = "permissions violation"


class _Denials:
    """Publishes/subscribes the server refused on one connection."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.event = asyncio.Event()

    def add(self, client: str, text: str) -> None:
        # nats-py hands over 'nats: permissions violation for publish to "subj"'.
        detail = text.split(_PERMISSION_VIOLATION, 1)[-1].strip(" '\"")
        op = "subscribe" if detail.lower().startswith("for subscription") else "publish"
        target = detail.rsplit(" ", 1)[-1].strip('"').lower()
        # An answer to someone's inbox may be refused through no fault of this process
        # (a caller reusing a reply subject that was answered already): logged and
        # counted, but not a sign that this identity lacks rights for its own job.
        if not (op == "publish" and target.startswith(subjects.INBOX_ROOT.lower())):
            self.seen.append(detail)
            self.event.set()
        _denied_counter().add(1, {"client": client, "operation": op})
        log.error("nats.permission_denied", client=client, operation=op, detail=detail)


_DENIALS: weakref.WeakKeyDictionary[NatsClient, _Denials] = weakref.WeakKeyDictionary()


@functools.cache
def _denied_counter() -> Any:
    return telemetry.meter().create_counter(
        "cpd_nats_permission_denied_total",
        description="publishes/subscribes the NATS server refused (identity lacks the right)")


async def flush_all(nc: NatsClient) -> None:
    """Return once the server has processed every command sent before this call.

    nats-py's ``flush()`` writes its PING straight to the socket while subscriptions and
    publishes still wait in its pending buffer for the flusher task, so the PONG can come
    back before the server saw them (a subscription "made" but not yet live: no
    responders, lost messages). Yielding once first lets the flusher, already woken by
    those commands, write them ahead of the PING (without the cost of a second round trip).
    """
    await asyncio.sleep(0)
    await nc.flush()


def permission_denials(nc: NatsClient) -> list[str]:
    """What the server refused this connection so far (``for publish to "x"`` ...),
    except answers to other identities' inboxes (see ``_Denials.add``)."""
    d = _DENIALS.get(nc)
    return list(d.seen) if d else []


async def wait_denied(nc: NatsClient) -> str:
    """Wait until the server refuses something on ``nc``; returns what it refused."""
    d = _DENIALS.get(nc)
    if d is None:
        await asyncio.Event().wait()  # a connection not made by connect(): never
    assert d is not None
    await d.event.wait()
    return d.seen[0]


def _refused(e: Exception) -> bool:
    """An error that means the server will not take this identity (or its TLS)."""
    text = str(e).lower()
    return (isinstance(e, ssl.SSLError | nats.errors.AuthorizationError)
            or "authorization violation" in text or "tls required" in text
            or "secure connection" in text or "certificate" in text)


def _identity_desc(settings: NatsSettings) -> str:
    if settings.nkey_seed_file:
        return f"nats.nkey_seed_file={settings.nkey_seed_file}"
    if settings.creds_file:
        return f"nats.creds_file={settings.creds_file}"
    if settings.user:
        return f"nats.user={settings.user} with nats.password" + (
            f"_file={settings.password_file}" if settings.password_file else "")
    return "no credentials (set nats.nkey_seed_file, or nats.user and nats.password_file)"


def _refusal_message(settings: NatsSettings, url: str, e: Exception) -> str:
    if isinstance(e, ssl.SSLError) or "authorization" not in str(e).lower():
        return (f"TLS with NATS at {url} failed ({e}): check nats.tls_ca_file"
                f"={settings.tls_ca_file or '(unset)'} (the CA that signed the server's "
                "certificate) and, when the server verifies clients, nats.tls_cert_file/"
                "nats.tls_key_file")
    return f"NATS at {url} refused {_identity_desc(settings)}: {e}"


def identity_options(settings: NatsSettings) -> dict[str, Any]:
    """``nats.connect`` options for the identity and TLS ``settings`` name; a missing or
    unreadable file raises :class:`~cpd.errors.NatsAuthFailed` naming the setting."""
    out: dict[str, Any] = {}

    def read(setting: str, path: str) -> str:
        try:
            return Path(path).expanduser().read_text().strip()
        except OSError as e:
            raise NatsAuthFailed(f"nats.{setting}={path}: cannot read it ({e.strerror})") \
                from None

    if settings.nkey_seed_file:
        seed = read("nkey_seed_file", settings.nkey_seed_file)
        try:
            nkeys.from_seed(seed.encode())
        except (nkeys.NkeysError, ValueError):
            raise NatsAuthFailed(f"nats.nkey_seed_file={settings.nkey_seed_file} does not "
                                 "hold an nkey seed (SU...)") from None
        out["nkeys_seed_str"] = seed
    elif settings.user:
        out["user"] = settings.user
        out["password"] = (read("password_file", settings.password_file)
                           if settings.password_file else settings.password)
    elif settings.password_file:
        raise NatsAuthFailed("nats.password_file is set but nats.user is not")
    if settings.creds_file:
        out["user_credentials"] = settings.creds_file
    if settings.tls_ca_file or settings.tls_cert_file:
        if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
            raise NatsAuthFailed("nats.tls_cert_file and nats.tls_key_file go together")
        try:
            ctx = ssl.create_default_context(
                cafile=str(Path(settings.tls_ca_file).expanduser())
                if settings.tls_ca_file else None)
        except (OSError, ssl.SSLError) as e:
            raise NatsAuthFailed(f"nats.tls_ca_file={settings.tls_ca_file}: {e}") from None
        if settings.tls_cert_file:
            try:
                ctx.load_cert_chain(str(Path(settings.tls_cert_file).expanduser()),
                                    str(Path(settings.tls_key_file).expanduser()))
            except (OSError, ssl.SSLError) as e:
                raise NatsAuthFailed(f"nats.tls_cert_file={settings.tls_cert_file} / "
                                     f"nats.tls_key_file={settings.tls_key_file}: {e}") from None
        out["tls"] = ctx
    if settings.inbox_prefix:
        try:
            subjects.check_token(settings.inbox_prefix.replace(".", "_"), "inbox prefix")
        except ValueError as e:
            raise NatsAuthFailed(f"nats.inbox_prefix: {e}") from None
        out["inbox_prefix"] = settings.inbox_prefix
    return out


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
        self._replies = ReplyMux(nc)

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
        reply = await self._replies.request(
            subject, payload, timeout=timeout or self.settings.request_timeout_s,
            headers=hdrs)
        answer = wire.decode(reply.data)
        if isinstance(answer, wire.Error):
            raise error_from_wire(answer.code, answer.message, answer.retryable)
        if not isinstance(answer, expect):
            raise CpdError(f"expected {expect.__name__} from {subject}, got "
                           f"{type(answer).__name__}", code=ErrorCode.MALFORMED)
        return answer

    async def stream(self, subject: str, msg: wire.Message, *, timeout: float,
                     idle_timeout: float | None = None, silence_limit: float | None = None,
                     keepalive_misses: int = 0) -> AsyncIterator[wire.Message]:
        """A streaming request: yields every reply message in ``seq`` order up to and
        including the final one; a ``wire.Error`` is raised, not yielded.

        Replies may come from several publishers (the first token from a prefill node,
        the rest from decode), so out-of-order arrivals are buffered and re-ordered; a
        missing sequence number that does not arrive within the idle timeout raises
        :class:`~cpd.errors.StreamGap`. The whole stream must end before ``timeout``.
        ``silence_limit`` and ``keepalive_misses``: the sender's keep-alive watchdog
        (:class:`StreamReader`).
        """
        idle = idle_timeout or self.settings.stream_idle_timeout_s
        deadline = time.monotonic() + timeout
        reader = StreamReader(self, idle_timeout=idle, subject=subject,
                              silence_limit=silence_limit, keepalive_misses=keepalive_misses)
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

    Keep-alives (``TokenChunk.keepalive_ms``; the router's, ReplyStream.keepalive) are
    consumed here, never returned. With ``silence_limit`` set, nothing at all received
    for that long raises :class:`~cpd.errors.RouterGone`, and a gap is given at most that
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
        self._sub: Any = None
        self._expected = 0
        self._early: dict[int, wire.Message] = {}
        self._gap_since = 0.0
        self._heard = 0.0
        # The highest seq the sender proved it sent (an out-of-band keep-alive repeats
        # it): at or past _expected, a message was lost even with nothing queued behind.
        self._sent_upto = -1

    async def open(self) -> str:
        """Subscribe; returns the inbox to name as the stream's destination."""
        self.inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(self.inbox)
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
                    raise error_from_wire(reply.code, reply.message, reply.retryable)
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
            try:
                raw = await self._sub.next_msg(timeout=max(left, 0.001))
            except nats.errors.TimeoutError:
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
        self.last_sent = time.monotonic()  # for keep-alives on silent streams

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
        await self.bus.publish(self.reply_to, wire.TokenChunk(
            request_id=self.request_id, seq=self.seq - 1, token_ids=[],
            keepalive_ms=interval_ms))

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
                f"identity ({_identity_desc(self.settings.nats)}) lacks a right the "
                f"service needs (another service's credentials?)")
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
        with telemetry.server_span(
            f"{self.name}.{name}", msg.headers,
            {"messaging.destination": msg.subject, "cpd.node": self.node_id},
        ) as span:
            try:
                request = wire.decode(msg.data, expect)
            except CpdError as e:
                self.reject(msg.subject, e)
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
                    elif e.code in BAD_INPUT:  # decodable but refused: bad input too
                        self.reject(msg.subject, e)
                    await self._reply_error(msg, e, request_id)
                    return
                if answer is not None and msg.reply:
                    try:
                        await self.bus.publish(msg.reply, answer, trace=False)
                    except CpdError as e:
                        await self._reply_error(msg, e, request_id)

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


BAD_INPUT = frozenset({ErrorCode.MALFORMED, ErrorCode.SCHEMA_VERSION, ErrorCode.UNKNOWN_KIND,
                       ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.INVALID_REQUEST,
                       ErrorCode.UNKNOWN_NAMESPACE, ErrorCode.PROMPT_TOO_LONG})
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


def run_service(service: Service) -> None:
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


def current_span() -> trace.Span:
    """The span of the request being handled (for attributes and events)."""
    return trace.get_current_span()
