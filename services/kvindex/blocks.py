"""The block table: every block record of every namespace, its copies per (node, tier),
and the lifecycle rules at one location.

A copy becomes VISIBLE only once sealed (with a checksum on DRAM) and its parent is VISIBLE
at the same location, and it is removed with every descendant there, so each location's
chain stays prefix-closed. The table knows nothing of node epochs, sequences or leases;
the index built on it decides which events reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cpd.kvstore.copiesgate import LostBlocks
from cpd.protocol import wire
from cpd.protocol.lifecycle import BlockState, can_transition
from cpd.protocol.wire import SERVED_TIERS
from services.kvindex.records import (
    Block,
    Changes,
    Location,
    LocKey,
    Tier,
)


class BlockTable:
    """Blocks by (namespace, hash), their locations, and the per-node location sets."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[bytes, Block]] = {}
        self.num_locations = 0
        # Blocks evicted from their last visible copy of any tier (in snapshots); the
        # most recent of them, lost to the cluster until one is written again; and the
        # looked-up blocks right past a match found among them (cpd.kvstore.copiesgate:
        # this replica's count, BlockCopies.misses).
        self.last_evicted = 0
        self.lost = LostBlocks()
        self.misses = 0
        # (namespace, hash, tier) of every location per node: drops touch only that node.
        self._by_node: dict[str, set[tuple[str, bytes, Tier]]] = {}

    @property
    def num_blocks(self) -> int:
        """How many block records the table holds, over all namespaces."""
        return sum(len(d) for d in self.blocks.values())

    def iter_locations(self) -> Iterator[tuple[str, bytes, str, Tier, Location]]:
        """Every (namespace, hash, node, tier, location) held (diagnostics and tests)."""
        for ns, table in self.blocks.items():
            for h, block in table.items():
                for key, loc in block.locs.items():
                    yield (ns, h, key.node, key.tier, loc)

    def location(self, ns: str, h: bytes, node: str, tier: Tier) -> Location | None:
        """The record of ``h`` at (node, tier), if any."""
        block = self.blocks.get(ns, {}).get(h)
        return block.locs.get(LocKey(node, tier)) if block else None

    def _allocate(self, ns: str, h: bytes, parent: bytes, num_tokens: int, key: LocKey,
                  epoch: int, ch: Changes) -> None:
        """Record ``h`` ALLOCATED at ``key`` (creating or completing its block record)."""
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
        self.lost.pop(h, None)  # being written again
        self._by_node.setdefault(key.node, set()).add((ns, h, key.tier))
        self.num_locations += 1
        ch.transitions += 1

    def _step(self, ns: str, h: bytes, key: LocKey, new: BlockState,
              ch: Changes) -> Location | None:
        """Move ``h`` at ``key`` to ``new`` if the lifecycle allows; its record, else None."""
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
            if key.tier in SERVED_TIERS and (loc.checksum is None or loc.nbytes <= 0):
                continue
            if block.parent:
                parent = table.get(block.parent)
                ploc = parent.locs.get(key) if parent else None
                if ploc is None or ploc.state is not BlockState.VISIBLE:
                    continue  # becomes visible when its parent does
            loc.state = BlockState.VISIBLE
            ch.transitions += 1
            ch.visible.append((ns, key.node, key.tier, h))
            _copy_added(ns, h, block, key, ch)
            if block.children:
                todo.extend(block.children)

    def lost_run(self, hashes: bytes, start: int) -> int:
        """How many of the packed ``hashes`` from block ``start`` on are lost blocks, in a
        row."""
        lost, k, n = self.lost, start, len(hashes) // wire.HASH_BYTES
        while k < n and hashes[k * wire.HASH_BYTES:(k + 1) * wire.HASH_BYTES] in lost:
            k += 1
        return k - start

    def _remove(self, ns: str, h: bytes, key: LocKey, ch: Changes,
                evicted: bool = False) -> None:
        """Drop ``h`` at ``key`` and every descendant there (prefix-closed eviction);
        ``evicted``: the node evicted them (a block left with no visible copy is lost)."""
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
            self._by_node[key.node].discard((ns, cur, key.tier))
            self.num_locations -= 1
            ch.transitions += 1
            if loc.state is BlockState.VISIBLE:
                ch.invalidated.append((ns, key.node, key.tier, cur))
                _copy_removed(ns, cur, block, key, ch)
                if evicted and not any(c.state is BlockState.VISIBLE
                                       for c in block.locs.values()):
                    self.last_evicted += 1  # the cluster lost it
                    self.lost.add(cur)
            if block.children:
                todo.extend(block.children)
            self._gc(ns, table, cur, block)

    def _gc(self, ns: str, table: dict[bytes, Block], h: bytes, block: Block) -> None:
        """Forget ``h``'s record once it has no copy and no children, then its parent's."""
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

    def _drop_node(self, node: str, ch: Changes, which: Callable[[Location], bool],
                   reason_tier: Tier | None) -> None:
        """Remove ``node``'s locations (in ``reason_tier``, or all) that ``which`` selects."""
        for ns, h, tier in list(self._by_node.get(node, ())):
            if reason_tier is not None and tier is not reason_tier:
                continue
            loc = self.location(ns, h, node, tier)
            if loc is not None and which(loc):
                self._remove(ns, h, LocKey(node, tier), ch)


def _served_copies(block: Block, but: LocKey | None = None) -> list[LocKey]:
    return [k for k, loc in block.locs.items()
            if k != but and k.tier in SERVED_TIERS and loc.state is BlockState.VISIBLE]


def _copy_added(ns: str, h: bytes, block: Block, key: LocKey, ch: Changes) -> None:
    """``h`` turned visible at ``key``: DRAM copies that stopped being the only served
    one (and the new one, if it is in DRAM) are shared now."""
    if key.tier not in SERVED_TIERS:
        return
    others = _served_copies(block, but=key)
    if others and key.tier is Tier.DRAM:
        ch.copies.append((ns, key.node, h, True))
    if len(others) == 1 and others[0].tier is Tier.DRAM:
        ch.copies.append((ns, others[0].node, h, True))


def _copy_removed(ns: str, h: bytes, block: Block, key: LocKey, ch: Changes) -> None:
    """A visible copy of ``h`` at ``key`` left: a DRAM copy left alone is the last one."""
    if key.tier not in SERVED_TIERS:
        return
    left = _served_copies(block)
    if len(left) == 1 and left[0].tier is Tier.DRAM:
        ch.copies.append((ns, left[0].node, h, False))


def _link(table: dict[bytes, Block], parent: bytes, child: bytes) -> None:
    """Record the chain edge parent → child (the parent's record may come later)."""
    p = table.get(parent)
    if p is None:
        p = table[parent] = Block(b"", 0)
    if p.children is None:
        p.children = [child]
    elif child not in p.children:
        p.children.append(child)
