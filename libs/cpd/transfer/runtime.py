"""UCX in one process: its options and initialisation, the progress driver of each event
loop, and the batch loop that posts an exchange's requests at once and awaits them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings

from . import handshake

log = telemetry.get_logger("cpd.transfer")

NS_PER_S = 1_000_000_000

def ucx_options(settings: DataPlaneSettings) -> dict[str, str]:
    """The UCX options (``UCX_`` prefix dropped) this process runs with."""
    options = {"TLS": settings.ucx_tls, "RNDV_FRAG_MEM_TYPE": settings.ucx_rndv_frag_mem_type}
    if devices := settings.ucx_net_devices or settings.advertise_interface:
        options["NET_DEVICES"] = devices
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

    handshake.install()
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
async def progress_while_busy() -> AsyncIterator[None]:
    driver = _drivers.get(asyncio.get_running_loop())
    if driver is None:
        yield
        return
    async with driver.busy():
        yield


async def recv_idle(ep: Any, buf: bytearray, tag: int) -> None:
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
# The longest a busy Batch.wait runs without yielding to the event loop.
_BATCH_YIELD_S = 0.001


@functools.cache
def _request_api() -> tuple[Any, Any, Any, Any]:
    """ucxx's request-level pieces this module drives directly (:func:`init_ucx` checks
    that they exist)."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag, TagMaskFull

    return Array, Tag, TagMaskFull, hash64bits


class Batch:
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


def ucx_error() -> type[Exception]:
    from ucxx.exceptions import UCXError

    return UCXError


def truncated_error() -> type[Exception]:
    from ucxx.exceptions import UCXMessageTruncatedError

    return UCXMessageTruncatedError


def abort_endpoint(ep: Any, settings: DataPlaneSettings) -> None:
    with contextlib.suppress(Exception):
        ep.abort(period=int(settings.abort_wait_s * NS_PER_S), max_attempts=1)


