"""kvindex's state and rules, without I/O: every decision of docs/architecture.md, "Block
identity", "Lifecycle and visibility" lives here.

* Blocks are keyed by (namespace id, 16-byte hash); each has per-location records keyed
  by (node, tier) with a lifecycle :class:`~cpd.protocol.lifecycle.State`.
* Only this index makes a location VISIBLE: sealed, checksum present (DRAM), namespace
  well formed, parent VISIBLE at the same location (so each location's chain is
  prefix-closed), in the writer's current epoch. Leases are applied at lookup time: a
  location is a hit only while its node's lease is alive, so replaying the same events
  rebuilds the same state.
* Eviction, failure, a node clearing its tier, a new node epoch or a lease-expiry event
  remove locations, always with their descendants at that location (prefix-closed).
* Lookups binary-search the longest visible prefix per location (docs/architecture.md,
  "Block identity").
* Each node's read capability per namespace (:mod:`cpd.protocol.capability`, from its sealed
  events) is kept for its current epoch and returned with its DRAM locations; a lookup in
  one namespace only ever sees that namespace's blocks and capabilities.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cpd.protocol import wire
from cpd.protocol.hashing import ROOT_PARENT, Namespace, block_hashes
from cpd.protocol.lifecycle import PENDING, BlockState, can_transition

Tier = wire.Tier
LocKey = str
"""``"<node>/<tier>"``: node ids are subject tokens, so they never contain a slash."""
_NS_ID = re.compile(r"^[0-9a-f]{32}\Z")
SNAPSHOT_VERSION = 1


@functools.lru_cache(maxsize=1024)  # every lookup asks; a cluster has a few namespaces
def valid_namespace(ns: str) -> bool:
    """Whether ``ns`` is a namespace id as :attr:`cpd.protocol.hashing.Namespace.id` makes them."""
    return bool(_NS_ID.match(ns))


def _lk(node: str, tier: Tier) -> LocKey:
    return f"{node}/{tier.value}"


def _split(key: LocKey) -> tuple[str, Tier]:
    node, _, tier = key.partition("/")
    return node, Tier(tier)


# msgspec structs without GC tracking: a million of them neither slow the collector nor
# need a Python loop to snapshot or restore (both happen in C).
class Location(msgspec.Struct, array_like=True, gc=False):
    """One copy of a block at (node, tier)."""

    state: BlockState
    epoch: int
    nbytes: int = 0
    checksum: int | None = None


class Block(msgspec.Struct, array_like=True, gc=False):
    """A block's identity, its copies, and the blocks chained to it."""

    parent: bytes  # b"" for the first block of a chain
    num_tokens: int
    locs: dict[LocKey, Location] = msgspec.field(default_factory=dict)
    children: list[bytes] | None = None


class _EngineBlock:
    """Where one vLLM engine block sits in CPD's chain (GPU-tier mapping)."""

    __slots__ = ("cpd_hash", "cpd_parent", "ns", "tokens")

    def __init__(self, ns: str, cpd_parent: bytes, tokens: bytes, cpd_hash: bytes) -> None:
        self.ns = ns
        self.cpd_parent = cpd_parent  # chain hash before the CPD block being formed
        self.tokens = tokens          # packed tokens of that CPD block so far
        self.cpd_hash = cpd_hash      # set when this engine block completed a CPD block


@dataclass
class NodeInfo:
    """What kvindex knows about one node."""

    epoch: int = 0              # newest epoch seen in events
    last_seq: int = 0           # last applied seq within ``epoch``
    live_epoch: int = -1        # epoch of the latest heartbeat (not persisted)
    lease_until: float = 0.0    # monotonic deadline of the lease (not persisted)
    lease_ttl: float = 0.0
    expired_epoch: int = -1     # newest epoch whose lease expiry was applied
    needs_reannounce: bool = False
    engine: dict[Any, _EngineBlock] = field(default_factory=dict)
    # namespace id → the node's data-plane read capability in ``epoch`` (persisted).
    caps: dict[str, bytes] = field(default_factory=dict)

    def alive(self, now: float) -> bool:
        return self.lease_until >= now


@dataclass
class Changes:
    """What applying input changed, for the service to publish and log."""

    visible: list[tuple[str, str, Tier, bytes]] = field(default_factory=list)
    invalidated: list[tuple[str, str, Tier, bytes]] = field(default_factory=list)
    reannounce: set[str] = field(default_factory=set)
    illegal: list[str] = field(default_factory=list)
    duplicates: int = 0
    stale: int = 0
    unmapped: int = 0
    transitions: int = 0


class Index:
    """The whole kvindex state."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[bytes, Block]] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.namespaces: dict[str, Namespace] = {}
        self.num_locations = 0
        # (namespace, hash, tier) of every location per node: drops touch only that node.
        self._by_node: dict[str, set[tuple[str, bytes, Tier]]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return sum(len(d) for d in self.blocks.values())

    def iter_locations(self) -> Iterator[tuple[str, bytes, str, Tier, Location]]:
        """Every (namespace, hash, node, tier, location) held (diagnostics and tests)."""
        for ns, table in self.blocks.items():
            for h, block in table.items():
                for key, loc in block.locs.items():
                    yield (ns, h, *_split(key), loc)

    def location(self, ns: str, h: bytes, node: str, tier: Tier) -> Location | None:
        """The record of ``h`` at (node, tier), if any."""
        block = self.blocks.get(ns, {}).get(h)
        return block.locs.get(_lk(node, tier)) if block else None

    def lookup(self, ns: str, hashes: bytes, now: float,
               include_pending: bool = True) -> wire.LookupReply:
        """Longest VISIBLE prefix of ``hashes`` per live (node, tier), plus pending coverage.

        Per location the visible blocks of a chain form a prefix, so each location costs
        one binary search (~9 probes for a 100K-token prompt), not a scan.
        """
        table = self.blocks.get(ns)
        if table is None:
            return wire.LookupReply(status="unknown_namespace")
        n = len(hashes) // 16
        first = table.get(hashes[:16]) if n else None
        if first is None:
            return wire.LookupReply()
        nodes = self.nodes
        matches: list[wire.TierMatch] = []
        best = 0
        pending_nodes: list[tuple[str, NodeInfo, int]] = []
        seen_nodes: dict[str, int] = {}
        for key, loc in first.locs.items():
            node, tier = _split(key)
            info = nodes.get(node)
            if info is None or not info.alive(now) or loc.epoch != info.live_epoch:
                continue
            # Pending coverage is about blocks being written into a node's DRAM store;
            # the engine's GPU tier never has unsealed states, and a GPU-visible prefix
            # must not hide DRAM blocks still being written (single-flight waits on them).
            if loc.state is not BlockState.VISIBLE:
                if tier is Tier.DRAM:
                    seen_nodes.setdefault(node, 0)
                continue
            lo = _prefix(table, hashes, n, lambda b, k=key: _visible_at(b, k))
            # Only DRAM is served over the data plane; the capability is per namespace.
            cap = info.caps.get(ns, b"") if tier is Tier.DRAM else b""
            matches.append(wire.TierMatch(node, tier, lo, cap))
            best = max(best, lo)
            if tier is Tier.DRAM:
                seen_nodes[node] = max(seen_nodes.get(node, 0), lo)
        if include_pending:
            for node, vis in seen_nodes.items():
                if vis < n:
                    pending_nodes.append((node, nodes[node], vis))
        pending: list[wire.PendingMatch] = []
        for node, info, vis in pending_nodes:
            nxt = table.get(hashes[vis * 16:(vis + 1) * 16])
            prefix = f"{node}/"
            if nxt is None or not _coming_at(nxt, prefix, info.live_epoch):
                continue
            cover = _prefix(table, hashes, n,
                            lambda b, px=prefix, ep=info.live_epoch: _coming_at(b, px, ep))
            if cover > vis:
                pending.append(wire.PendingMatch(node, cover))
        matches.sort(key=lambda m: (-m.num_blocks, m.tier != Tier.GPU, m.node))
        pending.sort(key=lambda p: (-p.num_blocks, p.node))
        return wire.LookupReply(num_blocks=best, matches=matches, pending=pending)

    # ---------------------------------------------------------------- heartbeats

    def heartbeat(self, hb: wire.Heartbeat, now: float) -> Changes:
        """Renew ``hb.node``'s lease (and register its namespace)."""
        ch = Changes()
        info = self.nodes.setdefault(hb.node, NodeInfo())
        same_epoch = info.live_epoch == hb.started_unix_ms
        # A lease of this incarnation ran out before this heartbeat: its blocks are (or
        # are about to be) dropped, so the node must re-announce them.
        lapsed = same_epoch and info.lease_until > 0 and not info.alive(now)
        came_back = not (same_epoch and info.alive(now)) and \
            info.expired_epoch == hb.started_unix_ms
        info.live_epoch = hb.started_unix_ms
        info.lease_ttl = hb.lease_ttl_ms / 1000.0
        info.lease_until = now + info.lease_ttl
        if hb.namespace_spec:
            self._learn_namespace(hb.node, hb.namespace, hb.namespace_spec, ch)
        if info.needs_reannounce or lapsed or came_back:
            ch.reannounce.add(hb.node)
            info.needs_reannounce = False
        return ch

    def _learn_namespace(self, node: str, ns_id: str, spec_bytes: bytes, ch: Changes) -> None:
        """Register the namespace ``node`` declares (from a heartbeat or an event)."""
        try:
            spec = Namespace.from_spec(spec_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            ch.illegal.append(f"{node}: undecodable namespace spec")
            return
        if spec.id == ns_id:
            self.namespaces[spec.id] = spec
        else:
            ch.illegal.append(f"{node}: namespace spec does not match its id")

    def expired_leases(self, now: float) -> list[tuple[str, int]]:
        """Nodes whose lease ran out and whose blocks are still indexed: (node, epoch)."""
        return [(node, info.live_epoch) for node, info in self.nodes.items()
                if info.live_epoch >= 0 and not info.alive(now)
                and info.expired_epoch < info.live_epoch]

    def mark_expiry_published(self, node: str, epoch: int) -> None:
        """The service published the lease-expiry event; don't report it again."""
        info = self.nodes.setdefault(node, NodeInfo())
        info.expired_epoch = max(info.expired_epoch, epoch)

    # -------------------------------------------------------------------- events

    def apply(self, ev: wire.KvEvent) -> Changes:
        """Apply one durable event idempotently."""
        ch = Changes()
        if isinstance(ev, wire.LeaseExpired):
            info = self.nodes.setdefault(ev.node, NodeInfo())
            info.expired_epoch = max(info.expired_epoch, ev.epoch)
            self._drop_node(ev.node, ch, lambda loc: loc.epoch <= ev.epoch,
                            reason_tier=None)
            if ev.epoch >= info.epoch:
                info.caps.clear()  # a re-announce brings them back with the blocks
            return ch
        info = self.nodes.setdefault(ev.node, NodeInfo())
        if ev.epoch < info.epoch:
            ch.stale += 1
            return ch
        if ev.epoch > info.epoch:
            # A new incarnation starts with empty caches: forget the old one's blocks.
            self._drop_node(ev.node, ch, lambda loc: loc.epoch < ev.epoch, reason_tier=None)
            info.engine.clear()
            info.caps.clear()  # the new incarnation has a new secret
            info.epoch, info.last_seq = ev.epoch, 0
        if ev.seq <= info.last_seq:
            ch.duplicates += 1
            return ch
        if ev.seq != info.last_seq + 1:
            # Lost events: what we hold for this node may be incomplete. Keep applying
            # (every event is self-contained) and ask the node to re-announce.
            ch.reannounce.add(ev.node)
            info.needs_reannounce = True
        info.last_seq = ev.seq
        ns = ev.namespace
        if isinstance(ev, wire.NodeCleared):
            self._drop_node(ev.node, ch, lambda loc: True, reason_tier=ev.tier)
            if ev.tier is Tier.GPU:
                info.engine.clear()
            else:
                info.caps.clear()
            info.needs_reannounce = False
            ch.reannounce.discard(ev.node)
            return ch
        if isinstance(ev, (wire.GpuBlocksStored, wire.GpuBlocksRemoved)):
            self._gpu_event(ev, info, ch)
            return ch
        if not valid_namespace(ns):
            ch.illegal.append(f"{ev.node}: event in malformed namespace {ns!r}")
            return ch
        key = _lk(ev.node, ev.tier)
        if isinstance(ev, wire.BlocksAllocated):
            for ref in ev.blocks:
                self._allocate(ns, ref.hash, ref.parent, ref.num_tokens, key, ev.epoch, ch)
        elif isinstance(ev, wire.BlocksWriting):
            for h in ev.hashes:
                self._step(ns, h, key, BlockState.WRITING, ch)
        elif isinstance(ev, wire.BlocksSealed):
            if ev.capability and ev.tier is Tier.DRAM:
                info.caps[ns] = ev.capability
            for seal in ev.seals:
                loc = self._step(ns, seal.hash, key, BlockState.SEALED, ch)
                if loc is not None:
                    loc.nbytes, loc.checksum = seal.nbytes, seal.checksum
                    self._try_visible(ns, seal.hash, key, ch)
        elif isinstance(ev, (wire.BlocksEvicted, wire.BlocksFailed)):
            for h in ev.hashes:
                self._remove(ns, h, key, ch)
        return ch

    def _allocate(self, ns: str, h: bytes, parent: bytes, num_tokens: int, key: LocKey,
                  epoch: int, ch: Changes) -> None:
        if len(h) != wire.HASH_BYTES or (parent and len(parent) != wire.HASH_BYTES):
            ch.illegal.append(f"{key}: malformed block hash")
            return
        table = self.blocks.setdefault(ns, {})
        block = table.get(h)
        if block is None:
            block = table[h] = Block(parent, num_tokens)
            if parent:
                _link(table, parent, h)
        elif block.num_tokens == 0 and not block.parent and num_tokens:
            block.parent, block.num_tokens = parent, num_tokens  # placeholder filled in
            if parent:
                _link(table, parent, h)
        elif block.parent != parent:
            ch.illegal.append(f"{key}: block {h.hex()} re-allocated with another parent")
            return
        old = block.locs.get(key)
        if old is not None:
            ch.illegal.append(f"{key}: allocate {h.hex()} while {old.state.name}")
            return
        block.locs[key] = Location(BlockState.ALLOCATED, epoch)
        node, tier = _split(key)
        self._by_node.setdefault(node, set()).add((ns, h, tier))
        self.num_locations += 1
        ch.transitions += 1

    def _step(self, ns: str, h: bytes, key: LocKey, new: BlockState,
              ch: Changes) -> Location | None:
        block = self.blocks.get(ns, {}).get(h)
        loc = block.locs.get(key) if block else None
        if loc is None or not can_transition(loc.state, new):
            was = loc.state.name if loc else "ABSENT"
            ch.illegal.append(f"{key}: {h.hex()} {was} → {new.name}")
            return None
        loc.state = new
        ch.transitions += 1
        return loc

    def _try_visible(self, ns: str, h: bytes, key: LocKey, ch: Changes) -> None:
        """Make ``h`` at ``key`` VISIBLE if the rules allow, then its waiting children."""
        table = self.blocks[ns]
        todo = [h]
        while todo:
            h = todo.pop()
            block = table.get(h)
            loc = block.locs.get(key) if block else None
            if block is None or loc is None or loc.state is not BlockState.SEALED:
                continue
            if key.endswith("/dram") and (loc.checksum is None or loc.nbytes <= 0):
                continue
            if block.parent:
                parent = table.get(block.parent)
                ploc = parent.locs.get(key) if parent else None
                if ploc is None or ploc.state is not BlockState.VISIBLE:
                    continue  # becomes visible when its parent does
            loc.state = BlockState.VISIBLE
            ch.transitions += 1
            ch.visible.append((ns, *_split(key), h))
            if block.children:
                todo.extend(block.children)

    def _remove(self, ns: str, h: bytes, key: LocKey, ch: Changes) -> None:
        """Drop ``h`` at ``key`` and every descendant there (prefix-closed eviction)."""
        table = self.blocks.get(ns)
        if table is None or h not in table:
            return
        todo = [h]
        while todo:
            cur = todo.pop()
            block = table.get(cur)
            if block is None:
                continue
            loc = block.locs.pop(key, None)
            if loc is None:
                continue
            node, tier = _split(key)
            self._by_node[node].discard((ns, cur, tier))
            self.num_locations -= 1
            ch.transitions += 1
            if loc.state is BlockState.VISIBLE:
                ch.invalidated.append((ns, node, tier, cur))
            if block.children:
                todo.extend(block.children)
            self._gc(ns, table, cur, block)

    def _gc(self, ns: str, table: dict[bytes, Block], h: bytes, block: Block) -> None:
        # Keep records that still have a copy or children (their edges matter).
        if block.locs or block.children:
            return
        del table[h]
        if block.parent:
            parent = table.get(block.parent)
            if parent is not None and parent.children is not None:
                if h in parent.children:
                    parent.children.remove(h)
                if not parent.children:
                    parent.children = None
                    self._gc(ns, table, block.parent, parent)
        if not table:
            self.blocks.pop(ns, None)

    def _drop_node(self, node: str, ch: Changes, which: Any, reason_tier: Tier | None) -> None:
        for ns, h, tier in list(self._by_node.get(node, ())):
            if reason_tier is not None and tier is not reason_tier:
                continue
            loc = self.location(ns, h, node, tier)
            if loc is not None and which(loc):
                self._remove(ns, h, _lk(node, tier), ch)

    # ------------------------------------------------------------ vLLM GPU tier

    def _gpu_event(self, ev: wire.GpuBlocksStored | wire.GpuBlocksRemoved, info: NodeInfo,
                   ch: Changes) -> None:
        key = _lk(ev.node, Tier.GPU)
        if isinstance(ev, wire.GpuBlocksRemoved):
            for eh in ev.engine_hashes:
                eb = info.engine.pop(_ehash(eh), None)
                if eb is not None and eb.cpd_hash:
                    self._remove(eb.ns, eb.cpd_hash, key, ch)
            return
        if ev.namespace not in self.namespaces and ev.namespace_spec:
            self._learn_namespace(ev.node, ev.namespace, ev.namespace_spec, ch)
        spec = self.namespaces.get(ev.namespace)
        bs = ev.engine_block_size
        if spec is None or bs <= 0 or spec.block_size % bs:
            ch.unmapped += len(ev.engine_hashes)
            return
        step = bs * wire.TOKEN_DTYPE.itemsize
        if len(ev.tokens) != step * len(ev.engine_hashes):
            ch.illegal.append(f"{ev.node}: gpu_stored token count does not match its blocks")
            return
        if ev.parent_engine_hash is None:
            parent, acc = ROOT_PARENT, b""
        else:
            prev = info.engine.get(_ehash(ev.parent_engine_hash))
            if prev is None:
                ch.unmapped += len(ev.engine_hashes)  # its chain is unknown to us
                return
            parent = prev.cpd_hash or prev.cpd_parent
            acc = b"" if prev.cpd_hash else prev.tokens
        want = spec.block_size * wire.TOKEN_DTYPE.itemsize
        for i, eh in enumerate(ev.engine_hashes):
            acc += ev.tokens[i * step:(i + 1) * step]
            done = b""
            if len(acc) == want:
                done = block_hashes(spec, acc, parent=parent)
                # vLLM emits BlockStored again for a block its cache still holds (the last
                # full block of a prompt that hit the cache): the same fact, not an error.
                loc = self.location(spec.id, done, ev.node, Tier.GPU)
                if loc is None:
                    self._allocate(spec.id, done, b"" if parent == ROOT_PARENT else parent,
                                   spec.block_size, key, ev.epoch, ch)
                    loc = self.location(spec.id, done, ev.node, Tier.GPU)
                if loc is not None and loc.state is BlockState.ALLOCATED:
                    loc.state = BlockState.SEALED
                    self._try_visible(spec.id, done, key, ch)
            info.engine[_ehash(eh)] = _EngineBlock(spec.id, parent, b"" if done else acc, done)
            if done:
                parent, acc = done, b""

    # ----------------------------------------------------------------- snapshot

    def snapshot(self, stream_seq: int) -> bytes:
        """The durable state as bytes (leases are not part of it: they are live facts)."""
        return _SNAPSHOT_ENCODER.encode(_Snapshot(
            v=SNAPSHOT_VERSION, stream_seq=stream_seq, blocks=self.blocks,
            by_node={n: list(keys) for n, keys in self._by_node.items()},
            nodes=[_SnapNode(n, i.epoch, i.last_seq, i.expired_epoch, i.needs_reannounce,
                             [(k, e.ns, e.cpd_parent, e.tokens, e.cpd_hash)
                              for k, e in i.engine.items()], dict(i.caps))
                   for n, i in self.nodes.items()],
            namespaces=[ns.to_spec() for ns in self.namespaces.values()]))

    @classmethod
    def restore(cls, data: bytes) -> tuple[Index, int]:
        """Rebuild from :meth:`snapshot` output; returns the index and its stream seq."""
        head = msgspec.msgpack.decode(data, type=_SnapshotHead)
        if head.v != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {head.v} is not {SNAPSHOT_VERSION}")
        snap = _SNAPSHOT_DECODER.decode(data)
        idx = cls()
        idx.blocks = snap.blocks
        idx._by_node = {n: set(keys) for n, keys in snap.by_node.items()}
        idx.num_locations = sum(len(keys) for keys in idx._by_node.values())
        for spec in snap.namespaces:
            ns = Namespace.from_spec(spec)
            idx.namespaces[ns.id] = ns
        for n in snap.nodes:
            info = idx.nodes[n.node] = NodeInfo(epoch=n.epoch, last_seq=n.last_seq,
                                                expired_epoch=n.expired_epoch,
                                                needs_reannounce=n.needs_reannounce,
                                                caps=dict(n.caps))
            for k, ns, cpd_parent, tokens, cpd_hash in n.engine:
                info.engine[_ehash(k)] = _EngineBlock(ns, cpd_parent, tokens, cpd_hash)
        return idx, snap.stream_seq

    def fingerprint(self) -> bytes:
        """Canonical bytes of the durable state (to compare replicas and rebuilds)."""
        blocks = sorted(
            (ns, h, b.parent, b.num_tokens,
             sorted((k, int(loc.state), loc.nbytes, loc.checksum or 0, loc.epoch)
                    for k, loc in b.locs.items()))
            for ns, table in self.blocks.items() for h, b in table.items())
        nodes = sorted((n, i.epoch, i.last_seq, sorted(i.caps.items()))
                       for n, i in self.nodes.items()
                       if i.epoch or i.last_seq)  # heartbeat-only records are not durable
        return msgspec.msgpack.encode([blocks, nodes])


class _SnapNode(msgspec.Struct, array_like=True):
    node: str
    epoch: int
    last_seq: int
    expired_epoch: int
    needs_reannounce: bool
    engine: list[tuple[int | bytes, str, bytes, bytes, bytes]]
    # Appended (snapshots without it restore with no capabilities; re-announce refills).
    caps: dict[str, bytes] = msgspec.field(default_factory=dict)


class _SnapshotHead(msgspec.Struct):
    v: int


class _Snapshot(msgspec.Struct):
    v: int
    stream_seq: int
    blocks: dict[str, dict[bytes, Block]]
    by_node: dict[str, list[tuple[str, bytes, Tier]]]
    nodes: list[_SnapNode]
    namespaces: list[bytes]


_SNAPSHOT_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(_Snapshot)


def _link(table: dict[bytes, Block], parent: bytes, child: bytes) -> None:
    """Record the chain edge parent → child (the parent's record may come later)."""
    p = table.get(parent)
    if p is None:
        p = table[parent] = Block(b"", 0)
    if p.children is None:
        p.children = [child]
    elif child not in p.children:
        p.children.append(child)


def _prefix(table: dict[bytes, Block], hashes: bytes, n: int, ok: Any) -> int:
    """Largest k such that ``ok`` holds for blocks 0..k-1 (``ok`` is monotone, true at 0)."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        b = table.get(hashes[(mid - 1) * 16:mid * 16])
        if b is not None and ok(b):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _visible_at(block: Block, key: LocKey) -> bool:
    loc = block.locs.get(key)
    return loc is not None and loc.state is BlockState.VISIBLE


def _coming_at(block: Block, prefix: str, epoch: int) -> bool:
    """Visible or being written at the node of key ``prefix`` (any tier), live epoch."""
    return any(k.startswith(prefix) and loc.epoch == epoch
               and (loc.state in PENDING or loc.state is BlockState.VISIBLE)
               for k, loc in block.locs.items())


def _ehash(h: int | bytes | list[Any]) -> int | bytes:
    # msgpack gives bytes back as bytes and ints as ints; lists never occur but are
    # tolerated as tuples so a malformed value cannot break the dict.
    return tuple(h) if isinstance(h, list) else h  # type: ignore[return-value]
