"""Longest-prefix lookups over one namespace's blocks (docs/architecture.md, "Block
identity").

Per location the VISIBLE blocks of a chain form a prefix (the index only makes a block
visible after its parent there), so each (node, tier) costs one binary search, not a scan.
Leases are applied here, at lookup time: a location is a hit only while its node's lease is
alive and it belongs to the node's live epoch.
"""

from __future__ import annotations

from collections.abc import Callable

from cpd.protocol import wire
from cpd.protocol.lifecycle import PENDING, BlockState
from cpd.protocol.wire import SERVED_TIERS
from services.kvindex.records import Block, LocKey, NodeInfo, Tier


def lookup_prefixes(table: dict[bytes, Block] | None, nodes: dict[str, NodeInfo], ns: str,
                    hashes: bytes, now: float, include_pending: bool = True,
                    checksums: bool = False) -> wire.LookupReply:
    """Longest VISIBLE prefix of ``hashes`` per live (node, tier) in ``table`` (namespace
    ``ns``'s blocks, None if it holds none), plus pending coverage of each node's DRAM;
    with ``checksums``, each DRAM match's sealed checksums (one dict probe per block)."""
    if table is None:
        return wire.LookupReply(status="unknown_namespace")
    n = len(hashes) // 16
    first = table.get(hashes[:16]) if n else None
    if first is None:
        return wire.LookupReply()
    matches, seen_nodes = _visible_matches(table, nodes, ns, hashes, n, first, now)
    if checksums:
        _add_checksums(table, hashes, [m for m in matches if m.tier in SERVED_TIERS])
    best = max((m.num_blocks for m in matches), default=0)
    pending: list[wire.PendingMatch] = []
    if include_pending:
        pending = _pending_matches(table, nodes, hashes, n, seen_nodes)
    matches.sort(key=lambda m: (-m.num_blocks, m.tier != Tier.GPU, m.node))
    pending.sort(key=lambda p: (-p.num_blocks, p.node))
    return wire.LookupReply(num_blocks=best, matches=matches, pending=pending)


def _visible_matches(table: dict[bytes, Block], nodes: dict[str, NodeInfo], ns: str,
                     hashes: bytes, n: int, first: Block, now: float
                     ) -> tuple[list[wire.TierMatch], dict[str, int]]:
    """The visible prefix per live location of ``first``, and per node with a DRAM copy
    the length of its visible DRAM prefix (0 while the first block is still pending)."""
    matches: list[wire.TierMatch] = []
    seen_nodes: dict[str, int] = {}
    for key, loc in first.locs.items():
        node, tier = key.node, key.tier
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
        # Only DRAM and disk are served over the data plane; the capability is per
        # namespace.
        cap = info.caps.get(ns, b"") if tier in SERVED_TIERS else b""
        matches.append(wire.TierMatch(node, tier, lo, cap))
        if tier is Tier.DRAM:
            seen_nodes[node] = max(seen_nodes.get(node, 0), lo)
    return matches, seen_nodes


def _pending_matches(table: dict[bytes, Block], nodes: dict[str, NodeInfo], hashes: bytes,
                     n: int, seen_nodes: dict[str, int]) -> list[wire.PendingMatch]:
    """Per node, how far visible-or-being-written blocks reach past its visible prefix."""
    pending: list[wire.PendingMatch] = []
    for node, vis in seen_nodes.items():
        if vis >= n:
            continue
        info = nodes[node]
        nxt = table.get(hashes[vis * 16:(vis + 1) * 16])
        if nxt is None or not _coming_at(nxt, node, info.live_epoch):
            continue
        cover = _prefix(table, hashes, n,
                        lambda b, nd=node, ep=info.live_epoch: _coming_at(b, nd, ep))
        if cover > vis:
            pending.append(wire.PendingMatch(node, cover))
    return pending


def _prefix(table: dict[bytes, Block], hashes: bytes, n: int,
            ok: Callable[[Block], bool]) -> int:
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


def recorded_checksums(table: dict[bytes, Block] | None, nodes: dict[str, NodeInfo],
                       node: str, hashes: bytes, now: float) -> bytes:
    """The checksums ``node`` sealed for the leading blocks of ``hashes`` it holds VISIBLE
    in a tier its data plane serves (DRAM, or its disk tier) in its live epoch: what a
    puller verifies the bytes it pulled from ``node`` against (packed; none while its
    lease is out)."""
    info = nodes.get(node)
    n = len(hashes) // 16
    if table is None or info is None or not n or not info.alive(now):
        return b""
    keys = tuple(LocKey(node, t) for t in (Tier.DRAM, Tier.DISK))
    sums: list[int] = []
    for i in range(0, n * 16, 16):  # the leading run it serves, block by block
        checksum = _served_checksum(table.get(hashes[i:i + 16]), keys, info.live_epoch)
        if checksum is None:
            break
        sums.append(checksum)
    return wire.pack_checksums(sums)


def _served_checksum(block: Block | None, keys: tuple[LocKey, ...], epoch: int
                     ) -> int | None:
    """The sealed checksum of ``block`` at the first of ``keys`` where it is VISIBLE in
    ``epoch``; None where it is at none."""
    if block is None:
        return None
    for key in keys:
        loc = block.locs.get(key)
        if loc is not None and loc.state is BlockState.VISIBLE and loc.epoch == epoch:
            return loc.checksum or 0
    return None


def _add_checksums(table: dict[bytes, Block], hashes: bytes,
                   matches: list[wire.TierMatch]) -> None:
    """Fill in each of ``matches``' sealed checksums (a lookup that asks for them: a
    router of an earlier release). The blocks are found once for all of them: a prompt
    is often held by several nodes, and finding a block costs more than reading its
    checksum."""
    if not matches:
        return
    n = max(m.num_blocks for m in matches)
    locs = [table[hashes[i:i + 16]].locs for i in range(0, n * 16, 16)]
    for m in matches:
        key = LocKey(m.node, m.tier)
        m.checksums = wire.pack_checksums([loc[key].checksum or 0
                                           for loc in locs[:m.num_blocks]])


def _visible_at(block: Block, key: LocKey) -> bool:
    """Whether ``block`` is VISIBLE at ``key``."""
    loc = block.locs.get(key)
    return loc is not None and loc.state is BlockState.VISIBLE


def _coming_at(block: Block, node: str, epoch: int) -> bool:
    """Visible or being written at ``node`` (any tier) in its live ``epoch``."""
    return any(k.node == node and loc.epoch == epoch
               and (loc.state in PENDING or loc.state is BlockState.VISIBLE)
               for k, loc in block.locs.items())
