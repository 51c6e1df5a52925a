"""KV block transfers between workers over UCX (DESIGN.md §7), with ``ucxx``.

Each worker runs one :class:`TransferServer` (a UCX listener; its address,
``b"host:port"``, goes into the heartbeat) in front of its :class:`~cpd.kvstore.KvStore`,
and one :class:`TransferClient` that keeps a connection per peer and bounds how many
transfers run at once.

One exchange moves a batch of blocks. Everything travels as tagged UCX messages on the
connection's endpoint (ucxx mixes each integer tag with a per-connection secret, so tags
of different connections never meet):

* the client sends a length-prefixed msgpack header (:class:`~cpd.wire.BlockGet` or
  :class:`~cpd.wire.BlockPut`) on :data:`CTRL_TAG`;
* the server answers with a :class:`~cpd.wire.BlockReply` on tag ``(xfer, 0)``: the refs
  and seals (length, xxh3-64) of the blocks that follow, or a typed error;
* block ``i`` travels on tag ``(xfer, 2 + i)``, straight from the sender's arena slot into
  the receiver's (zero-copy views; nothing is allocated per transfer) and its checksum is
  verified as soon as it lands;
* except in a get that asked for coalescing (``BlockGet.runs``, laid out by
  :func:`coalesce_runs`): there a run of consecutive small blocks travels as one message
  on the tag of its first block, packed back to back (block ``j`` at the sum of the
  ``nbytes`` before it in the run), copied through preallocated staging buffers on both
  sides; per-message Python costs more than copying a small block. The reply says
  ``coalesced``, so a peer that ignored the layout (an older build) is told apart;
* a put adds the final status on tag ``(xfer, 1)`` once the server verified and sealed.

A worker's server enforces capabilities (:mod:`cpd.capability`): a get must carry the
read capability of its namespace at this node (a put, the write capability), checked in
constant time before any block is looked at, so a client that only knows or guesses
block hashes gets :class:`~cpd.errors.CapabilityDenied` and not a byte. A server built
without a keyring (tools, benchmarks, the transfer tests' peers) serves any get.

Every exchange has a deadline. UCX never notices a paused peer by itself, so on a missed
deadline (or any endpoint error) the endpoint is aborted, which also cancels the receives
still aimed at our buffers before those buffers are reused. Errors are typed:
:class:`~cpd.errors.PeerGone`, :class:`~cpd.errors.BlockEvicted`,
:class:`~cpd.errors.ChecksumMismatch`, :class:`~cpd.errors.TransferTimeout`,
:class:`~cpd.errors.CapabilityDenied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import telemetry, wire
from .capability import Keyring
from .config import DataPlaneSettings
from .errors import (
    BlockEvicted,
    CapabilityDenied,
    ChecksumMismatch,
    CpdError,
    InvalidRequest,
    MalformedMessage,
    PeerGone,
    TransferTimeout,
    WrongKind,
    error_from_wire,
)
from .kvstore import BlockState, BlockStore, KvStore, checksum

log = telemetry.get_logger("cpd.transfer")

CTRL_TAG = 1
"""Tag of client → server headers on every connection."""

_TAG_STRIDE = 1 << 24  # per-exchange tag space: reply 0, final status 1, block i at 2 + i
_LEN = struct.Struct("<I")
_HEADER_FIXED = 4096  # msgpack envelope, namespace, error text
_HEADER_PER_BLOCK = 128  # a BlockRef + BlockSeal + flags is < 100 bytes in msgpack
_NS_PER_S = 1_000_000_000


# Coalesced runs a client receives at once per transfer (each into a staging buffer of
# its own): while one run is copied out into its landing views, the next one lands.
_CLIENT_STAGING_LANES = 2


def coalesce_runs(capacities: Sequence[int], settings: DataPlaneSettings
                  ) -> list[tuple[int, int]]:
    """How one get's blocks travel: ``(first block, block count)`` per message, in order.

    ``capacities`` are the receiver's landing sizes (slot or destination view), the only
    sizes known before the request goes out. Consecutive blocks of capacity under
    ``coalesce_below_bytes`` share a message while their capacities add up to at most
    ``coalesce_message_bytes``; every other block has one of its own. Either setting at
    0 gives one message per block. The client sends the counts (``BlockGet.runs``), so
    the server follows this layout without recomputing it under its own settings.
    """
    below, limit = settings.coalesce_below_bytes, settings.coalesce_message_bytes
    if not below or not limit:
        return [(i, 1) for i in range(len(capacities))]
    runs: list[tuple[int, int]] = []
    growing = False  # the last run is of small blocks and may take more
    run_bytes = 0  # its capacity so far
    for i, cap in enumerate(capacities):
        small = cap < below and cap <= limit
        if small and growing and run_bytes + cap <= limit:
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
            run_bytes += cap
        else:
            runs.append((i, 1))
            growing, run_bytes = small, cap
    return runs


def _runs_field(runs: Sequence[tuple[int, int]]) -> list[int]:
    """``BlockGet.runs`` for a layout: empty when every block has its own message, so
    such a get is exactly what builds without coalescing send and serve."""
    return [count for _, count in runs] if any(count > 1 for _, count in runs) else []


def _runs_from_field(counts: Sequence[int], n_blocks: int) -> list[tuple[int, int]]:
    """The layout a ``BlockGet.runs`` describes; :class:`~cpd.errors.InvalidRequest`
    unless it covers the ``n_blocks`` blocks exactly."""
    if any(c < 1 for c in counts) or sum(counts) != n_blocks:
        raise InvalidRequest(f"runs must be positive counts adding up to the {n_blocks} "
                             "blocks requested")
    starts = itertools.accumulate(counts, initial=0)
    return list(zip(starts, counts, strict=False))


def header_capacity(max_blocks: int) -> int:
    """Bytes of the preallocated buffer one header of up to ``max_blocks`` blocks fits in."""
    return _LEN.size + _HEADER_FIXED + _HEADER_PER_BLOCK * max_blocks


def xfer_tag(xfer_id: int, index: int) -> int:
    """The integer tag of message ``index`` of exchange ``xfer_id`` (0 reply, 1 final,
    2 + i block i)."""
    return xfer_id * _TAG_STRIDE + index


def encode_address(host: str, port: int) -> bytes:
    """The listener address as published in ``Heartbeat.ucx_address``."""
    return f"{host}:{port}".encode()


def decode_address(address: bytes | str) -> tuple[str, int]:
    """``b"host:port"`` → ``(host, port)``; :class:`~cpd.errors.MalformedMessage` if bad."""
    try:
        text = address.decode() if isinstance(address, bytes | bytearray) else address
    except UnicodeDecodeError:  # a peer's heartbeat carried garbage
        raise MalformedMessage(f"bad UCX address {address[:80]!r}; not text") from None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MalformedMessage(f"bad UCX address {text!r}; expected host:port")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------------------------- UCX setup


def ucx_options(settings: DataPlaneSettings) -> dict[str, str]:
    """The UCX options (``UCX_`` prefix dropped) this process runs with."""
    options = {"TLS": settings.ucx_tls, "RNDV_FRAG_MEM_TYPE": settings.ucx_rndv_frag_mem_type}
    if settings.ucx_shm_error_handling:
        options |= {"POSIX_ERROR_HANDLING": "y", "SYSV_ERROR_HANDLING": "y"}
    return options


_ucx_configured: dict[str, str] | None = None
_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _ProgressDriver] = (
    weakref.WeakKeyDictionary())


def init_ucx(settings: DataPlaneSettings) -> None:
    """Configure UCX for this process once, from the running event loop.

    Must run before the first listener or endpoint (UCX reads its options when the
    context is created). Later calls with other options log a warning and change nothing.
    """
    global _ucx_configured
    loop = asyncio.get_running_loop()  # ucxx ties its progress to the loop current at init
    options = ucx_options(settings)
    if _ucx_configured is not None:
        if options != _ucx_configured:
            log.warning("UCX already initialised with other options", active=_ucx_configured,
                        wanted=options)
        if settings.ucx_progress_mode == "blocking":
            _drive_progress(loop)
        return
    # ucxx sets variables UCX itself does not know (UCX_MEMTYPE_CACHE) and UCX warns on
    # each; keep the logs clean unless the operator asked otherwise.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    try:  # at start-up, not at a worker's first transfer
        _request_api()
    except ImportError as e:
        raise RuntimeError(f"ucxx {ucxx.__version__} lacks the request API that "
                           "cpd.transfer drives directly") from e

    try:
        ucxx.init(options=options, progress_mode=settings.ucx_progress_mode,
                  enable_python_future=settings.ucx_progress_mode.startswith("thread"),
                  connect_timeout=settings.connect_timeout_s)
    except RuntimeError:
        log.warning("UCX was initialised before cpd.transfer.init_ucx; options not applied")
    _ucx_configured = options
    # ucxx's notifier thread (thread modes) is not a daemon: without a stop, interpreter
    # exit waits for it forever. This hook runs before non-daemon threads are joined.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(shutdown_ucx)
    if settings.ucx_progress_mode == "blocking":
        _drive_progress(loop)


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread (idempotent); call before the process exits."""
    if _ucx_configured is None:
        return
    import ucxx

    ucxx.stop_notifier_thread()


def _drive_progress(loop: asyncio.AbstractEventLoop) -> _ProgressDriver | None:
    """The progress driver of ``loop``'s UCX worker (installed on first use)."""
    driver = _drivers.get(loop)
    if driver is not None:
        return driver
    import ucxx

    ucxx.continuous_ucx_progress(loop)  # ucxx's own tasks: its 1 s safety net stays
    try:
        worker = ucxx.core._get_ctx().worker
        fd = worker.epoll_file_descriptor
    except AttributeError:  # another ucxx layout: keep its own progress
        log.warning("cannot drive UCX progress on this ucxx version; using its own")
        return None
    driver = _drivers[loop] = _ProgressDriver(worker, fd, loop)
    return driver


class _ProgressDriver:
    """Progresses the UCX worker of one event loop in "blocking" mode.

    ucxx 0.52's blocking mode registers a reader on the worker's epoll fd that calls
    ``progress()`` but never ``arm()`` again after the first wake-up, so later events go
    unsignalled and progress falls back to a one-second timer: transfers crawl or miss
    their deadline. Instead:

    * idle: the canonical UCX loop — progress until ``arm()`` succeeds, sleep in epoll;
    * while this process has transfers in flight (:meth:`busy`): poll the worker on
      every event-loop turn, because requests posted after arming (a receive matching
      an already-arrived rendezvous, a send queued behind another) need progress that no
      fd event announces. That costs CPU only while bytes move.
    """

    def __init__(self, worker: Any, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        self._busy = 0
        self._pump: asyncio.Task[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []
        loop.add_reader(fd, self.on_event)  # replaces ucxx's reader on the same fd
        self.on_event()

    async def next_activity(self, timeout: float) -> None:
        """Sleep until the worker was progressed again (or ``timeout`` passes)."""
        fut = self.loop.create_future()
        self._waiters.append(fut)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await fut

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def on_event(self) -> None:
        self.worker.progress()
        self._wake()
        if not self._busy and not self.worker.arm():
            # Events arrived meanwhile: progress again on the next loop turn, never in a
            # tight loop here (a failing endpoint can keep the worker busy, and timers,
            # deadlines included, must still run).
            self.loop.call_soon(self.on_event)

    @contextlib.asynccontextmanager
    async def busy(self) -> AsyncIterator[None]:
        """Poll the worker for as long as the body runs."""
        self._busy += 1
        if self._pump is None or self._pump.done():
            self._pump = self.loop.create_task(self._run_pump(), name="ucx-progress-pump")
        try:
            yield
        finally:
            self._busy -= 1

    async def _run_pump(self) -> None:
        while self._busy:
            self.worker.progress()
            self._wake()
            await asyncio.sleep(0)
        self.on_event()  # re-arm before going idle


@contextlib.asynccontextmanager
async def _progress_while_busy() -> AsyncIterator[None]:
    driver = _drivers.get(asyncio.get_running_loop())
    if driver is None:
        yield
        return
    async with driver.busy():
        yield


async def _recv_idle(ep: Any, buf: bytearray, tag: int) -> None:
    """``ep.recv`` for a message that may be long in coming (a connection's next request).

    ucxx awaits a request by yielding to the event loop until it completes, so every idle
    connection of a server kept a core busy. Here the wait sleeps until the progress
    driver next progresses the worker (an fd event, a busy transfer's polling, or a short
    timer for what no event announces). Falls back to ``ep.recv`` where the driver or
    ucxx's request API is not available (thread progress modes, another ucxx layout).
    """
    driver = _drivers.get(asyncio.get_running_loop())
    if driver is None:
        await ep.recv(buf, tag=tag)
        return
    array, tag_type, mask, hash64 = _request_api()
    ep._ep.raise_on_error()
    req = ep._ep.tag_recv(array(buf), tag_type(hash64(ep._tags["msg_recv"], hash(tag))), mask)
    # Right after traffic, the next request tends to follow at once: wait as ucxx does
    # (yielding every loop turn) for a short while, then sleep between re-checks.
    linger_end = time.monotonic() + _IDLE_LINGER_S
    while not req.completed and time.monotonic() < linger_end:
        await asyncio.sleep(0)
    recheck = _IDLE_RECHECK_S
    while not req.completed:
        await driver.next_activity(recheck)
        if not req.completed:
            driver.worker.progress()
        # Arrivals are nearly always announced by an fd event; the timer is the fallback,
        # so a long-idle connection re-checks less often (every server keeps one open
        # connection per peer, and 1 kHz wake-ups each were a quarter of a busy worker's CPU).
        recheck = min(recheck * 2, _IDLE_RECHECK_MAX_S)
    req.check_error()


# How long an idle receive keeps the event loop turning after traffic, and how often it
# re-checks after that without an fd event (UCX does not announce every arrival, e.g. a
# message that came before its receive was posted): one progress() per period is cheap.
# The linger covers back-to-back requests; at 50 ms it kept a loaded worker's loop
# spinning after every request on every connection (a third of its CPU in a sim sweep).
_IDLE_LINGER_S = 0.005
_IDLE_RECHECK_S = 0.001
_IDLE_RECHECK_MAX_S = 0.008
# The longest a busy _Batch.wait runs without yielding to the event loop.
_BATCH_YIELD_S = 0.001


@functools.cache
def _request_api() -> tuple[Any, Any, Any, Any]:
    """ucxx's request-level pieces this module drives directly (:func:`init_ucx` checks
    that they exist)."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag, TagMaskFull

    return Array, Tag, TagMaskFull, hash64bits


class _Batch:
    """The UCX requests of one exchange, posted at once and awaited by one coroutine.

    ucxx awaits each request in a coroutine of its own that yields on every event-loop
    turn until the request completes. With one per block, a loop turn costs a coroutine
    step per pending block, the worker is progressed once per turn, and a completion is
    noticed late: a batch's blocks were all seen to land together at its end, so every
    checksum ran after the last byte arrived, on bytes already out of cache. Here one
    loop progresses the worker and handles each completion as it happens (``then``: check
    a block while it is in cache, pack and post the next coalesced run), which lets the
    checks overlap the bytes still in flight.

    ``on_error`` aborts the endpoint: :meth:`wait` calls it on any failure (a request's
    error, a missed deadline, a cancel) before re-raising, because aborting is what
    cancels the requests still aimed at buffers about to be reused.
    """

    def __init__(self, ep: Any, on_error: Callable[[], None]) -> None:
        if ep.closed:
            from ucxx.exceptions import UCXCloseError

            raise UCXCloseError("Endpoint closed")
        ep._ep.raise_on_error()  # as ucxx's own send/recv do before posting
        self._array, self._tag, self._mask, hash64 = _request_api()
        self._on_error = on_error
        self._ucp = ep._ep
        self._send_key = lambda tag: hash64(ep._tags["msg_send"], hash(tag))
        self._recv_key = lambda tag: hash64(ep._tags["msg_recv"], hash(tag))
        driver = _drivers.get(asyncio.get_running_loop())
        # Thread progress modes progress the worker elsewhere; then completions are only
        # polled here.
        self._progress = driver.worker.progress if driver is not None else None
        # (request, then, buffer): the buffer object stays referenced while UCX uses it.
        self._pending: list[tuple[Any, Callable[[], None] | None, Any]] = []

    def recv(self, buf: Any, tag: int, then: Callable[[], None] | None = None) -> Any:
        """Post a tagged receive into ``buf``; ``then`` runs once it completed."""
        req = self._ucp.tag_recv(self._array(buf), self._tag(self._recv_key(tag)), self._mask)
        self._pending.append((req, then, buf))
        return req

    def send(self, buf: Any, tag: int, then: Callable[[], None] | None = None) -> Any:
        """Post a tagged send of ``buf``; ``then`` runs once it completed."""
        req = self._ucp.tag_send(self._array(buf), self._tag(self._send_key(tag)))
        self._pending.append((req, then, buf))
        return req

    async def wait(self, until: Any = None) -> None:
        """Progress until every request posted (callbacks may post more meanwhile) has
        completed, or just until ``until`` (a request of this batch) has. Raises the
        first failed request's error (after ``on_error``)."""
        try:
            await self._wait(until)
        except BaseException:
            self._on_error()
            raise

    async def _wait(self, until: Any) -> None:
        awaited = until
        yielded = time.perf_counter()
        while self._pending:
            if self._progress is not None:
                self._progress()
            pending, self._pending = self._pending, []
            completed = 0
            for item in pending:
                req, then, _ = item
                if not req.completed:
                    self._pending.append(item)
                    continue
                completed += 1
                req.check_error()
                if then is not None:
                    then()
                if req is awaited:
                    awaited = None
            if until is not None and awaited is None:
                return
            # Nothing done: let the rest of the loop run. Busy: still yield now and then,
            # so timers (deadlines included) and other connections are not starved.
            if not completed or time.perf_counter() - yielded > _BATCH_YIELD_S:
                await asyncio.sleep(0)
                yielded = time.perf_counter()


def active_transports() -> set[str]:
    """The UCX transports this process may use (after :func:`init_ucx`)."""
    import ucxx

    return set(ucxx.get_active_transports())


def _ucx_error() -> type[Exception]:
    from ucxx.exceptions import UCXError

    return UCXError


def _truncated_error() -> type[Exception]:
    from ucxx.exceptions import UCXMessageTruncatedError

    return UCXMessageTruncatedError


def _frame(msg: wire.Message) -> bytes:
    payload = wire.encode(msg)
    return _LEN.pack(len(payload)) + payload


def _unframe(buf: bytearray, expect: type[wire.T]) -> wire.T:
    (n,) = _LEN.unpack_from(buf)
    if n > len(buf) - _LEN.size:
        raise MalformedMessage(f"header of {n} bytes overruns its {len(buf)}-byte buffer")
    return wire.decode(memoryview(buf)[_LEN.size:_LEN.size + n], expect)


def _abort(ep: Any, settings: DataPlaneSettings) -> None:
    with contextlib.suppress(Exception):
        ep.abort(period=int(settings.abort_wait_s * _NS_PER_S), max_attempts=1)


# ----------------------------------------------------------------------------- bandwidth


class BandwidthMeter:
    """Exponentially weighted achieved transfer bandwidth of this worker.

    The router's load-vs-recompute estimate uses it (``LoadReport.kv_bandwidth_gbps``).
    Transfers under ``min_bytes`` are counted but do not move the estimate: they measure
    latency, not bandwidth.
    """

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1 << 20) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self._gbps = 0.0
        self.samples = 0
        self.total_bytes = 0
        self.total_seconds = 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        """Account one finished transfer of ``nbytes`` that took ``seconds``."""
        self.total_bytes += nbytes
        self.total_seconds += seconds
        if nbytes < self.min_bytes or seconds <= 0:
            return
        sample = nbytes / seconds / 1e9
        self._gbps = sample if not self.samples else (
            self.alpha * sample + (1 - self.alpha) * self._gbps)
        self.samples += 1

    @property
    def gbps(self) -> float:
        """Current estimate in GB/s (10^9 bytes/s); 0.0 until a large transfer finished."""
        return self._gbps


class _Metrics:
    def __init__(self) -> None:
        m = telemetry.meter("cpd.transfer")
        self.bytes = m.create_counter("cpd.kv.transfer.bytes", unit="By",
                                      description="KV bytes moved over UCX")
        self.transfers = m.create_counter("cpd.kv.transfers",
                                          description="KV transfers by operation and outcome")
        self.seconds = m.create_histogram("cpd.kv.transfer.duration", unit="s",
                                          description="Duration of one KV transfer")
        self.denied = m.create_counter(
            "cpd.kv.capability.denied",
            description="data-plane requests refused for a missing or wrong capability")

    def done(self, op: str, outcome: str, nbytes: int, seconds: float) -> None:
        attrs = {"op": op, "outcome": outcome}
        self.transfers.add(1, attrs)
        if nbytes:
            self.bytes.add(nbytes, {"op": op})
        self.seconds.record(seconds, attrs)


# -------------------------------------------------------------------------------- server


class TransferServer:
    """The UCX listener of one worker: serves gets from and puts into its store.

    With a ``keyring`` (every worker has one) each get and put must present the
    capability of its namespace; without, the server is open (tools and tests).
    """

    # A cpd.audit.AuditLog when worker.audit_dir is set: every get served is recorded.
    audit: Any = None

    def __init__(self, store: KvStore, settings: DataPlaneSettings, *,
                 keyring: Keyring | None = None) -> None:
        self.kv = store
        self.settings = settings
        self.keyring = keyring
        self.port = 0
        self._listener: Any = None
        self._eps: set[Any] = set()
        self._serving: set[asyncio.Task[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._conn_ids = itertools.count(1)
        self._slots = asyncio.Semaphore(settings.max_server_transfers)
        # One staging buffer per transfer slot for coalesced gets (taken under _slots, so
        # never short); numpy maps the pages lazily, so unused ones cost no memory.
        self._staging: list[np.ndarray] = [
            np.empty(settings.coalesce_message_bytes, np.uint8)
            for _ in range(settings.max_server_transfers if settings.coalesce_message_bytes
                           else 0)]
        self._cap = header_capacity(settings.max_blocks_per_transfer)
        self._metrics = _Metrics()

    @property
    def store(self) -> BlockStore:
        return self.kv.store

    @property
    def address(self) -> bytes:
        """What peers connect to (``Heartbeat.ucx_address``)."""
        if not self.port:
            raise CpdError("transfer server not started")
        # advertise_port: peers reach this listener through a forwarder (a NAT rule, the
        # fault harness's proxy) on another port.
        return encode_address(self.settings.advertise_host,
                              self.settings.advertise_port or self.port)

    async def start(self) -> TransferServer:
        """Initialise UCX and start listening; returns ``self``."""
        init_ucx(self.settings)
        import ucxx

        self._listener = ucxx.create_listener(self._serve, port=self.settings.listen_port,
                                              connect_timeout=self.settings.connect_timeout_s)
        self.port = self._listener.port
        log.info("transfer server listening", node=self.kv.node, port=self.port,
                 transports=sorted(active_transports()))
        return self

    async def close(self) -> None:
        """Drop every connection (in-flight transfers fail) and stop listening."""
        for ep in list(self._eps):
            _abort(ep, self.settings)
        tasks = [*self._serving, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve(self, ep: Any) -> None:
        conn_id = next(self._conn_ids)
        me = asyncio.current_task()
        if me is not None:
            self._serving.add(me)
        self._eps.add(ep)
        buf = bytearray(self._cap)  # per connection, reused for every header
        mine: set[asyncio.Task[Any]] = set()
        try:
            while True:
                await _recv_idle(ep, buf, CTRL_TAG)
                try:
                    msg = _unframe(buf, wire.Message)
                    if not isinstance(msg, wire.BlockGet | wire.BlockPut):
                        # No transfer id to answer on: closing is the only typed refusal
                        # (an ignored header left the client waiting for its timeout).
                        raise WrongKind(f"{msg.__struct_config__.tag!r} is not a "
                                        "data-plane request")
                except CpdError as e:
                    log.warning("bad transfer header; closing connection", error=str(e))
                    return
                task = asyncio.create_task(self._handle(ep, conn_id, msg))
                mine.add(task)
                self._tasks.add(task)
                task.add_done_callback(mine.discard)
                task.add_done_callback(self._tasks.discard)
        except _ucx_error() as e:
            log.debug("transfer connection closed", conn=conn_id, reason=repr(e))
        finally:
            self._eps.discard(ep)
            self._serving.discard(me)  # type: ignore[arg-type]
            _abort(ep, self.settings)
            for task in mine:
                task.cancel()
            await asyncio.gather(*mine, return_exceptions=True)

    async def _handle(self, ep: Any, conn_id: int, msg: wire.Message) -> None:
        op = msg.__struct_config__.tag
        t0 = time.perf_counter()
        nbytes = 0
        outcome = "ok"
        try:
            if isinstance(msg, wire.BlockGet):
                async with _progress_while_busy():
                    nbytes = await self._handle_get(ep, conn_id, msg)
            elif isinstance(msg, wire.BlockPut):
                async with _progress_while_busy():
                    nbytes = await self._handle_put(ep, conn_id, msg)
            else:
                log.warning("unexpected message on the data plane", kind=op)
                outcome = "invalid"
        except (TimeoutError, _ucx_error()) as e:
            # The peer is gone or stalled: drop the connection (its loop ends too).
            outcome = "timeout" if isinstance(e, TimeoutError) else "peer_gone"
            log.info("transfer aborted", op=op, conn=conn_id, reason=repr(e))
            _abort(ep, self.settings)
        except CpdError as e:
            outcome = e.code.value
        finally:
            self._metrics.done(f"serve_{op}", outcome, nbytes, time.perf_counter() - t0)

    def _timeout(self, timeout_ms: int) -> float:
        return timeout_ms / 1000 if timeout_ms else self.settings.transfer_timeout_s

    async def _reply(self, ep: Any, xfer_id: int, index: int, reply: wire.BlockReply) -> None:
        await ep.send(_frame(reply), tag=xfer_tag(xfer_id, index))

    async def _reply_error(self, ep: Any, xfer_id: int, index: int, err: CpdError,
                           **extra: Any) -> None:
        await self._reply(ep, xfer_id, index, wire.BlockReply(
            xfer_id=xfer_id, ok=False, code=err.code.value, message=str(err), **extra))

    async def _authorize(self, ep: Any, conn_id: int, op: str, xfer_id: int, namespace: str,
                         capability: bytes) -> None:
        """Refuse (typed, before anything else) a request without a valid capability."""
        if self.keyring is None or self.keyring.verify(
                namespace, capability, "put" if op == "put" else "get"):
            return
        err = CapabilityDenied(f"{op} of namespace {namespace!r} at {self.kv.node}: "
                               f"{'wrong' if capability else 'no'} capability")
        self._metrics.denied.add(1, {"op": op})
        # Who asked is only known by connection; hashes are not logged (they are the
        # probe's payload, and tell an operator nothing).
        log.warning("transfer.capability_denied", op=op, conn=conn_id, namespace=namespace,
                    presented=bool(capability))
        await self._reply_error(ep, xfer_id, 0, err)
        raise err

    async def _handle_get(self, ep: Any, conn_id: int, req: wire.BlockGet) -> int:
        x = req.xfer_id
        await self._authorize(ep, conn_id, "get", x, req.namespace, req.capability)
        try:
            hashes = wire.split_hashes(req.hashes)
            if not 0 < len(hashes) <= self.settings.max_blocks_per_transfer:
                raise InvalidRequest(
                    f"{len(hashes)} blocks; 1..{self.settings.max_blocks_per_transfer}")
            runs = _runs_from_field(req.runs, len(hashes)) if req.runs else []
            if runs and not self.settings.coalesce_message_bytes:
                raise InvalidRequest("coalesced gets are off at this server "
                                     "(dataplane.coalesce_message_bytes = 0)")
        except CpdError as e:
            await self._reply_error(ep, x, 0, e)
            raise
        timeout = self._timeout(req.timeout_ms)
        async with asyncio.timeout(timeout), self._slots:
            missing = [h for h in hashes if not self._servable(h, req.namespace)]
            if missing:
                err = BlockEvicted(f"{len(missing)} of {len(hashes)} blocks are not held")
                await self._reply_error(ep, x, 0, err, missing=b"".join(missing))
                raise err
            # Pinned while the bytes leave, so eviction cannot hand the slots to new blocks.
            lease = f"xfer-{conn_id}-{x}"
            self.store.pin(lease, hashes, timeout)
            try:
                entries = [self.store.get(h) for h in hashes]
                namespaces = {e.namespace for e in entries}
                if len(namespaces) != 1:
                    err = InvalidRequest("one get carries blocks of one namespace")
                    await self._reply_error(ep, x, 0, err)
                    raise err
                largest = max((sum(e.nbytes for e in entries[start:start + count])
                               for start, count in runs if count > 1), default=0)
                if largest > self.settings.coalesce_message_bytes:
                    err = InvalidRequest(
                        f"a coalesced run of {largest} bytes exceeds this server's "
                        f"dataplane.coalesce_message_bytes {self.settings.coalesce_message_bytes}")
                    await self._reply_error(ep, x, 0, err)
                    raise err
                if self.audit is not None:
                    self._audit_get(next(iter(namespaces)), entries)
                # The reply and every block are posted at once (the reply first: the
                # client needs its seals to check the blocks).
                # A failure aborts the endpoint before the slots are unpinned and the
                # staging buffer reused: sends may still be reading them.
                batch = _Batch(ep, lambda: _abort(ep, self.settings))
                batch.send(_frame(wire.BlockReply(
                    xfer_id=x, namespace=namespaces.pop(), blocks=[e.ref for e in entries],
                    seals=[e.seal for e in entries], coalesced=bool(runs))), xfer_tag(x, 0))
                # One staging buffer per slot of _slots, which this transfer holds.
                staging = self._staging.pop() if runs else None
                try:
                    if staging is not None:
                        self._post_runs(batch, x, entries, runs, staging)
                    else:
                        for i, e in enumerate(entries):
                            self._post_block(batch, xfer_tag(x, 2 + i),
                                             self.store.arena[e.slot, :e.nbytes])
                    await batch.wait()
                finally:
                    if staging is not None:
                        self._staging.append(staging)
            finally:
                self.store.unpin(lease)
        return sum(e.nbytes for e in entries)

    def _audit_get(self, namespace: str, entries: list[Any]) -> None:
        """Record what is about to leave: unsealed or corrupt blocks must never do."""
        sealed = [e for e in entries if e.state is BlockState.SEALED]
        corrupt = sum(not self.store.intact(e.hash) for e in sealed)
        self.audit.served(namespace, [e.hash for e in entries],
                          unsealed=len(entries) - len(sealed), corrupt=corrupt)

    def _servable(self, block_hash: bytes, namespace: str) -> bool:
        entry = self.store.get(block_hash)
        return (entry is not None and entry.state is BlockState.SEALED
                and (not namespace or entry.namespace == namespace))

    def _post_block(self, batch: _Batch, tag: int, view: np.ndarray,
                    then: Callable[[], None] | None = None) -> None:
        """Post one message of block bytes (a view into the arena or a staging buffer)."""
        batch.send(view, tag, then)

    def _post_runs(self, batch: _Batch, xfer_id: int, entries: list[Any],
                   runs: list[tuple[int, int]], staging: np.ndarray) -> None:
        """Post a coalesced get's blocks: a run of one block zero-copy from its slot, as
        usual; longer runs packed one after another into ``staging`` (the next once the
        previous has left: the client copies a run out while the next is packed here)."""
        arena = self.store.arena
        packed = iter([run for run in runs if run[1] > 1])

        def post_next_packed() -> None:
            run = next(packed, None)
            if run is not None:
                start, count = run
                size = _pack(staging, arena, entries[start:start + count])
                self._post_block(batch, xfer_tag(xfer_id, 2 + start), staging[:size],
                                 post_next_packed)

        for start, count in runs:
            if count == 1:
                e = entries[start]
                self._post_block(batch, xfer_tag(xfer_id, 2 + start), arena[e.slot, :e.nbytes])
        post_next_packed()

    async def _handle_put(self, ep: Any, conn_id: int, req: wire.BlockPut) -> int:
        x = req.xfer_id
        await self._authorize(ep, conn_id, "put", x, req.namespace, req.capability)
        n = len(req.blocks)
        if n != len(req.seals) or not 0 < n <= self.settings.max_blocks_per_transfer or any(
                s.hash != b.hash or s.nbytes > self.store.slot_bytes
                for b, s in zip(req.blocks, req.seals, strict=False)):
            err = InvalidRequest("put header: refs and seals must match, fit a slot and "
                                 f"number 1..{self.settings.max_blocks_per_transfer}")
            await self._reply_error(ep, x, 0, err)
            raise err
        timeout = self._timeout(req.timeout_ms)
        new: list[tuple[int, Any]] = []
        received = 0
        try:
            async with asyncio.timeout(timeout), self._slots:
                try:
                    entries = await self.kv.allocate(req.namespace, req.blocks)
                except CpdError as e:
                    await self._reply_error(ep, x, 0, e)
                    raise
                new = [(i, e) for i, e in enumerate(entries) if e is not None]
                await self.kv.begin_write([e.hash for _, e in new])
                accepted = bytes(int(e is not None) for e in entries)
                # The receives are posted before the go-ahead leaves, so the blocks land
                # as soon as they come; each is checked as it lands, while in cache.
                # A failure aborts the endpoint before the slots are failed and reused:
                # receives may still be writing into them.
                batch = _Batch(ep, lambda: _abort(ep, self.settings))
                digests = [0] * len(new)
                for k, (i, e) in enumerate(new):
                    view = self.store.arena[e.slot, :req.seals[i].nbytes]
                    batch.recv(view, xfer_tag(x, 2 + i), functools.partial(
                        _store_checksum, digests, k, view))
                batch.send(_frame(wire.BlockReply(xfer_id=x, accepted=accepted)),
                           xfer_tag(x, 0))
                await batch.wait()
                items = [(e.hash, req.seals[i].nbytes, req.seals[i].checksum, d)
                         for (i, e), d in zip(new, digests, strict=True)]
                received = sum(req.seals[i].nbytes for i, _ in new)
                new = []  # from here on the store owns their fate (seal or fail)
                try:
                    await self.kv.seal(items)
                except ChecksumMismatch as e:
                    await self._reply_error(ep, x, 1, e)
                    raise
                await self._reply(ep, x, 1, wire.BlockReply(xfer_id=x))
        finally:
            if new:
                await self.kv.fail([e.hash for _, e in new], "transfer aborted")
        return received


# -------------------------------------------------------------------------------- client


@dataclass(eq=False)
class _Conn:
    address: bytes
    ep: Any
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


@dataclass(frozen=True, slots=True)
class _PermitBuffers:
    """What one of a client's transfer permits lends for the length of an exchange: the
    header buffer, and the staging buffers coalesced runs land in (none when off)."""

    header: bytearray
    staging: tuple[np.ndarray, ...]


@dataclass(frozen=True, slots=True)
class Fetched:
    """One block received by :meth:`TransferClient.get_into`."""

    ref: wire.BlockRef
    seal: wire.BlockSeal
    namespace: str


class TransferClient:
    """Gets and puts blocks from/to peers' stores, one reused connection per peer.

    At most ``max_concurrent_transfers`` exchanges run at once (each holds one set of the
    preallocated header and staging buffers); every one has a deadline (``timeout_s``,
    else ``transfer_timeout_s``) covering connect, wait for a slot, and the bytes.
    """

    def __init__(self, settings: DataPlaneSettings, *,
                 meter: BandwidthMeter | None = None) -> None:
        self.settings = settings
        self.meter = meter or BandwidthMeter(settings.bandwidth_ewma_alpha,
                                             settings.bandwidth_min_bytes)
        self._conns: dict[bytes, _Conn] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}
        cap = header_capacity(settings.max_blocks_per_transfer)
        coalescing = bool(settings.coalesce_below_bytes and settings.coalesce_message_bytes)
        lanes = _CLIENT_STAGING_LANES if coalescing else 0
        # Last in, first out: the buffers used last are the ones whose pages are mapped
        # and cached (a FIFO would walk every permit's staging pages, first-touch faults
        # included, before reusing any).
        self._buffers: asyncio.LifoQueue[_PermitBuffers] = asyncio.LifoQueue()
        for _ in range(settings.max_concurrent_transfers):
            # numpy maps the staging pages lazily: buffers never used cost no memory.
            self._buffers.put_nowait(_PermitBuffers(bytearray(cap), tuple(
                np.empty(settings.coalesce_message_bytes, np.uint8) for _ in range(lanes))))
        self._metrics = _Metrics()
        self._inflight = 0

    @property
    def in_flight(self) -> int:
        return self._inflight

    async def close(self) -> None:
        """Close every connection."""
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.ep.close(period=int(self.settings.abort_wait_s * _NS_PER_S))

    # ---------------------------------------------------------------------- public API

    async def get_into(self, address: bytes, hashes: Sequence[bytes], dests: Sequence[Any], *,
                       namespace: str = "", timeout_s: float | None = None,
                       capability: bytes = b"") -> list[Fetched]:
        """Fetch sealed blocks from the peer at ``address`` into ``dests`` (one writable
        buffer per block, at least the block's length), verifying every checksum.
        ``capability``: the peer's read capability of ``namespace`` (see
        :mod:`cpd.capability`); a peer that enforces them raises
        :class:`~cpd.errors.CapabilityDenied` without it."""
        if len(dests) != len(hashes):
            raise ValueError("one destination buffer per block")
        views = [_byte_view(d) for d in dests]

        async def accept(reply: wire.BlockReply) -> None:
            return None

        reply, digests = await self._get(address, hashes, namespace, timeout_s, views, accept,
                                         capability)
        bad = [s.hash for s, d in zip(reply.seals, digests, strict=True) if s.checksum != d]
        if bad:
            raise ChecksumMismatch(f"{len(bad)} of {len(hashes)} blocks from "
                                   f"{address.decode()} failed their checksum")
        return [Fetched(r, s, reply.namespace) for r, s in zip(reply.blocks, reply.seals,
                                                                strict=True)]

    async def pull(self, address: bytes, hashes: Sequence[bytes], store: KvStore, *,
                   namespace: str = "", timeout_s: float | None = None,
                   capability: bytes = b"") -> list[wire.BlockSeal]:
        """Copy sealed blocks from the peer at ``address`` into the local ``store``.

        Blocks already held locally are not fetched. The new ones go through the local
        lifecycle (allocated → writing → sealed, or failed) like any other write; a block
        whose bytes fail the checksum is failed and :class:`~cpd.errors.ChecksumMismatch`
        is raised after the good ones are sealed. Returns the seals of the new blocks.
        """
        wanted = [h for h in hashes if h not in store.store]
        if not wanted:
            return []
        # Landing slots are taken before asking, so the receives can be posted first;
        # they become the blocks' slots once the reply says what the blocks are.
        slots = await store.take_slots(len(wanted))
        allocated: list[bytes] = []
        given: set[int] = set()  # borrowed slots that became blocks' slots

        async def accept(reply: wire.BlockReply) -> None:
            entries = await store.allocate(reply.namespace, reply.blocks, slots=slots)
            for e in entries:
                if e is not None:
                    allocated.append(e.hash)
                    given.add(e.slot)
            await store.begin_write(allocated)

        try:
            reply, digests = await self._get(address, wanted, namespace, timeout_s,
                                             [store.store.slot_view(i) for i in slots], accept,
                                             capability)
        except BaseException:
            if allocated:
                await store.fail(allocated, "transfer failed")
            raise
        finally:
            store.store.return_slots([i for i in slots if i not in given])
        mine = set(allocated)
        items = [(s.hash, s.nbytes, s.checksum, d)
                 for s, d in zip(reply.seals, digests, strict=True) if s.hash in mine]
        return await store.seal(items)

    async def put(self, address: bytes, hashes: Sequence[bytes], store: KvStore, *,
                  timeout_s: float | None = None, capability: bytes = b"") -> int:
        """Push sealed blocks of the local ``store`` into the peer's store.

        The blocks stay pinned locally while their bytes leave. The peer skips blocks it
        already holds, verifies checksums and seals. Returns how many blocks were sent.
        """
        if not hashes:
            return 0
        entries = [store.store.get(h) for h in hashes]
        lease = f"put-{uuid.uuid4().hex}"
        timeout = timeout_s or self.settings.transfer_timeout_s
        store.pin(lease, hashes, timeout)  # raises BlockEvicted for a missing block
        try:
            namespaces = {e.namespace for e in entries if e is not None}
            if len(namespaces) != 1:
                raise InvalidRequest("one put carries blocks of one namespace")
            return await self._put(address, store.store, entries, namespaces.pop(), timeout,
                                   capability)
        finally:
            store.unpin(lease)

    # ------------------------------------------------------------------------ internals

    @contextlib.asynccontextmanager
    async def _permit(self) -> AsyncIterator[_PermitBuffers]:
        buf = await self._buffers.get()
        self._inflight += 1
        try:
            yield buf
        finally:
            self._inflight -= 1
            self._buffers.put_nowait(buf)

    async def _connection(self, address: bytes) -> _Conn:
        conn = self._conns.get(address)
        if conn is not None and not conn.ep.closed:
            return conn
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.ep.closed:
                return conn
            host, port = decode_address(address)
            init_ucx(self.settings)
            import ucxx

            attempt = 0
            while True:
                # A connection attempt sometimes never completes its handshake (seen after
                # a peer died mid-transfer); a fresh attempt does. The transfer's deadline
                # bounds the retries.
                attempt += 1
                try:
                    ep = await ucxx.create_endpoint(
                        host, port, connect_timeout=self.settings.connect_timeout_s)
                    break
                except TimeoutError:
                    log.info("UCX connect attempt timed out; retrying", peer=address.decode(),
                             attempt=attempt)
                except _ucx_error() as e:
                    raise PeerGone(f"cannot connect to {address.decode()}: {e}") from e
            conn = _Conn(address, ep)
            self._conns[address] = conn
            return conn

    def _drop(self, conn: _Conn | None) -> None:
        if conn is None:
            return
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        _abort(conn.ep, self.settings)

    async def _exchange_header(self, conn: _Conn, buf: bytearray, msg: wire.Message,
                               xfer_id: int) -> wire.BlockReply:
        batch = _Batch(conn.ep, lambda: self._drop(conn))
        batch.recv(buf, xfer_tag(xfer_id, 0))
        batch.send(_frame(msg), CTRL_TAG)
        await batch.wait()
        return _check_reply(_unframe(buf, wire.BlockReply), xfer_id)

    @staticmethod
    def _vet_get_reply(address: bytes, buf: bytearray, xfer_id: int, hashes: Sequence[bytes],
                       landing: Sequence[np.ndarray], counts: list[int]) -> wire.BlockReply:
        """The get reply in ``buf``, if it answers the request; else a typed error."""
        reply = _check_reply(_unframe(buf, wire.BlockReply), xfer_id)
        if not reply.ok:
            raise _reply_error(reply)
        if counts and not reply.coalesced:
            # Its per-block messages are not what our receives wait for.
            raise MalformedMessage(
                f"{address.decode()} ignored the coalesced layout of a get (a build "
                "before coalescing?); dataplane.coalesce_below_bytes = 0 turns it off")
        if reply.coalesced and not counts:
            raise MalformedMessage("get reply coalesced, which was not asked for")
        if ([r.hash for r in reply.blocks] != list(hashes) or len(reply.seals) != len(hashes)
                or any(s.nbytes > v.nbytes for s, v in zip(reply.seals, landing, strict=True))):
            raise MalformedMessage("get reply does not match the request")
        return reply

    async def _guarded(self, op: str, address: bytes, timeout: float,
                       body: Callable[[_PermitBuffers, Callable[[], _Conn]], Awaitable[Any]]
                       ) -> Any:
        """Run one exchange under its deadline; map failures to typed errors, aborting
        the connection whenever UCX may still hold requests on our buffers (the permit's
        buffers go back to the pool only after that)."""
        t0 = time.perf_counter()
        conn: _Conn | None = None
        outcome = "ok"

        async def connect() -> _Conn:
            nonlocal conn
            conn = await self._connection(address)
            return conn

        try:
            async with self._permit() as buf:
                try:
                    async with asyncio.timeout(timeout), _progress_while_busy():
                        return await body(buf, connect)  # type: ignore[arg-type]
                except TimeoutError:
                    outcome = "timeout"
                    self._drop(conn)
                    raise TransferTimeout(f"{op} from {address.decode()} missed its "
                                          f"{timeout:.3g} s deadline") from None
                except _truncated_error() as e:
                    outcome = "malformed"
                    self._drop(conn)
                    raise MalformedMessage(f"{op}: oversized message from {address!r}") from e
                except _ucx_error() as e:
                    outcome = "peer_gone"
                    self._drop(conn)
                    raise PeerGone(f"{op} from {address.decode()}: {e!r}") from e
                except _CleanFailure as e:
                    outcome = e.error.code.value
                    raise e.error from None
                except CpdError as e:
                    outcome = e.code.value
                    self._drop(conn)
                    raise
                except BaseException:
                    outcome = "cancelled"
                    self._drop(conn)
                    raise
        finally:
            self._metrics.done(op, outcome, 0, time.perf_counter() - t0)

    async def _get(self, address: bytes, hashes: Sequence[bytes], namespace: str,
                   timeout_s: float | None, landing: Sequence[np.ndarray],
                   accept: Callable[[wire.BlockReply], Awaitable[None]],
                   capability: bytes = b"") -> tuple[wire.BlockReply, list[int]]:
        """One get exchange. The receives are posted into ``landing`` (one view per block,
        a block's bytes fill its prefix) while the peer looks the blocks up, all awaited by
        one :class:`_Batch`: each block is checksummed as it lands; runs of small blocks
        (:func:`coalesce_runs`) land in the permit's staging buffers instead, one receive
        per run, and are copied into their views once the reply gave their lengths.
        ``accept`` vets the reply before any result is used. Returns the reply and the
        xxh3-64 of each received block (as it lies in its landing view)."""
        if not 0 < len(hashes) <= self.settings.max_blocks_per_transfer:
            raise InvalidRequest(f"{len(hashes)} blocks in one get; "
                                 f"1..{self.settings.max_blocks_per_transfer}")
        timeout = timeout_s or self.settings.transfer_timeout_s
        t0 = time.perf_counter()
        runs = coalesce_runs([v.nbytes for v in landing], self.settings)
        counts = _runs_field(runs)

        async def body(bufs: _PermitBuffers, connect: Callable[[], Awaitable[_Conn]]) -> Any:
            nonlocal t0
            conn = await connect()
            # The bandwidth estimate times the bytes, not the connection set-up before.
            t0 = time.perf_counter()
            x = next(conn.ids)
            batch = _Batch(conn.ep, lambda: self._drop(conn))
            digests = [0] * len(landing)
            seals: list[wire.BlockSeal] = []  # the reply's, once it was vetted
            waiting: list[Callable[[], None]] = []  # landed before the reply was vetted

            def once_vetted(fn: Callable[[], None]) -> None:
                if seals:
                    fn()
                else:
                    waiting.append(fn)

            def check(i: int) -> None:  # a block of its own landed
                digests[i] = checksum(landing[i][:seals[i].nbytes])  # while still in cache

            def post_run(lane: list[tuple[int, int]], k: int, staging: np.ndarray) -> None:
                # The runs of one staging buffer in turn: run k+1's receive is posted once
                # run k was copied out (the peer sends a lane's runs in order).
                start, count = lane[k]
                end = start + count

                def landed() -> None:
                    digests[start:end] = _unpack(staging, seals[start:end], landing[start:end])
                    if k + 1 < len(lane):
                        post_run(lane, k + 1, staging)

                size = sum(v.nbytes for v in landing[start:end])
                batch.recv(staging[:size], xfer_tag(x, 2 + start),
                           lambda: once_vetted(landed))

            header = batch.recv(bufs.header, xfer_tag(x, 0))
            try:
                # The request leaves first, so the peer looks its blocks up while the
                # receives are posted here; UCX matches a message that comes before its
                # receive once that is posted (a large one waits at the sender).
                batch.send(_frame(wire.BlockGet(
                    xfer_id=x, hashes=wire.join_hashes(list(hashes)), namespace=namespace,
                    timeout_ms=int(timeout * 1000), capability=capability, runs=counts)),
                    CTRL_TAG)
                for start, count in runs:
                    if count == 1:
                        batch.recv(landing[start], xfer_tag(x, 2 + start),
                                   functools.partial(once_vetted, functools.partial(check, start)))
                packed = [r for r in runs if r[1] > 1]
                for j, staging in enumerate(bufs.staging):
                    if lane := packed[j::len(bufs.staging)]:
                        post_run(lane, 0, staging)
                await batch.wait(until=header)
                reply = self._vet_get_reply(address, bufs.header, x, hashes, landing, counts)
                await accept(reply)
                seals[:] = reply.seals
                for fn in waiting:
                    fn()
                await batch.wait()
            except BaseException:
                # Even after a clean refusal the posted receives still point at our
                # buffers: aborting the endpoint is what cancels them in UCX.
                self._drop(conn)
                raise
            return reply, digests

        reply, digests = await self._guarded("get", address, timeout, body)
        nbytes = sum(s.nbytes for s in reply.seals)
        seconds = time.perf_counter() - t0
        self.meter.record(nbytes, seconds)
        self._metrics.bytes.add(nbytes, {"op": "get"})
        return reply, digests

    async def _put(self, address: bytes, store: BlockStore, entries: Sequence[Any],
                   namespace: str, timeout: float, capability: bytes = b"") -> int:
        t0 = time.perf_counter()
        sent = 0

        async def body(bufs: _PermitBuffers, connect: Callable[[], Awaitable[_Conn]]) -> int:
            nonlocal sent, t0
            buf = bufs.header
            conn = await connect()
            t0 = time.perf_counter()  # bytes, not connection set-up (as for a get)
            x = next(conn.ids)
            seals = [e.seal for e in entries]
            req = wire.BlockPut(xfer_id=x, namespace=namespace, blocks=[e.ref for e in entries],
                                seals=seals, timeout_ms=int(timeout * 1000),
                                capability=capability)
            ready = await self._exchange_header(conn, buf, req, x)
            if not ready.ok:
                raise _reply_error(ready)
            if len(ready.accepted) != len(entries):
                raise MalformedMessage("put go-ahead does not match the request")
            batch = _Batch(conn.ep, lambda: self._drop(conn))
            batch.recv(buf, xfer_tag(x, 1))  # the final status
            send = [i for i, flag in enumerate(ready.accepted) if flag]
            for i in send:
                batch.send(store.arena[entries[i].slot, :entries[i].nbytes], xfer_tag(x, 2 + i))
            await batch.wait()
            final = _check_reply(_unframe(buf, wire.BlockReply), x)
            if not final.ok:
                raise _reply_error(final)
            sent = sum(entries[i].nbytes for i in send)
            return len(send)

        count = await self._guarded("put", address, timeout, body)
        self.meter.record(sent, time.perf_counter() - t0)
        self._metrics.bytes.add(sent, {"op": "put"})
        return count


def _store_checksum(digests: list[int], index: int, view: np.ndarray) -> None:
    digests[index] = checksum(view)


def _pack(staging: np.ndarray, arena: np.ndarray, entries: Sequence[Any]) -> int:
    """Copy the blocks of ``entries`` back to back into ``staging``; returns the bytes."""
    offset = 0
    for e in entries:
        staging[offset:offset + e.nbytes] = arena[e.slot, :e.nbytes]
        offset += e.nbytes
    return offset


def _unpack(staging: np.ndarray, seals: Sequence[wire.BlockSeal],
            views: Sequence[np.ndarray]) -> list[int]:
    """Copy a coalesced run out of ``staging`` into its blocks' landing ``views``;
    returns the xxh3-64 of each block as it landed (computed while still in cache)."""
    digests = []
    offset = 0
    for seal, view in zip(seals, views, strict=True):
        landed = view[:seal.nbytes]
        landed[:] = staging[offset:offset + seal.nbytes]
        digests.append(checksum(landed))
        offset += seal.nbytes
    return digests


class _CleanFailure(Exception):
    """A typed error the peer reported in a header: nothing else is in flight, so the
    connection stays usable."""

    def __init__(self, error: CpdError) -> None:
        super().__init__(str(error))
        self.error = error


def _reply_error(reply: wire.BlockReply) -> _CleanFailure:
    msg = reply.message
    if reply.missing:
        msg += f" (missing {', '.join(h.hex() for h in wire.split_hashes(reply.missing)[:4])})"
    return _CleanFailure(error_from_wire(reply.code, msg, False))


def _check_reply(reply: wire.BlockReply, xfer_id: int) -> wire.BlockReply:
    if reply.xfer_id != xfer_id:
        raise MalformedMessage(f"reply for transfer {reply.xfer_id} on the tag of {xfer_id}")
    return reply


def _byte_view(buf: Any) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("destination buffers must be writable and contiguous")
    return arr.reshape(-1)
