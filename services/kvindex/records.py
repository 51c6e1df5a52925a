"""The records kvindex keeps, and the keys that name them.

* A :class:`Block` is one chain block of a namespace; its :class:`Location` records are keyed
  by a :class:`LocKey`, the (node, tier) pair they sit at.
* A :class:`NodeInfo` is what kvindex knows of one node: its epoch and sequence, its lease,
  its read capabilities and the map of its engine's GPU blocks (:class:`EngineBlock`).
* A :class:`Changes` is what applying one input changed, for the service to act on.

Every other kvindex module builds on these; they hold data and no rules.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cpd.protocol import wire
from cpd.protocol.lifecycle import BlockState

Tier = wire.Tier
_NS_ID = re.compile(r"^[0-9a-f]{32}\Z")


@functools.lru_cache(maxsize=1024)  # every lookup asks; a cluster has a few namespaces
def valid_namespace(ns: str) -> bool:
    """Whether ``ns`` is a namespace id as :attr:`cpd.protocol.hashing.Namespace.id` makes them."""
    return bool(_NS_ID.match(ns))


def engine_key(h: int | bytes | list[Any]) -> int | bytes:
    """An engine block hash as a dict key.

    msgpack gives bytes back as bytes and ints as ints; lists never occur but are tolerated
    as tuples so a malformed value cannot break the dict.
    """
    return tuple(h) if isinstance(h, list) else h  # type: ignore[return-value]


# msgspec structs without GC tracking: a million of them neither slow the collector nor
# need a Python loop to snapshot or restore (both happen in C).
class LocKey(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where a copy of a block sits: a tier of a node (a key of :attr:`Block.locs`).

    Frozen, so hashable; untracked by the collector, so a block's ``locs`` dict stays
    untracked too; encoded as ``[node, tier]``.
    """

    node: str
    tier: Tier

    def __str__(self) -> str:
        """``node/tier``, how a location reads in log lines (never parsed back)."""
        return f"{self.node}/{self.tier.value}"


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


class EngineBlock:
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
    engine: dict[Any, EngineBlock] = field(default_factory=dict)
    # namespace id → the node's data-plane read capability in ``epoch`` (persisted).
    caps: dict[str, bytes] = field(default_factory=dict)

    def alive(self, now: float) -> bool:
        """Whether the node's lease still runs at monotonic time ``now``."""
        return self.lease_until >= now


@dataclass
class Changes:
    """What applying input changed, for the service to publish and log."""

    visible: list[tuple[str, str, Tier, bytes]] = field(default_factory=list)
    invalidated: list[tuple[str, str, Tier, bytes]] = field(default_factory=list)
    # (namespace, node, hash, shared): a node's DRAM block gained a served copy elsewhere
    # (shared) or lost its last other one (not shared), in the order it happened.
    copies: list[tuple[str, str, bytes, bool]] = field(default_factory=list)
    reannounce: set[str] = field(default_factory=set)
    illegal: list[str] = field(default_factory=list)
    duplicates: int = 0
    stale: int = 0
    unmapped: int = 0
    transitions: int = 0
