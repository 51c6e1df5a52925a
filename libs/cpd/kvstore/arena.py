"""The pure logic of a worker's host-DRAM block arena.

One preallocated arena of fixed-size slots, one cache block per slot, reused forever:
nothing is allocated per block or per transfer, and every block's bytes are a zero-copy
view into the arena (what the engine writes into and what UCX sends from / receives into).

:class:`BlockStore` has no I/O and no clock of its own: slots, lifecycle
``ALLOCATED → WRITING → SEALED → (evicted)``, pins under leases, and eviction that is
*prefix-closed* (a block leaves only after every child of it in this store has left)
and never touches pinned or unsealed blocks: blocks kvindex says have a copy elsewhere
first (least recently used first), then in the order of a policy
(:mod:`cpd.kvstore.eviction`: LRU, or LRU with frequency admission), so that the
cluster's arenas pool their capacity rather than hold the same blocks (a decode
worker's arena may keep to its policy alone, :mod:`cpd.kvstore.copiesgate`). Each
transition appends the lifecycle event kvindex needs to an outbox
(:meth:`BlockStore.drain_events`).
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from cpd.ops.config import DecodeCopiesFirst, Settings
from cpd.protocol import wire
from cpd.protocol.errors import (
    ArenaFull,
    BlockEvicted,
    ChecksumMismatch,
    MalformedMessage,
)
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.roles import Role

from .events import MAX_BLOCKS_PER_EVENT
from .eviction import POLICIES, EvictionPolicy, PolicyFactory, evictable

SealItem = bytes | tuple[bytes, int] | tuple[bytes, int, int] | tuple[bytes, int, int, int]
"""What :meth:`BlockStore.seal` takes per block (see there)."""


def checksum(data: Any) -> int:
    """xxh3-64 of a buffer (the checksum a block is sealed with; fits ``BlockSeal``)."""
    return xxhash.xxh3_64_intdigest(data)


def kv_block_bytes(*, layers: int, kv_heads: int, head_dim: int, block_tokens: int,
                   dtype_bytes: int) -> int:
    """Bytes of one cache block: layers × (K, V) × tokens × KV heads × head dim × dtype."""
    return layers * 2 * block_tokens * kv_heads * head_dim * dtype_bytes


def as_byte_array(buf: Any) -> np.ndarray:
    """A writable, contiguous uint8 numpy view of ``buf`` without copying.

    Accepts numpy arrays, objects with the buffer protocol and CPU torch tensors (through
    ``t.view(torch.uint8).numpy()``), so an engine can hand its own pinned KV memory over
    as the arena.
    """
    if hasattr(buf, "numpy") and hasattr(buf, "is_contiguous"):  # a torch tensor
        import torch

        if not buf.is_contiguous():
            raise ValueError("the arena tensor must be contiguous")
        arr = buf.view(torch.uint8).numpy()
    else:
        arr = np.asarray(buf) if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("the arena must be a writable, contiguous buffer")
    return arr.reshape(-1)


@dataclass(slots=True, eq=False)
class BlockEntry:
    """One block held in the arena."""

    hash: bytes
    parent: bytes
    num_tokens: int
    namespace: str
    slot: int
    state: BlockState = BlockState.ALLOCATED
    nbytes: int = 0
    checksum: int = 0
    pins: int = 0
    children: int = 0  # children of this block present in this store
    # Eviction policy state (cpd.kvstore.eviction): the last use, the last use that
    # counted as a reference, the reference count, whether in the admission window.
    tick: int = 0
    ref_tick: int = 0
    freq: int = 0
    in_window: bool = False
    # kvindex said another served copy exists (a peer's DRAM or disk, this node's disk):
    # such blocks leave first (:meth:`BlockStore.mark_copies`).
    shared: bool = False

    @property
    def ref(self) -> wire.BlockRef:
        return wire.BlockRef(self.hash, self.parent, self.num_tokens)

    @property
    def seal(self) -> wire.BlockSeal:
        return wire.BlockSeal(self.hash, self.nbytes, self.checksum)


@dataclass(slots=True)
class Lease:
    """Blocks pinned together until :meth:`BlockStore.unpin` or ``expires``."""

    lease_id: str
    hashes: tuple[bytes, ...]
    expires: float


def evicts_copies_first(role: str, decode_copies_first: DecodeCopiesFirst) -> bool:
    """Whether the arena of a worker of ``role`` starts out evicting blocks with a copy
    elsewhere first: always on the prefill side, on decode unless
    ``dataplane.decode_copies_first`` is "never" ("adaptive" starts on and follows
    :class:`~cpd.kvstore.copiesgate.CopiesFirstGate`). The workers and the planner both
    ask here."""
    return role != Role.DECODE or decode_copies_first != "never"


class BlockStore:
    """Slots, lifecycle, pins and prefix-closed eviction of one arena (pure logic).

    Not thread-safe: one event loop owns it. Time comes from ``clock`` (monotonic
    seconds) so tests control lease expiry.
    """

    def __init__(self, slot_bytes: int, num_slots: int, *, node: str = "",
                 tier: wire.Tier = wire.Tier.DRAM, arena: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 capability: Callable[[str], bytes] | None = None,
                 eviction: str | PolicyFactory = "lru", backed: bool = True,
                 on_removed: Callable[[list[BlockEntry]], None] | None = None,
                 copies_first: bool = True) -> None:
        """``capability``: namespace → this node's read capability (a
        :meth:`cpd.protocol.capability.Keyring.issue`), attached to every ``BlocksSealed`` event so
        kvindex can hand it to readers; ``None`` attaches none (open data plane).
        ``eviction``: a policy of :data:`~cpd.kvstore.eviction.POLICIES` by name (what
        ``dataplane.eviction`` selects) or a factory of one. ``backed=False`` keeps the
        bookkeeping without bytes in memory (a tier whose blocks live elsewhere, such as
        :class:`~cpd.kvstore.disk.DiskTier`'s files): slots only count capacity, and
        :meth:`seal` needs each block's digest. ``on_removed`` is called with the sealed
        blocks that leave (evicted or discarded), as they leave. ``copies_first``: blocks
        kvindex says have a copy elsewhere leave before the policy's victims (False: the
        policy alone decides; :meth:`set_copies_first` switches)."""
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("slot_bytes and num_slots must be positive")
        self.capability = capability
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.node = node
        self.tier = tier
        self.clock = clock
        self.backed = backed
        self._on_removed = on_removed
        if not backed:
            flat = np.zeros(0, dtype=np.uint8)
        elif arena is None:
            # np.zeros maps pages lazily; the arena is reused, so each page faults once.
            flat = np.zeros(slot_bytes * num_slots, dtype=np.uint8)
        else:
            flat = as_byte_array(arena)
            if flat.nbytes < slot_bytes * num_slots:
                raise ValueError(f"arena of {flat.nbytes} bytes is smaller than "
                                 f"{num_slots} slots of {slot_bytes}")
        self.arena = flat.reshape(0, slot_bytes) if not backed else \
            flat[:slot_bytes * num_slots].reshape(num_slots, slot_bytes)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._entries: dict[bytes, BlockEntry] = {}
        # Children present here whose parent is not (yet) held: adopted on the parent's arrival.
        self._orphans: dict[bytes, int] = defaultdict(int)
        if isinstance(eviction, str):
            if eviction not in POLICIES:
                raise ValueError(f"unknown eviction policy {eviction!r}")
            eviction = POLICIES[eviction]
        self._policy: EvictionPolicy = eviction(num_slots, self._entries)
        # Lazy heap of (tick, hash) of evictable blocks with a copy elsewhere.
        self._shared: list[tuple[int, bytes]] = []
        self.copies_first = copies_first
        self._leases: dict[str, Lease] = {}
        self._outbox: list[wire.KvEvent] = []
        self._evicted: list[BlockEntry] = []  # evicted by the current operation
        self.evictions = 0

    # ------------------------------------------------------------------------ queries

    @classmethod
    def from_settings(cls, settings: Settings, slot_bytes: int, *, node: str | None = None,
                      **kwargs: Any) -> BlockStore:
        """A store sized by ``dataplane.arena_bytes`` with slots of ``slot_bytes`` (the
        engine profile's :attr:`~cpd.engines.profile.EngineProfile.slot_bytes`),
        evicting by ``dataplane.eviction``."""
        size = slot_bytes
        slots = settings.dataplane.arena_bytes // size
        if slots < 1:
            raise ValueError(f"dataplane.arena_bytes {settings.dataplane.arena_bytes} holds no "
                             f"block of {size} bytes")
        kwargs.setdefault("eviction", settings.dataplane.eviction)
        return cls(size, slots, node=settings.node.node_id if node is None else node, **kwargs)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: bytes) -> BlockEntry | None:
        """The entry of ``block_hash``, if held (any state)."""
        return self._entries.get(block_hash)

    def entries(self) -> list[BlockEntry]:
        """Every held block (a copy of the list; entries are live)."""
        return list(self._entries.values())

    @property
    def eviction(self) -> str:
        """The eviction policy's name (:data:`~cpd.kvstore.eviction.POLICIES`)."""
        return self._policy.name

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot_view(self, slot: int) -> np.ndarray:
        """The whole slot ``slot`` as a writable uint8 view into the arena."""
        return self.arena[slot]

    def view(self, block_hash: bytes) -> np.ndarray:
        """The slot of a held block (write here while ALLOCATED/WRITING)."""
        entry = self._entries.get(block_hash)
        if entry is None:
            raise BlockEvicted(f"block {block_hash.hex()} is not held")
        return self.arena[entry.slot]

    def data(self, block_hash: bytes) -> np.ndarray:
        """The sealed bytes of a block (``nbytes`` long), a view into the arena."""
        entry = self._sealed(block_hash)
        return self.arena[entry.slot, :entry.nbytes]

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    # ----------------------------------------------------------------------- lifecycle

    def allocate(self, namespace: str, refs: Sequence[wire.BlockRef], *,
                 slots: Sequence[int] | None = None) -> list[BlockEntry | None]:
        """Give each new block a slot (ALLOCATED); ``None`` for blocks already held.

        Evicts evictable blocks (in the policy's order) when the free list runs out; all or
        nothing: raises :class:`~cpd.protocol.errors.ArenaFull` (keeping what it evicted) when the
        batch cannot fit. A block's parent in the same batch counts as present. With
        ``slots`` (borrowed through :meth:`take_slots`, one per ref) block ``i`` takes
        ``slots[i]`` instead; the slots of blocks already held stay with the caller.
        """
        if slots is not None and len(slots) != len(refs):
            raise ValueError("one borrowed slot per block")
        if len({r.hash for r in refs}) != len(refs):
            raise ValueError("duplicate block hash in one allocation")
        for r in refs:
            if len(r.hash) != wire.HASH_BYTES:
                raise MalformedMessage(f"block hash of {len(r.hash)} bytes")
        new: list[BlockEntry] = []
        result: list[BlockEntry | None] = []
        for r in refs:
            if r.hash in self._entries:
                self._touch(self._entries[r.hash])
                result.append(None)
                continue
            # Registered first (slot -1) so their parents cannot be evicted to make room.
            entry = BlockEntry(r.hash, r.parent, r.num_tokens, namespace, slot=-1)
            self._add(entry)
            self._policy.added(entry)
            new.append(entry)
            result.append(entry)
        while slots is None and len(self._free) < len(new):
            if not self._evict_one():
                for entry in reversed(new):
                    self._remove(entry)
                self._flush_evictions()
                raise ArenaFull(f"{len(new)} blocks do not fit: {len(self._free)} free slots "
                                f"and nothing evictable")
        if slots is None:
            for entry in new:
                entry.slot = self._free.pop()
        else:
            for entry, ref, slot in zip(result, refs, slots, strict=True):
                if entry is not None and ref.hash == entry.hash:
                    entry.slot = slot
        self._flush_evictions()
        if new:
            self._emit(wire.BlocksAllocated, namespace, "blocks", [e.ref for e in new])
        return result

    def begin_write(self, hashes: Iterable[bytes]) -> None:
        """ALLOCATED → WRITING (the writer started filling the slots)."""
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.state is not BlockState.ALLOCATED:
                raise ValueError(f"block {h.hex()} is not ALLOCATED")
            entry.state = BlockState.WRITING
            by_ns[entry.namespace].append(h)
        for ns, hs in by_ns.items():
            self._emit(wire.BlocksWriting, ns, "hashes", hs)

    def seal(self, items: Iterable[SealItem]) -> list[wire.BlockSeal]:
        """Seal written blocks: ``hash``, ``(hash, nbytes)``, ``(hash, nbytes, expected)``
        or ``(hash, nbytes, expected, digest)``.

        The checksum is xxh3-64 of the first ``nbytes`` of the slot (the whole slot by
        default), computed here unless ``digest`` says what the caller computed over those
        bytes (the receive path hashes each block as it lands, while it is in cache). With
        ``expected`` (bytes that came from a peer) a mismatch fails that block and raises
        :class:`~cpd.protocol.errors.ChecksumMismatch` after sealing the others.
        """
        seals: dict[str, list[wire.BlockSeal]] = defaultdict(list)
        bad: list[bytes] = []
        out: list[wire.BlockSeal] = []
        for item in items:
            h, nbytes, expected, digest = _seal_item(item, self.slot_bytes)
            entry = self._entries.get(h)
            if entry is None or entry.state is BlockState.SEALED:
                raise ValueError(f"block {h.hex()} is not being written")
            if not 0 <= nbytes <= self.slot_bytes:
                raise ValueError(f"nbytes {nbytes} outside a slot of {self.slot_bytes}")
            if digest is None:
                if not self.backed:
                    raise ValueError("a store without bytes seals with the caller's digest")
                digest = checksum(self.arena[entry.slot, :nbytes])
            if expected is not None and digest != expected:
                bad.append(h)
                continue
            entry.state, entry.nbytes, entry.checksum = BlockState.SEALED, nbytes, digest
            self._maybe_evictable(entry)
            seals[entry.namespace].append(entry.seal)
            out.append(entry.seal)
        for ns, ss in seals.items():
            self._emit(wire.BlocksSealed, ns, "seals", ss, **self._sealed_extra(ns))
        if bad:
            self.fail(bad, "checksum")
            raise ChecksumMismatch(f"{len(bad)} block(s) failed their checksum: "
                                   f"{', '.join(h.hex() for h in bad[:4])}")
        return out

    def fail(self, hashes: Iterable[bytes], reason: str) -> None:
        """Give up on unsealed blocks (cancel, error, bad checksum): free their slots."""
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None:
                continue
            if entry.state is BlockState.SEALED:
                raise ValueError(f"block {h.hex()} is sealed; it can only be evicted")
            self._remove(entry)
            by_ns[entry.namespace].append(h)
        for ns, hs in by_ns.items():
            self._emit(wire.BlocksFailed, ns, "hashes", hs, reason=reason)

    def intact(self, block_hash: bytes) -> bool:
        """Whether a sealed block's bytes still match the checksum it was sealed with."""
        entry = self._sealed(block_hash)
        return checksum(self.arena[entry.slot, :entry.nbytes]) == entry.checksum

    def discard(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Drop sealed blocks found bad (corrupt bytes): their locations go at once, as
        an eviction kvindex applies. Pinned blocks stay until their leases end (a reader
        verifies every block it receives); returns what was dropped."""
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        gone: list[BlockEntry] = []
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.state is not BlockState.SEALED or entry.pins:
                continue
            self._remove(entry)
            gone.append(entry)
            by_ns[entry.namespace].append(h)
        if gone and self._on_removed is not None:
            self._on_removed(gone)
        for ns, hs in by_ns.items():
            self._emit(wire.BlocksEvicted, ns, "hashes", hs)
        return [h for hs in by_ns.values() for h in hs]

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used (a hit): the eviction policy's recency and count."""
        get, used, offer = self._entries.get, self._policy.used, self._offer
        for h in hashes:
            entry = get(h)
            if entry is not None:
                used(entry)
                if evictable(entry):
                    offer(entry)

    def mark_copies(self, shared: Iterable[bytes], last: Iterable[bytes]) -> int:
        """kvindex's word on which held blocks have a served copy elsewhere (``shared``:
        they leave first) and which are the last one (``last``); returns how many
        blocks it named that are held."""
        named = 0
        for flag, hashes in ((True, shared), (False, last)):
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None:
                    continue
                named += 1
                entry.shared = flag
                if flag and self.copies_first and evictable(entry):
                    heapq.heappush(self._shared, (entry.tick, entry.hash))
        return named

    def set_copies_first(self, on: bool) -> None:
        """Switch whether blocks with a copy elsewhere leave first (a decode arena's
        :class:`~cpd.kvstore.copiesgate.CopiesFirstGate`); switched on, every such
        evictable block is offered at once."""
        if on == self.copies_first:
            return
        self.copies_first = on
        self._shared = [(e.tick, e.hash) for e in self._entries.values()
                        if e.shared and evictable(e)] if on else []
        heapq.heapify(self._shared)

    def evict(self, count: int) -> int:
        """Evict up to ``count`` blocks in prefix-closed policy order; returns how many."""
        done = 0
        while done < count and self._evict_one():
            done += 1
        self._flush_evictions()
        return done

    def take_slots(self, count: int) -> list[int]:
        """Borrow ``count`` free slots that belong to no block (evicting if needed), e.g.
        to land bytes that turned out to be redundant; give them back with
        :meth:`return_slots`. Raises :class:`~cpd.protocol.errors.ArenaFull`."""
        while len(self._free) < count:
            if not self._evict_one():
                self._flush_evictions()
                raise ArenaFull(f"no {count} spare slots")
        self._flush_evictions()
        return [self._free.pop() for _ in range(count)]

    def return_slots(self, slots: Iterable[int]) -> None:
        """Give back slots borrowed with :meth:`take_slots`."""
        self._free.extend(slots)

    # -------------------------------------------------------------------- pins, leases

    def pin(self, lease_id: str, hashes: Sequence[bytes], ttl_s: float) -> Lease:
        """Pin sealed blocks under a new lease until :meth:`unpin` or ``ttl_s`` passes.

        All or nothing: a block that is not held and sealed raises
        :class:`~cpd.protocol.errors.BlockEvicted` and pins nothing.
        """
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} already exists")
        entries = [self._sealed(h) for h in hashes]
        for entry in entries:
            entry.pins += 1
            self._touch(entry)
        lease = Lease(lease_id, tuple(hashes), self.clock() + ttl_s)
        self._leases[lease_id] = lease
        return lease

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Extend a lease; ``False`` if it no longer exists."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expires = self.clock() + ttl_s
        return True

    def unpin(self, lease_id: str) -> bool:
        """Release a lease's pins; ``False`` if it was unknown (already released/expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for h in lease.hashes:
            entry = self._entries.get(h)
            if entry is not None:
                entry.pins -= 1
                self._maybe_evictable(entry)
        return True

    def expire_leases(self) -> list[str]:
        """Release every lease past its expiry; returns their ids."""
        now = self.clock()
        expired = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in expired:
            self.unpin(lid)
        return expired

    # -------------------------------------------------------------------------- events

    def drain_events(self) -> list[wire.KvEvent]:
        """The lifecycle events produced since the last drain, in order."""
        out, self._outbox = self._outbox, []
        return out

    def snapshot_events(self) -> list[wire.KvEvent]:
        """A full re-announce: ``NodeCleared``, then every held block, parents first."""
        events: list[wire.KvEvent] = [wire.NodeCleared(node=self.node, seq=0, tier=self.tier)]
        ordered = self._topological()
        for ns in dict.fromkeys(e.namespace for e in ordered):
            mine = [e for e in ordered if e.namespace == ns]
            events += _chunked(wire.BlocksAllocated, self.node, self.tier, ns, "blocks",
                               [e.ref for e in mine])
            writing = [e.hash for e in mine if e.state is BlockState.WRITING]
            events += _chunked(wire.BlocksWriting, self.node, self.tier, ns, "hashes", writing)
            sealed = [e.seal for e in mine if e.state is BlockState.SEALED]
            events += _chunked(wire.BlocksSealed, self.node, self.tier, ns, "seals", sealed,
                               **self._sealed_extra(ns))
        return events

    # ------------------------------------------------------------------------ internals

    def _sealed_extra(self, namespace: str) -> dict[str, Any]:
        # The capability rides with every sealed event, re-announces included, so any
        # kvindex (replica, replay, restart) learns it from the stream alone.
        return {"capability": self.capability(namespace)} if self.capability else {}

    def _sealed(self, block_hash: bytes) -> BlockEntry:
        entry = self._entries.get(block_hash)
        if entry is None or entry.state is not BlockState.SEALED:
            raise BlockEvicted(f"block {block_hash.hex()} is not held sealed")
        return entry

    def _add(self, entry: BlockEntry) -> None:
        self._entries[entry.hash] = entry
        entry.children = self._orphans.pop(entry.hash, 0)
        parent = self._entries.get(entry.parent) if entry.parent else None
        if parent is not None:
            parent.children += 1
        elif entry.parent:
            self._orphans[entry.parent] += 1

    def _remove(self, entry: BlockEntry, evicted: bool = False) -> None:
        del self._entries[entry.hash]
        self._policy.removed(entry, evicted)
        if entry.slot >= 0:
            self._free.append(entry.slot)
        if entry.children:
            self._orphans[entry.hash] = entry.children
        parent = self._entries.get(entry.parent) if entry.parent else None
        if parent is not None:
            parent.children -= 1
            self._maybe_evictable(parent)
        elif entry.parent:
            self._orphans[entry.parent] -= 1
            if not self._orphans[entry.parent]:
                del self._orphans[entry.parent]

    def _touch(self, entry: BlockEntry) -> None:
        self._policy.used(entry)
        self._maybe_evictable(entry)

    def _maybe_evictable(self, entry: BlockEntry) -> None:
        if evictable(entry):
            self._offer(entry)

    def _offer(self, entry: BlockEntry) -> None:
        self._policy.offer(entry)
        if entry.shared and self.copies_first:
            heapq.heappush(self._shared, (entry.tick, entry.hash))
            if len(self._shared) > 4 * len(self._entries) + 64:
                self._shared = [(e.tick, e.hash) for e in self._entries.values()
                                if e.shared and evictable(e)]
                heapq.heapify(self._shared)

    def _shared_victim(self) -> BlockEntry | None:
        """The least recently used evictable block with a copy elsewhere, if any."""
        heap = self._shared
        while heap:
            tick, h = heapq.heappop(heap)
            entry = self._entries.get(h)
            if entry is not None and entry.shared and entry.tick == tick and evictable(entry):
                return entry
        return None

    def _evict_one(self) -> bool:
        # Without copies_first nothing is ever offered as shared: the policy decides.
        entry = self._shared_victim() or self._policy.victim()
        if entry is None:
            return False
        self._remove(entry, evicted=True)
        self.evictions += 1
        self._evicted.append(entry)
        return True

    def _flush_evictions(self) -> None:
        evicted = self._evicted
        if not evicted:
            return
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        for entry in evicted:
            by_ns[entry.namespace].append(entry.hash)
        if self._on_removed is not None:
            self._on_removed(list(evicted))
        evicted.clear()
        for ns, hs in by_ns.items():
            self._emit(wire.BlocksEvicted, ns, "hashes", hs)

    def _emit(self, cls: type[wire.KvEvent], namespace: str, field: str, items: list[Any],
              **extra: Any) -> None:
        self._outbox += _chunked(cls, self.node, self.tier, namespace, field, items, **extra)

    def _topological(self) -> list[BlockEntry]:
        order: list[BlockEntry] = []
        seen: set[bytes] = set()
        for entry in self._entries.values():
            chain = []
            e: BlockEntry | None = entry
            while e is not None and e.hash not in seen:
                chain.append(e)
                seen.add(e.hash)
                e = self._entries.get(e.parent) if e.parent else None
            order += reversed(chain)
        return order


def _seal_item(item: SealItem, default_nbytes: int
               ) -> tuple[bytes, int, int | None, int | None]:
    if isinstance(item, bytes | bytearray):
        return bytes(item), default_nbytes, None, None
    padded = (*item, None, None)
    return padded[0], padded[1], padded[2], padded[3]


def _chunked(cls: type[wire.KvEvent], node: str, tier: wire.Tier, namespace: str, field: str,
             items: list[Any], **extra: Any) -> list[wire.KvEvent]:
    return [cls(node=node, seq=0, namespace=namespace, tier=tier,
                **{field: items[i:i + MAX_BLOCKS_PER_EVENT]}, **extra)
            for i in range(0, len(items), MAX_BLOCKS_PER_EVENT)]
