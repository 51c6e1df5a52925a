"""The blocks one node holds in one tier, for the planner: prefix-closed eviction over
runs of blocks instead of single blocks.

A block id here names its whole prefix (a chain hash does; so do the planner's engine
block ids, :mod:`tools.plan.blocks`), so what a node holds of a prompt's chain is always
a prefix of it, and the longest held prefix is a binary search of membership probes,
as kvindex looks a location up (``services/kvindex/index.py``).

The store keeps a radix tree of **runs**: a run is a stretch of one prompt's blocks,
its parent the run holding the block before it. A block with a held child is never
evicted before it, and a run loses its tail first. Recency and reference counts are
per run, so a request that reuses a 120K-token context costs one update per run on its
path (about one per turn of its session), not one per block.

Two policies, the arena's (:mod:`cpd.kvstore.eviction`, ``dataplane.eviction``):

* ``lru``: the least recently used chain's tail goes first, as in the engine's GPU
  prefix cache (:class:`cpd.sim.prefixcache.PrefixCache`).
* ``tinylfu``: new runs enter a window of ``window`` × capacity blocks in front of a
  main LRU; once main is full the window's LRU leaf joins main in place of main's LRU
  leaf only if it was referenced more often (not counting the reference that brought
  it in) or that leaf has gone unreferenced for over ``stale`` × the mean reuse
  distance, else it leaves. The clock advances by one per block used or written, as
  the arena's does, so the correlation window, the reuse distances and the staleness
  test are in the same units. As in the arena, a request's own new blocks never lose
  the contest they caused (the arena's writer pins them): when they are the window's
  only leaf, main pays and the window grows to hold requests this large, shrinking
  back by 1/capacity per block written.

Stores of one cluster share a :class:`Copies` registry, kvindex's count of each block's
served copies (arenas and disk tiers). An arena store evicts, before its policy's
victim, the least recently used leaf run whose tail block has a copy elsewhere, as the
arena does (``BlockStore.mark_copies``): so the arenas of a pre-prefill, a prefill and
a decode node pool their capacity instead of holding the same blocks three times.

:meth:`PrefixStore.match` is a lookup (kvindex's, a router's): it changes nothing.
:meth:`PrefixStore.hit` is a use (the arena's pins for a load or a hand-off; the GPU
cache's hit) and refreshes what it matched.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence

from cpd.kvstore.copiesgate import LostBlocks
from cpd.kvstore.eviction import EWMA_ALPHA, MAX_FREQ, EvictionName


class _Run:
    __slots__ = ("blocks", "children", "end", "freq", "in_window", "parent", "ref_tick",
                 "start", "uid", "used")

    def __init__(self, blocks: Sequence[int], start: int, end: int, parent: _Run | None,
                 used: int, uid: int) -> None:
        self.blocks = blocks      # a prompt's block ids (shared, never copied)
        self.start = start        # this run is blocks[start:end]
        self.end = end
        self.parent = parent      # the run holding blocks[start - 1]
        self.children = 0         # runs whose parent this is
        self.used = used          # last use (the store's clock)
        self.uid = uid
        self.ref_tick = 0         # the last reference (uses further apart than correlation)
        self.freq = 0             # references, up to MAX_FREQ
        self.in_window = False    # tinylfu: in the admission window, not main


_Heap = list[tuple[int, int, _Run]]


class Copies:
    """Which stores hold each block across a cluster's arenas and disk tiers: kvindex's
    served copies, by which an arena knows that a block has a copy elsewhere; and the
    blocks the cluster lost (evicted from every store, engine caches included), as
    kvindex remembers them to count the lookups that miss them.

    Kept only once some store first has to evict (:meth:`activate` counts what the
    stores hold then): until then no decision depends on it, and a planner run whose
    arenas never fill pays nothing for it."""

    def __init__(self) -> None:
        self._holders: dict[Hashable, list[PrefixStore]] = {}
        self._stores: list[PrefixStore] = []
        self._engines: list[PrefixStore] = []
        self.active = False
        # Blocks evicted from their last copy (kvindex's last_evicted), the most recent
        # of them (its lost blocks) and the looked-up blocks found lost (its misses).
        self.last_evicted = 0
        self.lost = LostBlocks()
        self.misses = 0

    def join(self, store: PrefixStore) -> None:
        """Count ``store``'s blocks as copies."""
        self._stores.append(store)

    def join_engine(self, store: PrefixStore) -> None:
        """Count ``store`` (an engine's cache) as holding its blocks, though it serves no
        copies: a block it still holds is not lost."""
        self._engines.append(store)
        store.engine_of = self

    def activate(self) -> None:
        """Start counting: every store's blocks now, then each change."""
        if self.active:
            return
        self.active = True
        holders = self._holders
        for store in self._stores:
            for b in store.blocks():
                holders.setdefault(b, []).append(store)
        for store in self._stores:
            store.offer_shared()

    def count(self, block: Hashable) -> int:
        """How many stores hold ``block``."""
        h = self._holders.get(block)
        return len(h) if h else 0

    def added(self, store: PrefixStore, blocks: Sequence[Hashable]) -> None:
        """``store`` holds ``blocks`` now; a block's sole holder hears it is shared."""
        holders, lost = self._holders, self.lost
        for b in blocks:
            lost.pop(b, None)
            h = holders.get(b)
            if h is None:
                holders[b] = [store]
            else:
                h.append(store)
                if len(h) == 2:
                    h[0].shared(b)

    def removed(self, store: PrefixStore, blocks: Sequence[Hashable]) -> None:
        """``store`` no longer holds ``blocks``."""
        holders = self._holders
        for b in blocks:
            h = holders[b]
            h.remove(store)
            if not h:
                del holders[b]
                self._maybe_lost(b)

    def engine_dropped(self, blocks: Sequence[Hashable]) -> None:
        """An engine's cache dropped ``blocks``."""
        if self.active:
            holders = self._holders
            for b in blocks:
                if b not in holders:
                    self._maybe_lost(b)

    def _maybe_lost(self, block: Hashable) -> None:
        if any(block in e for e in self._engines):
            return
        self.last_evicted += 1
        self.lost.add(block)

    def missed(self, blocks: Sequence[Hashable], start: int) -> None:
        """A lookup matched ``blocks[:start]``: count the lost blocks right after it
        (kvindex's ``Index.lookup``)."""
        lost, k = self.lost, start
        while k < len(blocks) and blocks[k] in lost:
            k += 1
        self.misses += k - start


class PrefixStore:
    """Prefix-closed eviction of ``capacity_blocks`` blocks by ``eviction`` (see the
    module doc)."""

    def __init__(self, capacity_blocks: int, *, eviction: EvictionName = "lru",
                 copies: Copies | None = None, copies_first: bool = False,
                 window: float = 0.1, correlation: float = 0.5, ghost: float = 1.0,
                 stale: float = 1.5) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.eviction: EvictionName = eviction
        self.size = 0
        self.evictions = 0
        self._run_of: dict[int, _Run] = {}
        # (last use, uid, run) of leaf runs, per segment; stale records are skipped
        # when popped.
        self._main: _Heap = []
        self._window: _Heap = []
        # With ``copies``, the store's blocks count as copies; with ``copies_first``
        # too, leaf runs whose tail has a copy elsewhere leave first (the arena's
        # rule), least recently used first.
        self._copies = copies
        self._copies_first = copies_first and copies is not None
        # The registry this store is an engine cache of (Copies.join_engine).
        self.engine_of: Copies | None = None
        self._shared: _Heap = []
        if copies is not None:
            copies.join(self)
        self._clock = 0
        self._uids = itertools.count()
        admit = eviction == "tinylfu"
        self._window_base = max(1, int(capacity_blocks * window)) if admit else 0
        self._window_target = float(self._window_base)
        self._correlation = int(capacity_blocks * correlation)
        self._ghost_max = int(capacity_blocks * ghost) if admit else 0
        self._stale = stale
        self._ghost: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._distance = 0.0      # running mean of reuse distances; 0: none seen yet
        self._arrivals: deque[_Run] = deque()  # window runs by arrival, lazily pruned
        self._window_size = 0
        self._main_size = 0

    def __contains__(self, block: object) -> bool:
        return block in self._run_of

    def __len__(self) -> int:
        return self.size

    def blocks(self) -> Iterable[Hashable]:
        """Every block held."""
        return self._run_of.keys()

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
        """:meth:`match`, and a use of the matched blocks (recency and references)."""
        n = self.match(blocks, limit)
        if n:
            self._clock += n
            self._touch(self._cut(blocks, n))
        return n

    def insert(self, blocks: Sequence[int], n: int) -> int:
        """Hold ``blocks[:n]`` (the chain's first ``n`` blocks), evicting what the
        capacity requires; returns how many blocks were new."""
        n = min(n, len(blocks))
        if n <= 0 or self.capacity_blocks == 0:
            return 0
        have = self.match(blocks, n)
        parent = self._cut(blocks, have) if have else None
        if parent is not None:
            self._clock += 1
            self._touch(parent)
        if have == n:
            return 0
        self._clock += n - have
        run = _Run(blocks, have, n, parent, self._clock, next(self._uids))
        held = self._run_of
        for b in blocks[have:n]:
            held[b] = run
        if self._copies is not None and self._copies.active:
            self._copies.added(self, blocks[have:n])
        if parent is not None:
            parent.children += 1
        self.size += n - have
        self._added(run)
        if self.size > self.capacity_blocks:
            self._evict(self.size - self.capacity_blocks, run)
        return n - have

    # ----------------------------------------------------------------- internals

    def _added(self, run: _Run) -> None:
        """A new run's reference (a recently evicted block's count comes back) and its
        segment: main under ``lru``; the window under ``tinylfu``, whose oldest
        arrivals join main unopposed while main has room."""
        previous = count = back = 0
        if self._ghost:
            pop = self._ghost.pop
            for b in run.blocks[run.start:run.end]:
                g = pop(b, None)
                if g is not None:
                    back += 1
                    if g > (previous, count):
                        previous, count = g
        if previous:
            self._mean_distance(self._clock - previous, back)
        run.ref_tick, run.freq = self._clock, min(count + 1, MAX_FREQ)
        k = run.end - run.start
        if not self._window_base:
            self._main_size += k
            self._offer(run)
            return
        run.in_window = True
        self._window_size += k
        base = self._window_base
        self._window_target -= ((self._window_target - base)
                                * (1 - (1 - 1 / self.capacity_blocks) ** k))
        self._arrivals.append(run)
        self._offer(run)
        room = self.capacity_blocks - self._window_target
        while (self._window_size > self._window_target and self._main_size < room
               and self._arrivals):
            oldest = self._arrivals.popleft()
            if oldest.in_window and oldest.end > oldest.start:
                self._admit(oldest)

    def _mean_distance(self, distance: int, blocks: int) -> None:
        """Fold a reuse distance of ``blocks`` blocks into the running mean, which the
        arena keeps over blocks (the first one is the mean)."""
        weight = 1 - (1 - EWMA_ALPHA) ** blocks if self._distance else 1
        self._distance += (distance - self._distance) * weight

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
        head.ref_tick, head.freq, head.in_window = run.ref_tick, run.freq, run.in_window
        for x in run.blocks[run.start:at]:
            self._run_of[x] = head
        run.start, run.parent = at, head
        return head

    def _touch(self, run: _Run | None) -> None:
        """A use of ``run`` and its ancestors: recency, and a reference for each whose
        last one is further back than the correlation window."""
        clock = self._clock
        while run is not None and run.used != clock:
            run.used = clock
            if clock - run.ref_tick > self._correlation:
                if run.ref_tick:
                    self._mean_distance(clock - run.ref_tick, run.end - run.start)
                run.ref_tick = clock
                run.freq = min(run.freq + 1, MAX_FREQ)
            if not run.children:
                self._offer(run)
            run = run.parent

    def shared(self, block: Hashable) -> None:
        """``block``, held here, has a copy elsewhere now (:class:`Copies`)."""
        run = self._run_of.get(block)
        if (self._copies_first and run is not None and not run.children
                and run.blocks[run.end - 1] == block):
            heapq.heappush(self._shared, (run.used, run.uid, run))

    def _offer(self, run: _Run) -> None:
        """A leaf run's record on its segment's heap, and on the shared heap when its
        tail block has a copy elsewhere."""
        record = (run.used, run.uid, run)
        heapq.heappush(self._window if run.in_window else self._main, record)
        if self._sharing() and self._tail_shared(run):
            heapq.heappush(self._shared, record)

    @property
    def copies_first(self) -> bool:
        """Whether this store evicts blocks with a copy elsewhere before its policy's."""
        return self._copies_first

    def set_copies_first(self, on: bool) -> None:
        """Switch whether blocks with a copy elsewhere leave first (the arena's
        ``BlockStore.set_copies_first``); switched on, every such leaf run is offered."""
        on = on and self._copies is not None
        if on == self._copies_first:
            return
        self._copies_first = on
        self._shared = []
        self.offer_shared()

    def _sharing(self) -> bool:
        """Whether this store evicts copies first and the copies are counted yet."""
        return self._copies_first and self._copies.active  # type: ignore[union-attr]

    def offer_shared(self) -> None:
        """Every leaf run whose tail has a copy elsewhere, on the shared heap (once the
        copies start being counted)."""
        if not self._sharing():
            return
        for run in {id(r): r for r in self._run_of.values()}.values():
            if not run.children and run.end > run.start and self._tail_shared(run):
                heapq.heappush(self._shared, (run.used, run.uid, run))

    def _tail_shared(self, run: _Run) -> bool:
        assert self._copies is not None
        return self._copies.count(run.blocks[run.end - 1]) > 1

    def _shared_tail(self, run: _Run, most: int) -> int:
        """How many of ``run``'s last blocks (at most ``most``) have a copy elsewhere."""
        assert self._copies is not None
        count, blocks = self._copies.count, run.blocks
        i = run.end - 1
        while i >= run.start and run.end - i <= most and count(blocks[i]) > 1:
            i -= 1
        return run.end - 1 - i

    def _shared_leaf(self, fresh: _Run) -> _Run | None:
        """The least recently used leaf run but ``fresh`` whose tail has a copy
        elsewhere (left on the shared heap)."""
        heap, skipped, found = self._shared, None, None
        while heap:
            used, _, run = heap[0]
            if (run.used == used and not run.children and run.end > run.start
                    and self._tail_shared(run)):
                if run is not fresh:
                    found = run
                    break
                skipped = heapq.heappop(heap)
                continue
            heapq.heappop(heap)
        if skipped is not None:
            heapq.heappush(heap, skipped)
        return found

    def _leaf(self, heap: _Heap, in_window: bool) -> _Run | None:
        """The segment's least recently used leaf run (left on its heap)."""
        while heap:
            used, _, run = heap[0]
            if (run.used == used and not run.children and run.end > run.start
                    and run.in_window == in_window):
                return run
            heapq.heappop(heap)  # stale: touched since, has children, gone or moved
        return None

    def _wins(self, candidate: _Run, resident: _Run) -> bool:
        """The arena's admission test (:class:`cpd.kvstore.eviction.TinyLfu`)."""
        return (candidate.freq - 1 > resident.freq
                or 0 < self._stale * self._distance < self._clock - resident.ref_tick)

    def _admit(self, run: _Run | None) -> None:
        """Move ``run`` and every ancestor of it still in the window into main."""
        while run is not None and run.in_window:
            run.in_window = False
            k = run.end - run.start
            self._window_size -= k
            self._main_size += k
            if not run.children:
                self._offer(run)
            run = run.parent

    def _evict(self, count: int, fresh: _Run) -> None:
        """Free ``count`` blocks after ``fresh`` was written: blocks with a copy
        elsewhere first (never ``fresh``'s own, which its writer holds), then by the
        policy."""
        if self._copies is not None:
            self._copies.activate()
        while count > 0:
            if self._copies_first and (run := self._shared_leaf(fresh)) is not None:
                count -= self._drop(run, self._shared_tail(run, count))
                continue
            excess = math.ceil(self._window_size - self._window_target)
            candidate = self._leaf(self._window, True) if excess > 0 else None
            if candidate is fresh:  # the writer's own blocks: main pays, the window grows
                self._window_target = float(self._window_size)
                candidate = None
            if candidate is not None:
                resident = self._leaf(self._main, False)
                if resident is None or not self._wins(candidate, resident):
                    count -= self._drop(candidate, min(count, excess))
                    continue
                self._admit(candidate)
                count -= self._drop(resident, count)
                continue
            victim = self._leaf(self._main, False) or self._leaf(self._window, True)
            if victim is None:
                return
            count -= self._drop(victim, count)

    def _drop(self, run: _Run, most: int) -> int:
        """Evict up to ``most`` blocks off ``run``'s tail; returns how many left."""
        take = min(most, run.end - run.start)
        held = self._run_of
        gone = run.blocks[run.end - take:run.end]
        for b in gone:
            del held[b]
        if self._copies is not None and self._copies.active:
            self._copies.removed(self, gone)
        if self.engine_of is not None:
            self.engine_of.engine_dropped(gone)
        if self._ghost_max:
            ghost = self._ghost
            mark = (run.ref_tick, run.freq)
            for b in gone:
                ghost[b] = mark
            while len(ghost) > self._ghost_max:
                ghost.popitem(last=False)
        run.end -= take
        self.size -= take
        self.evictions += take
        if run.in_window:
            self._window_size -= take
        else:
            self._main_size -= take
        if run.end > run.start:
            if self._sharing() and self._tail_shared(run):
                heapq.heappush(self._shared, (run.used, run.uid, run))
            return take
        parent = run.parent
        if parent is not None:
            parent.children -= 1
            if not parent.children:
                self._offer(parent)
        return take

