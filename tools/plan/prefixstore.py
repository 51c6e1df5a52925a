"""The blocks one node holds in one tier, for the planner: prefix-closed LRU over runs of
blocks instead of single blocks.

A block id here names its whole prefix (a chain hash does; so do the planner's engine
block ids, :mod:`tools.plan.blocks`), so what a node holds of a prompt's chain is always
a prefix of it, and the longest held prefix is a binary search of membership probes,
as kvindex looks a location up (``services/kvindex/index.py``).

The store keeps a radix tree of **runs**: a run is a stretch of one prompt's blocks,
its parent the run holding the block before it. Eviction is the tiers' rule
(:class:`cpd.kvstore.arena.BlockStore`, :class:`cpd.sim.prefixcache.PrefixCache`): a
block with a held child is never evicted before it, the least recently used chain loses
its tail first. Recency is per run, so a request that reuses a 120K-token context costs
one update per run on its path (about one per turn of its session), not one per block.
``touch_on_hit`` says whether use refreshes recency — a hit, or a prompt that extends a
held prefix — as in the engine's GPU prefix cache, or only writing does, as in the DRAM
arena, whose blocks age from their allocation (a worker allocates only a prompt's new
blocks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Run:
    __slots__ = ("blocks", "children", "end", "parent", "start", "uid", "used")

    def __init__(self, blocks: Sequence[int], start: int, end: int, parent: _Run | None,
                 used: int, uid: int) -> None:
        self.blocks = blocks      # a prompt's block ids (shared, never copied)
        self.start = start        # this run is blocks[start:end]
        self.end = end
        self.parent = parent      # the run holding blocks[start - 1]
        self.children = 0         # runs whose parent this is
        self.used = used          # last use (the store's clock)
        self.uid = uid


class PrefixStore:
    """Prefix-closed LRU of ``capacity_blocks`` blocks (see the module doc)."""

    def __init__(self, capacity_blocks: int, *, touch_on_hit: bool) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.touch_on_hit = touch_on_hit
        self.size = 0
        self.evictions = 0
        self._run_of: dict[int, _Run] = {}
        # (last use, uid, run) of leaf runs; stale records are skipped when popped.
        self._leaves: list[tuple[int, int, _Run]] = []
        self._clock = 0
        self._uids = itertools.count()

    def __contains__(self, block: object) -> bool:
        return block in self._run_of

    def __len__(self) -> int:
        return self.size

    def match(self, blocks: Sequence[int], limit: int | None = None) -> int:
        """How many leading blocks of ``blocks[:limit]`` are held (no recency change)."""
        n = len(blocks) if limit is None else min(limit, len(blocks))
        held = self._run_of
        if n <= 0 or blocks[0] not in held:
            return 0
        if blocks[n - 1] in held:
            return n
        lo, hi = 1, n - 1  # blocks[lo - 1] is held; the answer is below n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def hit(self, blocks: Sequence[int], limit: int | None = None) -> int:
        """:meth:`match`, refreshing the matched blocks when hits count as use."""
        n = self.match(blocks, limit)
        if n and self.touch_on_hit:
            self._clock += 1
            self._touch(self._cut(blocks, n))
        return n

    def insert(self, blocks: Sequence[int], n: int) -> int:
        """Hold ``blocks[:n]`` (the chain's first ``n`` blocks), evicting what the
        capacity requires; returns how many blocks were new."""
        n = min(n, len(blocks))
        if n <= 0 or self.capacity_blocks == 0:
            return 0
        have = self.match(blocks, n)
        self._clock += 1
        parent = self._cut(blocks, have) if have else None
        if parent is not None and self.touch_on_hit:
            self._touch(parent)
        if have == n:
            return 0
        run = _Run(blocks, have, n, parent, self._clock, next(self._uids))
        held = self._run_of
        for b in blocks[have:n]:
            held[b] = run
        if parent is not None:
            parent.children += 1
        heapq.heappush(self._leaves, (run.used, run.uid, run))
        self.size += n - have
        if self.size > self.capacity_blocks:
            self._evict(self.size - self.capacity_blocks)
        return n - have

    # ----------------------------------------------------------------- internals

    def _cut(self, blocks: Sequence[int], n: int) -> _Run:
        """The run ending with ``blocks[n - 1]``, splitting the run that holds it when
        it goes on past it (the part up to it becomes a run of its own)."""
        b = blocks[n - 1]
        run = self._run_of[b]
        if run.blocks[run.end - 1] == b:
            return run
        at = run.blocks.index(b, run.start, run.end) + 1
        head = _Run(run.blocks, run.start, at, run.parent, run.used, next(self._uids))
        head.children = 1
        for x in run.blocks[run.start:at]:
            self._run_of[x] = head
        run.start, run.parent = at, head
        return head

    def _touch(self, run: _Run | None) -> None:
        clock = self._clock
        while run is not None and run.used != clock:
            run.used = clock
            if not run.children:
                heapq.heappush(self._leaves, (clock, run.uid, run))
            run = run.parent

    def _evict(self, count: int) -> None:
        held = self._run_of
        while count > 0 and self._leaves:
            used, _, run = heapq.heappop(self._leaves)
            if run.used != used or run.children or run.end == run.start:
                continue  # stale: touched since, has children now, or gone
            take = min(count, run.end - run.start)
            for b in run.blocks[run.end - take:run.end]:
                del held[b]
            run.end -= take
            count -= take
            self.size -= take
            self.evictions += take
            if run.end > run.start:
                heapq.heappush(self._leaves, (run.used, run.uid, run))
                continue
            parent = run.parent
            if parent is not None:
                parent.children -= 1
                if not parent.children:
                    heapq.heappush(self._leaves, (parent.used, parent.uid, parent))
