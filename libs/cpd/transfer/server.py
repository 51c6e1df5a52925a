"""The UCX listener of one worker: serves gets from and puts into its block store."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cpd.kvstore import BlockStore, KvStore, checksum
from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings
from cpd.ops.netif import interface_ipv4
from cpd.protocol import wire
from cpd.protocol.capability import Keyring
from cpd.protocol.errors import (
    BlockEvicted,
    CapabilityDenied,
    ChecksumMismatch,
    CpdError,
    InvalidRequest,
    WrongKind,
)
from cpd.protocol.lifecycle import BlockState

from .framing import (
    CTRL_TAG,
    encode_address,
    frame,
    header_capacity,
    pack_run,
    runs_from_field,
    unframe,
    xfer_tag,
)
from .meter import TransferMetrics
from .runtime import (
    Batch,
    abort_endpoint,
    active_transports,
    init_ucx,
    progress_while_busy,
    recv_idle,
    ucx_error,
)

log = telemetry.get_logger("cpd.transfer")

class TransferServer:
    """The UCX listener of one worker: serves gets from and puts into its store.

    With a ``keyring`` (every worker has one) each get and put must present the
    capability of its namespace; without, the server is open (tools and tests).
    """

    # A cpd.ops.audit.AuditLog when worker.audit_dir is set: every get served is recorded.
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
        self._metrics = TransferMetrics()

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
        return encode_address(self.advertise_host, self.settings.advertise_port or self.port)

    @functools.cached_property
    def advertise_host(self) -> str:
        """The host peers reach this listener at: ``advertise_interface``'s address when
        set (read once), else ``advertise_host``."""
        iface = self.settings.advertise_interface
        return interface_ipv4(iface) if iface else self.settings.advertise_host

    async def start(self) -> TransferServer:
        """Initialise UCX and start listening; returns ``self``."""
        _ = self.advertise_host  # a missing interface fails here, not at a heartbeat
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
            abort_endpoint(ep, self.settings)
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
                await recv_idle(ep, buf, CTRL_TAG)
                try:
                    msg = unframe(buf, wire.Message)
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
        except ucx_error() as e:
            log.debug("transfer connection closed", conn=conn_id, reason=repr(e))
        finally:
            self._eps.discard(ep)
            self._serving.discard(me)  # type: ignore[arg-type]
            abort_endpoint(ep, self.settings)
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
                async with progress_while_busy():
                    nbytes = await self._handle_get(ep, conn_id, msg)
            elif isinstance(msg, wire.BlockPut):
                async with progress_while_busy():
                    nbytes = await self._handle_put(ep, conn_id, msg)
            else:
                log.warning("unexpected message on the data plane", kind=op)
                outcome = "invalid"
        except (TimeoutError, ucx_error()) as e:
            # The peer is gone or stalled: drop the connection (its loop ends too).
            outcome = "timeout" if isinstance(e, TimeoutError) else "peer_gone"
            log.info("transfer aborted", op=op, conn=conn_id, reason=repr(e))
            abort_endpoint(ep, self.settings)
        except CpdError as e:
            outcome = e.code.value
        finally:
            self._metrics.done(f"serve_{op}", outcome, nbytes, time.perf_counter() - t0)

    def _timeout(self, timeout_ms: int) -> float:
        return timeout_ms / 1000 if timeout_ms else self.settings.transfer_timeout_s

    async def _reply(self, ep: Any, xfer_id: int, index: int, reply: wire.BlockReply) -> None:
        await ep.send(frame(reply), tag=xfer_tag(xfer_id, index))

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
        hashes, runs = await self._parse_get(ep, req)
        timeout = self._timeout(req.timeout_ms)
        async with asyncio.timeout(timeout), self._slots:
            # Blocks on this node's disk tier are read into the arena first.
            await self.kv.promote(hashes, req.namespace)
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
                namespace = await self._vet_get_entries(ep, x, entries, runs)
                if self.audit is not None:
                    self._audit_get(namespace, entries)
                await self._send_get(ep, x, namespace, entries, runs)
            finally:
                self.store.unpin(lease)
        return sum(e.nbytes for e in entries)

    async def _parse_get(self, ep: Any, req: wire.BlockGet
                         ) -> tuple[list[bytes], list[tuple[int, int]]]:
        """The hashes and coalesced runs a get asks for; a request this server cannot
        serve is answered with its typed error, which is raised."""
        try:
            hashes = wire.split_hashes(req.hashes)
            if not 0 < len(hashes) <= self.settings.max_blocks_per_transfer:
                raise InvalidRequest(
                    f"{len(hashes)} blocks; 1..{self.settings.max_blocks_per_transfer}")
            runs = runs_from_field(req.runs, len(hashes)) if req.runs else []
            if runs and not self.settings.coalesce_message_bytes:
                raise InvalidRequest("coalesced gets are off at this server "
                                     "(dataplane.coalesce_message_bytes = 0)")
        except CpdError as e:
            await self._reply_error(ep, req.xfer_id, 0, e)
            raise
        return hashes, runs

    async def _vet_get_entries(self, ep: Any, xfer_id: int, entries: list[Any],
                               runs: list[tuple[int, int]]) -> str:
        """The one namespace of a get's (pinned) blocks; blocks of several namespaces or
        a coalesced run larger than a staging buffer are refused, typed."""
        namespaces = {e.namespace for e in entries}
        largest = max((sum(e.nbytes for e in entries[start:start + count])
                       for start, count in runs if count > 1), default=0)
        try:
            if len(namespaces) != 1:
                raise InvalidRequest("one get carries blocks of one namespace")
            if largest > self.settings.coalesce_message_bytes:
                raise InvalidRequest(
                    f"a coalesced run of {largest} bytes exceeds this server's "
                    f"dataplane.coalesce_message_bytes {self.settings.coalesce_message_bytes}")
        except CpdError as e:
            await self._reply_error(ep, xfer_id, 0, e)
            raise
        return namespaces.pop()

    async def _send_get(self, ep: Any, xfer_id: int, namespace: str, entries: list[Any],
                        runs: list[tuple[int, int]]) -> None:
        """Send a get's reply and every block (pinned by the caller), and await them all."""
        x = xfer_id
        # The reply and every block are posted at once (the reply first: the client needs
        # its seals to check the blocks). A failure aborts the endpoint before the slots
        # are unpinned and the staging buffer reused: sends may still be reading them.
        batch = Batch(ep, lambda: abort_endpoint(ep, self.settings))
        batch.send(frame(wire.BlockReply(
            xfer_id=x, namespace=namespace, blocks=[e.ref for e in entries],
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

    def _post_block(self, batch: Batch, tag: int, view: np.ndarray,
                    then: Callable[[], None] | None = None) -> None:
        """Post one message of block bytes (a view into the arena or a staging buffer)."""
        batch.send(view, tag, then)

    def _post_runs(self, batch: Batch, xfer_id: int, entries: list[Any],
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
                size = pack_run(staging, arena, entries[start:start + count])
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
                batch = Batch(ep, lambda: abort_endpoint(ep, self.settings))
                digests = [0] * len(new)
                for k, (i, e) in enumerate(new):
                    view = self.store.arena[e.slot, :req.seals[i].nbytes]
                    batch.recv(view, xfer_tag(x, 2 + i), functools.partial(
                        _store_checksum, digests, k, view))
                batch.send(frame(wire.BlockReply(xfer_id=x, accepted=accepted)),
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



def _store_checksum(digests: list[int], index: int, view: np.ndarray) -> None:
    digests[index] = checksum(view)


