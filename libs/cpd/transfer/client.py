"""Gets and puts of blocks from and to peers' stores, one reused connection per peer."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpd.kvstore import BlockStore, KvStore
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

from .connections import Connection, ConnectionPool
from .framing import (
    CTRL_TAG,
    CleanFailure,
    check_reply,
    coalesce_runs,
    frame,
    reply_failure,
    runs_field,
    unframe,
    xfer_tag,
)
from .get_exchange import GetExchange, vet_get_reply
from .meter import BandwidthMeter, TransferMetrics
from .permits import PermitBuffers, Permits
from .runtime import Batch, progress_while_busy, truncated_error, ucx_error

Expected = Mapping[bytes, int] | Callable[[], Awaitable[Mapping[bytes, int]]]
"""What blocks' bytes must checksum to, by hash: a mapping, or a function giving one."""

log = telemetry.get_logger("cpd.transfer")


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
                                             settings.bandwidth_min_bytes,
                                             max_age_s=settings.bandwidth_max_age_s)
        self._pool = ConnectionPool(settings)
        self._permits = Permits(settings)
        self._metrics = TransferMetrics()

    @property
    def _conns(self) -> dict[bytes, Connection]:
        """The open connections by peer address (for tests and diagnostics)."""
        return self._pool.conns

    @property
    def in_flight(self) -> int:
        """How many exchanges hold a permit now."""
        return self._permits.in_flight

    async def close(self) -> None:
        """Close every connection."""
        await self._pool.close()

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
                   capability: bytes = b"", expected: Expected | None = None
                   ) -> list[wire.BlockSeal]:
        """Copy sealed blocks from the peer at ``address`` into the local ``store``.

        Blocks already held locally are not fetched. The new ones go through the local
        lifecycle (allocated → writing → sealed, or failed) like any other write; a block
        whose bytes fail the checksum is failed and :class:`~cpd.protocol.errors.ChecksumMismatch`
        is raised after the good ones are sealed. The checksum is ``expected``'s for the
        blocks it names (what their writer sealed, as kvindex recorded it: a peer cannot
        vouch for bytes it forged; a function is awaited once the bytes landed, so its
        answer is sought meanwhile), else the peer's reply's. A reply for another
        namespace than asked is refused. Returns the seals of the new blocks.
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
        try:
            vouched = (await expected() if callable(expected) else expected) or {}
        except BaseException:
            await store.fail(allocated, "transfer failed")
            raise
        items = [(s.hash, s.nbytes, vouched.get(s.hash, s.checksum), d)
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

    def is_connected(self, address: bytes) -> bool:
        """Whether a connection to the peer at ``address`` is open."""
        return self._pool.is_open(address)

    async def connect_ahead(self, address: bytes) -> bool:
        """Open the connection to the peer at ``address`` before any transfer needs it, so
        the first one does not pay the handshake (and, in a new process, UCX's first
        endpoint set-up). One handshake, bounded by ``connect_timeout_s`` and never cancelled
        part-way; a transfer that needs the connection meanwhile waits
        for it under its own deadline. Returns whether the connection is open; failures are
        logged, not raised (the transfer that needs the peer dials again)."""
        try:
            async with progress_while_busy():
                await self._pool.get(address, attempts=1)
        except Exception as e:  # a best-effort dial must not end its caller
            log.info("UCX connection ahead of need failed", peer=address.decode(),
                     error=e.code.value if isinstance(e, CpdError) else type(e).__name__,
                     detail=str(e))
            return False
        return True

    # ------------------------------------------------------------------------ internals

    async def _exchange_header(self, conn: Connection, buf: bytearray, msg: wire.Message,
                               xfer_id: int) -> wire.BlockReply:
        batch = Batch(conn.ep, lambda: self._pool.drop(conn))
        batch.recv(buf, xfer_tag(xfer_id, 0))
        batch.send(frame(msg), CTRL_TAG)
        await batch.wait()
        return check_reply(unframe(buf, wire.BlockReply), xfer_id)

    async def _guarded(self, op: str, address: bytes, timeout: float,
                       body: Callable[[PermitBuffers, Callable[[], Connection]], Awaitable[Any]]
                       ) -> Any:
        """Run one exchange under its deadline; map failures to typed errors, aborting
        the connection whenever UCX may still hold requests on our buffers (the permit's
        buffers go back to the pool only after that)."""
        t0 = time.perf_counter()
        conn: Connection | None = None
        outcome = "ok"

        async def connect() -> Connection:
            nonlocal conn
            conn = await self._pool.get(address)
            return conn

        try:
            async with self._permits.take() as buf:
                try:
                    async with asyncio.timeout(timeout), progress_while_busy():
                        return await body(buf, connect)  # type: ignore[arg-type]
                except TimeoutError:
                    outcome = "timeout"
                    self._pool.drop(conn)
                    raise TransferTimeout(f"{op} from {address.decode()} missed its "
                                          f"{timeout:.3g} s deadline") from None
                except truncated_error() as e:
                    outcome = "malformed"
                    self._pool.drop(conn)
                    raise MalformedMessage(f"{op}: oversized message from {address!r}") from e
                except ucx_error() as e:
                    outcome = "peer_gone"
                    self._pool.drop(conn)
                    raise PeerGone(f"{op} from {address.decode()}: {e!r}") from e
                except CleanFailure as e:
                    outcome = e.error.code.value
                    raise e.error from None
                except CpdError as e:
                    outcome = e.code.value
                    self._pool.drop(conn)
                    raise
                except BaseException:
                    outcome = "cancelled"
                    self._pool.drop(conn)
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

        async def body(bufs: PermitBuffers, connect: Callable[[], Awaitable[Connection]]) -> Any:
            nonlocal t0
            conn = await connect()
            # The bandwidth estimate times the bytes, not the connection set-up before.
            t0 = time.perf_counter()
            exchange = GetExchange(conn, Batch(conn.ep, lambda: self._pool.drop(conn)), landing)
            request = wire.BlockGet(
                xfer_id=exchange.xfer_id, hashes=wire.join_hashes(list(hashes)),
                namespace=namespace, timeout_ms=int(timeout * 1000), capability=capability,
                runs=counts)
            try:
                return await exchange.run(bufs, request, runs, functools.partial(
                    vet_get_reply, address, bufs.header, exchange.xfer_id, hashes,
                    landing, counts, namespace), accept)
            except BaseException:
                # Even after a clean refusal the posted receives still point at our
                # buffers: aborting the endpoint is what cancels them in UCX.
                self._pool.drop(conn)
                raise

        try:
            reply, digests = await self._guarded("get", address, timeout, body)
        except TransferTimeout:
            self.meter.stalled(sum(v.nbytes for v in landing), time.perf_counter() - t0)
            raise
        nbytes = sum(s.nbytes for s in reply.seals)
        seconds = time.perf_counter() - t0
        self.meter.record(nbytes, seconds)
        self._metrics.bytes.add(nbytes, {"op": "get"})
        return reply, digests

    async def _put(self, address: bytes, store: BlockStore, entries: Sequence[Any],
                   namespace: str, timeout: float, capability: bytes = b"") -> int:
        t0 = time.perf_counter()
        sent = 0

        async def body(bufs: PermitBuffers, connect: Callable[[], Awaitable[Connection]]) -> int:
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
            batch = Batch(conn.ep, lambda: self._pool.drop(conn))
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

        try:
            count = await self._guarded("put", address, timeout, body)
        except TransferTimeout:
            self.meter.stalled(sum(e.nbytes for e in entries), time.perf_counter() - t0)
            raise
        self.meter.record(sent, time.perf_counter() - t0)
        self._metrics.bytes.add(sent, {"op": "put"})
        return count


def _byte_view(buf: Any) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("destination buffers must be writable and contiguous")
    return arr.reshape(-1)
