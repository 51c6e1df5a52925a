"""The durable form of kvindex's state: the snapshot encoding and the fingerprint.

A snapshot is one msgpack map, versioned by :data:`SNAPSHOT_VERSION`, holding the blocks,
the per-node location sets, each node's epoch, sequence, engine-block map and capabilities,
the namespace specs and the count of last copies evicted. Leases are live facts, not
state: they are never persisted. Block tables are msgspec structs, so encoding and
decoding them happen in C (restoring then makes one pass to share the location keys).

A snapshot of any other version is refused (:func:`decode_snapshot` raises ValueError):
the service then rebuilds the index from the stream, as for a torn file, and asks every
node to re-announce if the stream no longer reaches back to its start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from cpd.protocol.hashing import Namespace
from services.kvindex.records import Block, EngineBlock, LocKey, NodeInfo, Tier, engine_key

SNAPSHOT_VERSION = 2
"""The version of the encoding below, in which a block's copies are keyed by ``[node, tier]``
arrays (:class:`LocKey`)."""

NodeLocations = dict[str, set[tuple[str, bytes, Tier]]]
"""(namespace, hash, tier) of every location per node."""


@dataclass
class SnapshotState:
    """The durable state a snapshot holds."""

    stream_seq: int
    blocks: dict[str, dict[bytes, Block]] = field(default_factory=dict)
    by_node: NodeLocations = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    last_evicted: int = 0


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
    # Appended (snapshots without it restore counting from 0).
    last_evicted: int = 0


_SNAPSHOT_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(_Snapshot)


def encode_snapshot(state: SnapshotState) -> bytes:
    """``state`` as snapshot bytes."""
    return _SNAPSHOT_ENCODER.encode(_Snapshot(
        v=SNAPSHOT_VERSION, stream_seq=state.stream_seq, blocks=state.blocks,
        by_node={n: list(keys) for n, keys in state.by_node.items()},
        nodes=[_SnapNode(n, i.epoch, i.last_seq, i.expired_epoch, i.needs_reannounce,
                         [(k, e.ns, e.cpd_parent, e.tokens, e.cpd_hash)
                          for k, e in i.engine.items()], dict(i.caps))
               for n, i in state.nodes.items()],
        namespaces=[ns.to_spec() for ns in state.namespaces.values()],
        last_evicted=state.last_evicted))


def decode_snapshot(data: bytes) -> SnapshotState:
    """The state :func:`encode_snapshot` wrote; ValueError for another snapshot version."""
    head = msgspec.msgpack.decode(data, type=_SnapshotHead)
    if head.v != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {head.v} is not {SNAPSHOT_VERSION}")
    snap = _SNAPSHOT_DECODER.decode(data)
    _share_location_keys(snap.blocks)
    state = SnapshotState(snap.stream_seq, blocks=snap.blocks,
                          by_node={n: set(keys) for n, keys in snap.by_node.items()},
                          last_evicted=snap.last_evicted)
    for spec in snap.namespaces:
        ns = Namespace.from_spec(spec)
        state.namespaces[ns.id] = ns
    for n in snap.nodes:
        info = state.nodes[n.node] = NodeInfo(epoch=n.epoch, last_seq=n.last_seq,
                                              expired_epoch=n.expired_epoch,
                                              needs_reannounce=n.needs_reannounce,
                                              caps=dict(n.caps))
        for k, ns_id, cpd_parent, tokens, cpd_hash in n.engine:
            info.engine[engine_key(k)] = EngineBlock(ns_id, cpd_parent, tokens, cpd_hash)
    return state


def _share_location_keys(blocks: dict[str, dict[bytes, Block]]) -> None:
    """Share one :class:`LocKey` object among the copies at each (node, tier): decoding
    makes a key and a node string per copy (~80 bytes each), applying events one per
    event; and a lookup's probes match a shared key by identity."""
    keys: dict[LocKey, LocKey] = {}
    for table in blocks.values():
        for block in table.values():
            if block.locs:
                block.locs = {keys.setdefault(k, k): loc for k, loc in block.locs.items()}


def fingerprint(blocks: dict[str, dict[bytes, Block]], nodes: dict[str, NodeInfo]) -> bytes:
    """Canonical bytes of the durable state (to compare replicas and rebuilds)."""
    canon_blocks = sorted(
        (ns, h, b.parent, b.num_tokens,
         sorted((k.node, k.tier.value, int(loc.state), loc.nbytes, loc.checksum or 0,
                 loc.epoch)
                for k, loc in b.locs.items()))
        for ns, table in blocks.items() for h, b in table.items())
    canon_nodes = sorted((n, i.epoch, i.last_seq, sorted(i.caps.items()))
                         for n, i in nodes.items()
                         if i.epoch or i.last_seq)  # heartbeat-only records are not durable
    return msgspec.msgpack.encode([canon_blocks, canon_nodes])
