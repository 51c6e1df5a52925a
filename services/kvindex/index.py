"""kvindex's state and rules, without I/O: every decision of docs/architecture.md, "Block
identity", "Lifecycle and visibility" lives here or in the modules :class:`Index` uses.

* Blocks are keyed by (namespace id, 16-byte hash); each has per-location records keyed
  by (node, tier) with a lifecycle :class:`~cpd.protocol.lifecycle.State`
  (:mod:`services.kvindex.records`).
* Only this index makes a location VISIBLE: sealed, checksum present (DRAM), namespace
  well formed, parent VISIBLE at the same location (so each location's chain is
  prefix-closed), in the writer's current epoch (the per-location rules are in
  :mod:`services.kvindex.blocks`). Leases are applied at lookup time: a location is a hit
  only while its node's lease is alive, so replaying the same events rebuilds the same
  state.
* Eviction, failure, a node clearing its tier, a new node epoch or a lease-expiry event
  remove locations, always with their descendants at that location (prefix-closed).
* Lookups binary-search the longest visible prefix per location
  (:mod:`services.kvindex.lookup`).
* Each node's read capability per namespace (:mod:`cpd.protocol.capability`, from its sealed
  events) is kept for its current epoch and returned with its DRAM locations; a lookup in
  one namespace only ever sees that namespace's blocks and capabilities.
* vLLM's GPU blocks are mapped onto CPD chain blocks (:mod:`services.kvindex.gpu`); the
  durable state is encoded by :mod:`services.kvindex.snapshot`.
"""

from __future__ import annotations

import msgspec

from cpd.protocol import wire
from cpd.protocol.hashing import Namespace
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.wire import SERVED_TIERS
from services.kvindex.blocks import BlockTable
from services.kvindex.gpu import removed_blocks, stored_blocks
from services.kvindex.lookup import lookup_prefixes, recorded_checksums
from services.kvindex.records import Changes, LocKey, NodeInfo, Tier, valid_namespace
from services.kvindex.snapshot import (
    SNAPSHOT_VERSION,
    SnapshotState,
    decode_snapshot,
    encode_snapshot,
    fingerprint,
)

__all__ = ["SNAPSHOT_VERSION", "Changes", "Index", "LocKey", "NodeInfo", "Tier",
           "valid_namespace"]


class Index(BlockTable):
    """The whole kvindex state."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, NodeInfo] = {}
        self.namespaces: dict[str, Namespace] = {}

    # ------------------------------------------------------------------ queries

    def lookup(self, ns: str, hashes: bytes, now: float,
               include_pending: bool = True, checksums: bool = False) -> wire.LookupReply:
        """Longest VISIBLE prefix of ``hashes`` per live (node, tier), plus pending coverage.

        Per location the visible blocks of a chain form a prefix, so each location costs
        one binary search (~9 probes for a 100K-token prompt), not a scan.
        """
        reply = lookup_prefixes(self.blocks.get(ns), self.nodes, ns, hashes, now,
                                include_pending, checksums)
        if self.lost:  # a namespace whose every block is gone answers unknown_namespace
            self.misses += self.lost_run(hashes, reply.num_blocks)
        return reply

    def checksums(self, ns: str, node: str, hashes: bytes, now: float) -> bytes:
        """What ``node`` sealed for the leading blocks of ``hashes`` it holds (packed)."""
        return recorded_checksums(self.blocks.get(ns), self.nodes, node, hashes, now)

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
            self._lease_expired(ev, ch)
            return ch
        info = self.nodes.setdefault(ev.node, NodeInfo())
        if not self._in_sequence(ev, info, ch):
            return ch
        if isinstance(ev, wire.NodeCleared):
            self._node_cleared(ev, info, ch)
        elif isinstance(ev, (wire.GpuBlocksStored, wire.GpuBlocksRemoved)):
            self._gpu_event(ev, info, ch)
        elif not valid_namespace(ev.namespace):
            ch.illegal.append(f"{ev.node}: event in malformed namespace {ev.namespace!r}")
        else:
            self._block_event(ev, info, ch)
        return ch

    def _lease_expired(self, ev: wire.LeaseExpired, ch: Changes) -> None:
        """Drop ``ev.node``'s locations of ``ev.epoch`` and before (kvindex's own event)."""
        info = self.nodes.setdefault(ev.node, NodeInfo())
        info.expired_epoch = max(info.expired_epoch, ev.epoch)
        self._drop_node(ev.node, ch, lambda loc: loc.epoch <= ev.epoch, reason_tier=None)
        if ev.epoch >= info.epoch:
            info.caps.clear()  # a re-announce brings them back with the blocks

    def _in_sequence(self, ev: wire.KvEvent, info: NodeInfo, ch: Changes) -> bool:
        """Advance ``info``'s epoch and seq to ``ev``'s; False if ``ev`` is stale or a
        duplicate and must not be applied."""
        if ev.epoch < info.epoch:
            ch.stale += 1
            return False
        if ev.epoch > info.epoch:
            # A new incarnation starts with empty caches: forget the old one's blocks.
            self._drop_node(ev.node, ch, lambda loc: loc.epoch < ev.epoch, reason_tier=None)
            info.engine.clear()
            info.caps.clear()  # the new incarnation has a new secret
            info.epoch, info.last_seq = ev.epoch, 0
        if ev.seq <= info.last_seq:
            ch.duplicates += 1
            return False
        if ev.seq != info.last_seq + 1:
            # Lost events: what we hold for this node may be incomplete. Keep applying
            # (every event is self-contained) and ask the node to re-announce.
            ch.reannounce.add(ev.node)
            info.needs_reannounce = True
        info.last_seq = ev.seq
        return True

    def _node_cleared(self, ev: wire.NodeCleared, info: NodeInfo, ch: Changes) -> None:
        """Drop every location of ``ev.node`` in ``ev.tier``: nothing is left to re-announce."""
        self._drop_node(ev.node, ch, lambda loc: True, reason_tier=ev.tier)
        if ev.tier is Tier.GPU:
            info.engine.clear()
        else:
            info.caps.clear()
        info.needs_reannounce = False
        ch.reannounce.discard(ev.node)

    def _block_event(self, ev: wire.KvEvent, info: NodeInfo, ch: Changes) -> None:
        """Apply a lifecycle event of CPD blocks at (``ev.node``, ``ev.tier``)."""
        ns = ev.namespace
        key = LocKey(ev.node, ev.tier)
        if isinstance(ev, wire.BlocksAllocated):
            for ref in ev.blocks:
                self._allocate(ns, ref.hash, ref.parent, ref.num_tokens, key, ev.epoch, ch)
        elif isinstance(ev, wire.BlocksWriting):
            for h in ev.hashes:
                self._step(ns, h, key, BlockState.WRITING, ch)
        elif isinstance(ev, wire.BlocksSealed):
            if ev.capability and ev.tier in SERVED_TIERS:
                info.caps[ns] = ev.capability
            for seal in ev.seals:
                loc = self._step(ns, seal.hash, key, BlockState.SEALED, ch)
                if loc is not None:
                    loc.nbytes, loc.checksum = seal.nbytes, seal.checksum
                    self._try_visible(ns, seal.hash, key, ch)
        elif isinstance(ev, (wire.BlocksEvicted, wire.BlocksFailed)):
            evicted = isinstance(ev, wire.BlocksEvicted)
            for h in ev.hashes:
                self._remove(ns, h, key, ch, evicted)

    def _gpu_event(self, ev: wire.GpuBlocksStored | wire.GpuBlocksRemoved, info: NodeInfo,
                   ch: Changes) -> None:
        """Apply vLLM's GPU-tier event through the engine-block map of ``info``."""
        key = LocKey(ev.node, Tier.GPU)
        if isinstance(ev, wire.GpuBlocksRemoved):
            for ns, h in removed_blocks(ev, info.engine):
                self._remove(ns, h, key, ch, evicted=True)
            return
        if ev.namespace not in self.namespaces and ev.namespace_spec:
            self._learn_namespace(ev.node, ev.namespace, ev.namespace_spec, ch)
        spec = self.namespaces.get(ev.namespace)
        if spec is None:
            ch.unmapped += len(ev.engine_hashes)
            return
        for ref in stored_blocks(ev, spec, info.engine, ch):
            # vLLM emits BlockStored again for a block its cache still holds (the last
            # full block of a prompt that hit the cache): the same fact, not an error.
            loc = self.location(spec.id, ref.hash, ev.node, Tier.GPU)
            if loc is None:
                self._allocate(spec.id, ref.hash, ref.parent, ref.num_tokens, key, ev.epoch,
                               ch)
                loc = self.location(spec.id, ref.hash, ev.node, Tier.GPU)
            if loc is not None and loc.state is BlockState.ALLOCATED:
                loc.state = BlockState.SEALED
                self._try_visible(spec.id, ref.hash, key, ch)

    # ----------------------------------------------------------------- snapshot

    def snapshot(self, stream_seq: int) -> bytes:
        """The durable state as bytes (leases are not part of it: they are live facts)."""
        return encode_snapshot(SnapshotState(stream_seq, self.blocks, self._by_node,
                                             self.nodes, self.namespaces, self.last_evicted))

    @classmethod
    def restore(cls, data: bytes) -> tuple[Index, int]:
        """Rebuild from :meth:`snapshot` output; returns the index and its stream seq."""
        state = decode_snapshot(data)
        idx = cls()
        idx.blocks = state.blocks
        idx._by_node = state.by_node
        idx.num_locations = sum(len(keys) for keys in idx._by_node.values())
        idx.namespaces = state.namespaces
        idx.nodes = state.nodes
        idx.last_evicted = state.last_evicted
        return idx, state.stream_seq

    def fingerprint(self) -> bytes:
        """Canonical bytes of the durable state (to compare replicas and rebuilds)."""
        return fingerprint(self.blocks, self.nodes)
