"""Gets and puts of blocks from and to peers' stores, one reused connection per peer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cpd.kvstore import BlockStore, KvStore, checksum
from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings
from cpd.protocol import wire
from cpd.protocol.errors import (
    ChecksumMismatch,
    CpdError,
    InvalidRequest,
    MalformedMessage,
    PeerGone,
    TransferTimeout,
)

from .framing import (
    CTRL_TAG,
    CleanFailure,
    check_reply,
    coalesce_runs,
    decode_address,
    frame,
    header_capacity,
    reply_failure,
    runs_field,
    unframe,
    unpack_run,
    xfer_tag,
)
from .meter import BandwidthMeter, TransferMetrics
from .runtime import (
    NS_PER_S,
    Batch,
    abort_endpoint,
    init_ucx,
    progress_while_busy,
    truncated_error,
    ucx_error,
)

log = telemetry.get_logger("cpd.transfer")

# Coalesced runs a client receives at once per transfer (each into a staging buffer of
# its own): while one run is copied out into its landing views, the next one lands.
_CLIENT_STAGING_LANES = 2


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
        self._metrics = TransferMetrics()
        self._inflight = 0

    @property
    def in_flight(self) -> int:
        return self._inflight

    async def close(self) -> None:
        """Close every connection."""
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.ep.close(period=int(self.settings.abort_wait_s * NS_PER_S))

    # ---------------------------------------------------------------------- public API

    async def get_into(self, address: bytes, hashes: Sequence[bytes], dests: Sequence[Any], *,
                       namespace: str = "", timeout_s: float | None = None,
                       capability: bytes = b"") -> list[Fetched]:
        """Fetch sealed blocks from the peer at ``address`` into ``dests`` (one writable
        buffer per block, at least the block's length), verifying every checksum.
        ``capability``: the peer's read capability of ``namespace`` (see
        :mod:`cpd.protocol.capability`); a peer that enforces them raises
        :class:`~cpd.protocol.errors.CapabilityDenied` without it."""
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
        whose bytes fail the checksum is failed and :class:`~cpd.protocol.errors.ChecksumMismatch`
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

    def is_connected(self, address: bytes) -> bool:
        """Whether a connection to the peer at ``address`` is open."""
        conn = self._conns.get(address)
        return conn is not None and not conn.ep.closed

    async def connect_ahead(self, address: bytes) -> bool:
        """Open the connection to the peer at ``address`` before any transfer needs it, so
        the first one does not pay the handshake (and, in a new process, UCX's first
        endpoint set-up). One handshake, bounded by ``connect_timeout_s`` and never cancelled
        part-way; a transfer that needs the connection meanwhile waits
        for it under its own deadline. Returns whether the connection is open; failures are
        logged, not raised (the transfer that needs the peer dials again)."""
        try:
            async with progress_while_busy():
                await self._connection(address, attempts=1)
        except Exception as e:  # a best-effort dial must not end its caller
            log.info("UCX connection ahead of need failed", peer=address.decode(),
                     error=e.code.value if isinstance(e, CpdError) else type(e).__name__,
                     detail=str(e))
            return False
        return True

    async def _connection(self, address: bytes, attempts: int | None = None) -> _Conn:
        """The open connection to ``address``, dialled if there is none. Handshakes repeat
        on a timeout, ``attempts`` times at most (``None``: until the caller's deadline)."""
        if self.is_connected(address):
            return self._conns[address]
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if self.is_connected(address):
                return self._conns[address]
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
                    if attempts is not None and attempt >= attempts:
                        raise TransferTimeout(f"no handshake with {address.decode()} in "
                                              f"{attempt} attempts") from None
                except ucx_error() as e:
                    raise PeerGone(f"cannot connect to {address.decode()}: {e}") from e
            conn = _Conn(address, ep)
            self._conns[address] = conn
            return conn

    def _drop(self, conn: _Conn | None) -> None:
        if conn is None:
            return
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        abort_endpoint(conn.ep, self.settings)

    async def _exchange_header(self, conn: _Conn, buf: bytearray, msg: wire.Message,
                               xfer_id: int) -> wire.BlockReply:
        batch = Batch(conn.ep, lambda: self._drop(conn))
        batch.recv(buf, xfer_tag(xfer_id, 0))
        batch.send(frame(msg), CTRL_TAG)
        await batch.wait()
        return check_reply(unframe(buf, wire.BlockReply), xfer_id)

    @staticmethod
    def _vet_get_reply(address: bytes, buf: bytearray, xfer_id: int, hashes: Sequence[bytes],
                       landing: Sequence[np.ndarray], counts: list[int]) -> wire.BlockReply:
        """The get reply in ``buf``, if it answers the request; else a typed error."""
        reply = check_reply(unframe(buf, wire.BlockReply), xfer_id)
        if not reply.ok:
            raise reply_failure(reply)
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
                    async with asyncio.timeout(timeout), progress_while_busy():
                        return await body(buf, connect)  # type: ignore[arg-type]
                except TimeoutError:
                    outcome = "timeout"
                    self._drop(conn)
                    raise TransferTimeout(f"{op} from {address.decode()} missed its "
                                          f"{timeout:.3g} s deadline") from None
                except truncated_error() as e:
                    outcome = "malformed"
                    self._drop(conn)
                    raise MalformedMessage(f"{op}: oversized message from {address!r}") from e
                except ucx_error() as e:
                    outcome = "peer_gone"
                    self._drop(conn)
                    raise PeerGone(f"{op} from {address.decode()}: {e!r}") from e
                except CleanFailure as e:
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
        one :class:`Batch`: each block is checksummed as it lands; runs of small blocks
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
        counts = runs_field(runs)

        async def body(bufs: _PermitBuffers, connect: Callable[[], Awaitable[_Conn]]) -> Any:
            nonlocal t0
            conn = await connect()
            # The bandwidth estimate times the bytes, not the connection set-up before.
            t0 = time.perf_counter()
            exchange = _GetExchange(conn, Batch(conn.ep, lambda: self._drop(conn)), landing)
            request = wire.BlockGet(
                xfer_id=exchange.xfer_id, hashes=wire.join_hashes(list(hashes)),
                namespace=namespace, timeout_ms=int(timeout * 1000), capability=capability,
                runs=counts)
            try:
                return await exchange.run(bufs, request, runs, functools.partial(
                    self._vet_get_reply, address, bufs.header, exchange.xfer_id, hashes,
                    landing, counts), accept)
            except BaseException:
                # Even after a clean refusal the posted receives still point at our
                # buffers: aborting the endpoint is what cancels them in UCX.
                self._drop(conn)
                raise

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
                raise reply_failure(ready)
            if len(ready.accepted) != len(entries):
                raise MalformedMessage("put go-ahead does not match the request")
            batch = Batch(conn.ep, lambda: self._drop(conn))
            batch.recv(buf, xfer_tag(x, 1))  # the final status
            send = [i for i, flag in enumerate(ready.accepted) if flag]
            for i in send:
                batch.send(store.arena[entries[i].slot, :entries[i].nbytes], xfer_tag(x, 2 + i))
            await batch.wait()
            final = check_reply(unframe(buf, wire.BlockReply), x)
            if not final.ok:
                raise reply_failure(final)
            sent = sum(entries[i].nbytes for i in send)
            return len(send)

        count = await self._guarded("put", address, timeout, body)
        self.meter.record(sent, time.perf_counter() - t0)
        self._metrics.bytes.add(sent, {"op": "put"})
        return count


class _GetExchange:
    """The receiving side of one get exchange, awaited by one :class:`Batch`.

    A receive is posted per block into its landing view, or per coalesced run into a
    staging lane (a lane's runs in turn: run k+1's receive is posted once run k was copied
    out, as the peer sends a lane's runs in order). A block is checksummed as it lands,
    while still in cache, once the reply's seals have been vetted; what landed before
    waits for them.
    """

    def __init__(self, conn: _Conn, batch: Batch, landing: Sequence[np.ndarray]) -> None:
        self.xfer_id = next(conn.ids)
        self.batch = batch
        self.landing = landing
        self.digests = [0] * len(landing)
        self.seals: list[wire.BlockSeal] = []  # the reply's, once it was vetted
        self._waiting: list[Callable[[], None]] = []  # landed before the reply was vetted

    async def run(self, bufs: _PermitBuffers, request: wire.BlockGet,
                  runs: Sequence[tuple[int, int]],
                  vet: Callable[[], wire.BlockReply],
                  accept: Callable[[wire.BlockReply], Awaitable[None]]
                  ) -> tuple[wire.BlockReply, list[int]]:
        """Send ``request``, post every receive, vet and ``accept`` the reply, and await
        every block; returns the reply and each block's xxh3-64 as it landed."""
        header = self.batch.recv(bufs.header, xfer_tag(self.xfer_id, 0))
        # The request leaves first, so the peer looks its blocks up while the receives
        # are posted here; UCX matches a message that comes before its receive once that
        # is posted (a large one waits at the sender).
        self.batch.send(frame(request), CTRL_TAG)
        for start, count in runs:
            if count == 1:
                self._post_block(start)
        packed = [r for r in runs if r[1] > 1]
        for j, staging in enumerate(bufs.staging):
            if lane := packed[j::len(bufs.staging)]:
                self._post_run(lane, 0, staging)
        await self.batch.wait(until=header)
        reply = vet()
        await accept(reply)
        self._vetted(reply.seals)
        await self.batch.wait()
        return reply, self.digests

    def _once_vetted(self, fn: Callable[[], None]) -> None:
        if self.seals:
            fn()
        else:
            self._waiting.append(fn)

    def _vetted(self, seals: Sequence[wire.BlockSeal]) -> None:
        self.seals[:] = seals
        waiting, self._waiting = self._waiting, []
        for fn in waiting:
            fn()

    def _post_block(self, i: int) -> None:
        self.batch.recv(self.landing[i], xfer_tag(self.xfer_id, 2 + i),
                        functools.partial(self._once_vetted, functools.partial(self._check, i)))

    def _check(self, i: int) -> None:  # a block of its own landed
        self.digests[i] = checksum(self.landing[i][:self.seals[i].nbytes])

    def _post_run(self, lane: Sequence[tuple[int, int]], k: int, staging: np.ndarray) -> None:
        start, count = lane[k]
        size = sum(v.nbytes for v in self.landing[start:start + count])
        self.batch.recv(staging[:size], xfer_tag(self.xfer_id, 2 + start), functools.partial(
            self._once_vetted, functools.partial(self._run_landed, lane, k, staging)))

    def _run_landed(self, lane: Sequence[tuple[int, int]], k: int, staging: np.ndarray) -> None:
        start, count = lane[k]
        end = start + count
        self.digests[start:end] = unpack_run(staging, self.seals[start:end],
                                             self.landing[start:end])
        if k + 1 < len(lane):
            self._post_run(lane, k + 1, staging)


def _byte_view(buf: Any) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("destination buffers must be writable and contiguous")
    return arr.reshape(-1)
