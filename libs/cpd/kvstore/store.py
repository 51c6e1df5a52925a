"""A worker's host-DRAM block store: the arena's logic plus its lifecycle events.

:class:`KvStore` wraps a :class:`~cpd.kvstore.arena.BlockStore` for a worker: after each
operation it hands the lifecycle events to an :class:`~cpd.kvstore.outbox.EventOutbox`,
which publishes them into ``CPD_KV`` behind the caller (in order, kept while a publish
fails); it sweeps expired leases and answers kvindex's re-announce requests
(``NodeCleared`` followed by the full state).

With a :class:`~cpd.kvstore.disk.DiskTier` below the arena, every block sealed in DRAM is
written behind to its file (the arena slot pinned while it is copied), and
:meth:`KvStore.promote` reads blocks back into the arena when a reader needs them there:
the data plane serves a peer's get, a prefill loads its own cached prefix. The disk's
lifecycle events (tier ``DISK``) go out through the same publisher, in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from cpd.ops import telemetry
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ArenaFull, CpdError
from cpd.protocol.lifecycle import BlockState

from .arena import BlockEntry, BlockStore, Lease, SealItem, as_byte_array
from .copiesgate import CopiesFirstGate
from .disk import DiskTier
from .events import KvEventPublisher
from .outbox import EventOutbox

_M = TypeVar("_M", bound=wire.Message)

# A written-behind batch pins its arena slots for at most this long.
_SPILL_PIN_S = 60.0
# Blocks written behind in one batch (one thread hop).
_SPILL_BATCH = 256
# Lifecycle events a store queues while NATS is away before it replaces them by its
# state (a re-announce's events: about one per block held, in chunks).
MAX_QUEUED_EVENTS = 100_000

log = telemetry.get_logger("cpd.kvstore")


class KvStore:
    """A :class:`BlockStore` whose lifecycle events go into ``CPD_KV``.

    Every mutating method applies the pure transition and queues its events, which one
    task publishes in order (stream order equals event order) without holding the caller
    up; :meth:`flush` waits until they are stored. With ``publisher=None`` events are
    dropped: only for tools and benchmarks that run without kvindex.
    """

    def __init__(self, store: BlockStore, publisher: KvEventPublisher | None, *,
                 disk: DiskTier | None = None,
                 max_queued_events: int = MAX_QUEUED_EVENTS,
                 gate: CopiesFirstGate | None = None) -> None:
        """``gate``: a decode arena's :class:`CopiesFirstGate`, fed kvindex's counts of
        lookups that missed lost blocks and asked at each :meth:`handoff` (None: the
        store's ``copies_first`` stays as built)."""
        self.store = store
        self.gate = gate
        self.max_queued_events = max_queued_events
        self.publisher = publisher
        self.disk = disk
        self.outbox = EventOutbox(publisher) if publisher is not None else None
        self._tasks: list[asyncio.Task[Any]] = []
        self._sub: Any = None
        self._copies_sub: Any = None
        self._on_reject: Callable[[str, CpdError], None] | None = None
        self._spills: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._leases = itertools.count()
        self.promoted = 0  # blocks read back from disk into the arena

    @property
    def node(self) -> str:
        return self.store.node

    def handoff(self) -> None:
        """A hand-off arrives: the gate, if any, sets whether the arena evicts copies
        first for what it brings."""
        if self.gate is not None:
            on = self.gate.handoff()
            if on != self.store.copies_first:
                log.info("kvstore.copies_first", on=on, misses_per_handoff=self.gate.mean)
                self.store.set_copies_first(on)

    async def flush(self) -> None:
        """Queue pending lifecycle events and wait until ``CPD_KV`` stored every event
        queued so far (a failed publish raises; its events stay queued)."""
        self._queue_events()
        if self.outbox is not None:
            await self.outbox.settled()

    def _queue_events(self, *, reannounce: bool = False) -> int:
        """Hand the transitions' events (then, to ``reannounce``, the store's state) to
        the outbox, in order; past ``max_queued_events`` unpublished, the state replaces
        them. Returns how many events of state were queued."""
        events = self.store.drain_events()
        if self.disk is not None:
            events += self.disk.index.drain_events()
        if self.outbox is None:
            return 0
        state = self._snapshot() if reannounce else []
        if self.outbox.pending + len(events) + len(state) > self.max_queued_events:
            dropped = self.outbox.clear() + len(events)
            events, state = [], state or self._snapshot()
            log.warning("kvstore.events_replaced_by_state", node=self.node,
                        dropped=dropped, events=len(state))
        self.outbox.put([*events, *state])
        return len(state)

    def _snapshot(self) -> list[wire.KvEvent]:
        """A re-announce: ``NodeCleared`` and every held block, per tier."""
        events = self.store.snapshot_events()
        if self.disk is not None:
            events += self.disk.index.snapshot_events()
        return events

    async def allocate(self, namespace: str, refs: Sequence[wire.BlockRef], *,
                       slots: Sequence[int] | None = None) -> list[BlockEntry | None]:
        """:meth:`BlockStore.allocate`, then publish (evictions, allocations)."""
        try:
            return self.store.allocate(namespace, refs, slots=slots)
        finally:
            self._queue_events()

    async def begin_write(self, hashes: Iterable[bytes]) -> None:
        try:
            self.store.begin_write(hashes)
        finally:
            self._queue_events()

    async def seal(self, items: Iterable[SealItem]) -> list[wire.BlockSeal]:
        try:
            seals = self.store.seal(items)
        finally:
            self._queue_events()
        self._write_behind(seals)
        return seals

    async def fail(self, hashes: Iterable[bytes], reason: str) -> None:
        try:
            self.store.fail(hashes, reason)
        finally:
            self._queue_events()

    async def evict(self, count: int) -> int:
        try:
            return self.store.evict(count)
        finally:
            self._queue_events()

    async def discard(self, hashes: Iterable[bytes], reason: str) -> list[bytes]:
        """Drop sealed blocks found bad and tell kvindex (see :meth:`BlockStore.discard`)."""
        try:
            dropped = self.store.discard(hashes)
        finally:
            self._queue_events()
        if dropped:
            log.warning("kvstore.discarded", node=self.node, blocks=len(dropped), reason=reason)
        return dropped

    async def take_slots(self, count: int) -> list[int]:
        """:meth:`BlockStore.take_slots`, publishing the evictions it caused."""
        try:
            return self.store.take_slots(count)
        finally:
            self._queue_events()

    async def write_blocks(self, namespace: str, refs: Sequence[wire.BlockRef],
                           payloads: Sequence[Any]) -> list[wire.BlockSeal]:
        """Allocate, copy ``payloads`` into the slots, seal: one call for a local writer.

        Blocks already held are skipped. A failure while copying fails the new blocks.
        """
        entries = await self.allocate(namespace, refs)
        new = [(e, p) for e, p in zip(entries, payloads, strict=True) if e is not None]
        if not new:
            return []
        await self.begin_write([e.hash for e, _ in new])
        try:
            items = []
            for entry, payload in new:
                src = as_byte_array(payload) if not isinstance(payload, np.ndarray) else \
                    payload.reshape(-1).view(np.uint8)
                self.store.arena[entry.slot, :src.nbytes] = src
                items.append((entry.hash, src.nbytes))
        except BaseException:
            await self.fail([e.hash for e, _ in new], "write error")
            raise
        return await self.seal(items)

    def pin(self, lease_id: str, hashes: Sequence[bytes], ttl_s: float) -> Lease:
        """Pin sealed blocks under a lease (no lifecycle event: kvindex keeps them visible)."""
        return self.store.pin(lease_id, hashes, ttl_s)

    def unpin(self, lease_id: str) -> bool:
        return self.store.unpin(lease_id)

    async def reannounce(self) -> int:
        """Publish ``NodeCleared`` and then every held block (kvindex's rebuild), after
        the events queued before; returns once they are stored."""
        queued = self._queue_events(reannounce=True)
        if self.outbox is not None:
            await self.outbox.settled()
        return queued

    async def start(self, nc: Any = None, *, sweep_interval_s: float = 1.0,
                    on_reject: Callable[[str, CpdError], None] | None = None) -> None:
        """Sweep expired leases every ``sweep_interval_s`` and, given a NATS connection,
        answer ``Reannounce`` requests on :func:`cpd.protocol.subjects.kv_reannounce`
        (``on_reject(subject, error)`` counts a malformed one). With a disk tier, the
        block files a previous incarnation left are announced first."""
        self._on_reject = on_reject
        if self.disk is not None:
            found = await asyncio.to_thread(self.disk.scan)
            held = self.disk.register(found)
            self._queue_events()
            log.info("kvstore.disk_loaded", node=self.node, files=len(found), held=held,
                     dropped=self.disk.dropped)
            self._tasks.append(asyncio.create_task(self._spill_loop(),
                                                   name=f"kvstore-spill-{self.node}"))
        self._tasks.append(asyncio.create_task(self._sweep(sweep_interval_s),
                                               name=f"kvstore-sweep-{self.node}"))
        if nc is not None:
            self._sub = await nc.subscribe(subjects.kv_reannounce(self.node),
                                           cb=self._on_reannounce)
            self._copies_sub = await nc.subscribe(subjects.kv_copies(self.node),
                                                  cb=self._on_copies)

    async def close(self) -> None:
        """Stop the sweeper and the re-announce subscription; publish what is pending."""
        for sub in (self._sub, self._copies_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._copies_sub = None
        for task in list(getattr(self, "_reannouncing", ())):
            task.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        with contextlib.suppress(CpdError):
            await self.flush()
        if self.outbox is not None:
            await self.outbox.close()

    # ------------------------------------------------------------------- disk tier

    def _write_behind(self, seals: Sequence[wire.BlockSeal]) -> None:
        if self.disk is not None and seals:
            self._spills.put_nowait([s.hash for s in seals])

    async def _spill_loop(self) -> None:
        while True:
            hashes = await self._spills.get()
            while not self._spills.empty() and len(hashes) < _SPILL_BATCH:
                hashes += self._spills.get_nowait()
            try:
                await self._spill(hashes)
            except CpdError as e:  # a block left before it was pinned
                log.warning("kvstore.spill_failed", node=self.node, error=e.code.value)

    async def _spill(self, hashes: list[bytes]) -> None:
        """Write the sealed DRAM blocks of ``hashes`` not yet on disk to their files."""
        disk, store = self.disk, self.store
        assert disk is not None
        todo = [e for h in dict.fromkeys(hashes)
                if (e := store.get(h)) is not None and e.state is BlockState.SEALED
                and h not in disk]
        if not todo:
            return
        lease = f"spill-{next(self._leases)}"
        store.pin(lease, [e.hash for e in todo], _SPILL_PIN_S)
        try:
            for ns, group in _by_namespace(todo).items():
                try:
                    fresh = disk.index.allocate(ns, [e.ref for e in group])
                except ArenaFull:  # every disk block is being read or written
                    continue
                new = [e for e, f in zip(group, fresh, strict=True) if f is not None]
                disk.index.begin_write([e.hash for e in new])
                ok = await asyncio.to_thread(self._write_files, ns, new)
                disk.index.seal([(e.hash, e.nbytes, None, e.checksum)
                                 for e, good in zip(new, ok, strict=True) if good])
                disk.index.fail([e.hash for e, good in zip(new, ok, strict=True)
                                 if not good], "write error")
        finally:
            store.unpin(lease)
            self._queue_events()

    def _write_files(self, namespace: str, entries: list[BlockEntry]) -> list[bool]:
        assert self.disk is not None
        arena = self.store.arena
        return [self.disk.write(namespace, e.ref, arena[e.slot, :e.nbytes], e.checksum)
                for e in entries]

    async def promote(self, hashes: Sequence[bytes], namespace: str | None = None) -> int:
        """Read the blocks of ``hashes`` (of ``namespace``, when given) that are on disk
        but not in the arena into it, sealed with the checksum they were written with; a
        torn or altered file is dropped from the disk tier instead. All of a namespace's
        blocks or none of them: the arena must have room. Returns how many were read."""
        disk, store = self.disk, self.store
        if disk is None:
            return 0
        todo = [d for h in dict.fromkeys(hashes)
                if h not in store and (d := disk.sealed(h)) is not None
                and namespace in (None, d.namespace)]
        if not todo:
            return 0
        lease = f"promote-{next(self._leases)}"
        disk.index.pin(lease, [d.hash for d in todo], _SPILL_PIN_S)
        read, bad = 0, []
        try:
            for ns, group in _by_namespace(todo).items():
                read += await self._promote(ns, group, bad)
        finally:
            disk.index.unpin(lease)
            if bad:  # unpinned now, so they can go
                dropped = disk.drop(bad)
                log.warning("kvstore.disk_block_dropped", node=self.node, blocks=len(dropped))
            self._queue_events()
        self.promoted += read
        return read

    async def _promote(self, namespace: str, group: list[BlockEntry], bad: list[bytes]) -> int:
        disk, store = self.disk, self.store
        assert disk is not None
        try:
            slots = store.allocate(namespace, [d.ref for d in group])
        except ArenaFull:
            return 0
        pairs = [(d, e) for d, e in zip(group, slots, strict=True) if e is not None]
        store.begin_write([e.hash for _, e in pairs])
        t0 = time.perf_counter()
        reading = asyncio.ensure_future(asyncio.to_thread(
            lambda: [disk.read_into(d, store.arena[e.slot]) for d, e in pairs]))
        try:
            ok = await asyncio.shield(reading)
        except asyncio.CancelledError:
            # The thread still writes into the slots: only once it is done may they go
            # back (a caller's deadline must not hand a slot being written to a new block).
            with contextlib.suppress(Exception):
                await reading
            store.fail([e.hash for _, e in pairs], "cancelled")
            raise
        good = [pair for pair, fine in zip(pairs, ok, strict=True) if fine]
        failed = [d.hash for (d, _), fine in zip(pairs, ok, strict=True) if not fine]
        disk.measured(sum(d.nbytes for d, _ in good), time.perf_counter() - t0)
        store.seal([(e.hash, d.nbytes, None, d.checksum) for d, e in good])
        if failed:
            store.fail(failed, "disk read")
            bad += failed
        return len(good)

    async def _sweep(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            expired = self.store.expire_leases()
            if expired:
                log.info("leases expired", node=self.node, leases=len(expired))

    def _decode(self, msg: Any, kind: type[_M]) -> _M | None:
        try:
            return wire.decode(msg.data, kind)
        except CpdError as e:
            if self._on_reject is not None:
                self._on_reject(msg.subject, e)
            else:
                log.warning("kvstore.bad_message", subject=msg.subject, error=e.code.value)
            return None

    async def _on_copies(self, msg: Any) -> None:
        """kvindex's word on which blocks have copies elsewhere (eviction order)."""
        copies = self._decode(msg, wire.BlockCopies)
        if copies is not None:
            if self.gate is not None:
                self.gate.observe(copies.kvindex, copies.misses)
            self.store.mark_copies(wire.split_hashes(copies.shared),
                                   wire.split_hashes(copies.last))

    async def _on_reannounce(self, msg: Any) -> None:
        req = self._decode(msg, wire.Reannounce)
        if req is None:
            return
        # A re-announce publishes every held block: requests that arrive while one waits
        # to run share it (a flood must not queue thousands of full re-announces), and
        # it runs off the subscription's callback, which keeps draining meanwhile.
        if getattr(self, "_reannounce_queued", False):
            if msg.reply:
                await msg.respond(b"")
            return
        self._reannounce_queued = True
        if not hasattr(self, "_reannounce_lock"):
            self._reannounce_lock = asyncio.Lock()
            self._reannouncing: set[asyncio.Task[None]] = set()
        task = asyncio.create_task(self._run_reannounce(msg, req))
        self._reannouncing.add(task)
        task.add_done_callback(self._reannouncing.discard)

    async def _run_reannounce(self, msg: Any, req: wire.Reannounce) -> None:
        async with self._reannounce_lock:
            self._reannounce_queued = False
            try:
                n = await self.reannounce()
            except CpdError as e:
                log.error("reannounce failed", error=str(e))
                return
        log.info("reannounced", node=self.node, events=n, reason=req.reason)
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(b"")


def _by_namespace(entries: Iterable[BlockEntry]) -> dict[str, list[BlockEntry]]:
    out: dict[str, list[BlockEntry]] = defaultdict(list)
    for e in entries:
        out[e.namespace].append(e)
    return out
