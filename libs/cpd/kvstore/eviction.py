"""Which block an arena evicts next: the policies behind ``dataplane.eviction``.

Every policy is *prefix-closed*: only a block that is sealed, unpinned and has no child
held in the store (:func:`evictable`) may leave, so a parent outlives its children and
a held block's whole prefix is held. Policies only choose among those blocks.

* ``lru``: the least recently used evictable block.
* ``tinylfu``: LRU with frequency admission (:class:`TinyLfu`). New blocks enter a
  small LRU window; once main is full, the window's LRU leaf joins main in place of
  main's LRU leaf only if it was referenced more often (or that leaf has gone unused
  well past the usual reuse distance), else it leaves. A one-off scan therefore passes
  through the window, and a cyclic revisit of more sessions than fit keeps a stable
  part of them (LRU keeps none: it evicts each session just before its turn).

Policies are pure bookkeeping, O(1) amortized per use: lazy heaps of ``(tick, hash)``
whose stale records are dropped when they surface or when a heap outgrows its live
part.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

from cpd.ops.config import EvictionName  # noqa: F401  (re-exported: the policies' names)
from cpd.protocol.lifecycle import BlockState

if TYPE_CHECKING:
    from .arena import BlockEntry


# Weight of one reference in the running mean of reuse distances.
EWMA_ALPHA = 1 / 32
# Reference counts saturate here (W-TinyLFU's 4-bit counters).
MAX_FREQ = 15
# A lazy heap is rebuilt once its stale records outnumber live blocks by this factor.
_HEAP_SLACK = 4


def evictable(entry: BlockEntry) -> bool:
    """Whether ``entry`` may leave now: sealed, unpinned, and no child of it is held."""
    return entry.state is BlockState.SEALED and not entry.pins and not entry.children


class EvictionPolicy:
    """The order in which evictable blocks leave one store.

    The store reports every block's arrival (:meth:`added`), reuse (:meth:`used`),
    becoming evictable (:meth:`offer`) and departure (:meth:`removed`), and asks for
    a :meth:`victim` when it needs a slot. ``entries`` is the store's own live map.
    """

    name: ClassVar[str] = ""

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        self.capacity = capacity
        self._entries = entries
        self._tick = 0

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def added(self, entry: BlockEntry) -> None:
        """A block that was not held entered the store (a miss)."""
        entry.tick = self._next_tick()

    def used(self, entry: BlockEntry) -> None:
        """A held block was used again (a hit, a pin)."""
        self._tick += 1
        entry.tick = self._tick

    def offer(self, entry: BlockEntry) -> None:
        """``entry`` is :func:`evictable` now (it may have been before)."""
        raise NotImplementedError

    def victim(self) -> BlockEntry | None:
        """The next block to evict (still held: the store removes it), else ``None``."""
        raise NotImplementedError

    def removed(self, entry: BlockEntry, evicted: bool) -> None:
        """``entry`` left the store: evicted, or failed / discarded / rolled back."""

    def _live(self, heap: list[tuple[int, bytes]],
              belongs: Callable[[BlockEntry], bool]) -> BlockEntry | None:
        """The block of ``heap``'s first live record (left on the heap), dropping stale
        ones: a record is live while its block is held with that tick, evictable, and
        ``belongs`` to the heap."""
        while heap:
            tick, h = heap[0]
            entry = self._entries.get(h)
            if entry is not None and entry.tick == tick and evictable(entry) and belongs(entry):
                return entry
            heapq.heappop(heap)
        return None

    def _push(self, heap: list[tuple[int, bytes]], entry: BlockEntry, live: int,
              belongs: Callable[[BlockEntry], bool]) -> list[tuple[int, bytes]]:
        """``heap`` with ``entry``'s record pushed; rebuilt when stale records
        outnumber the ``live`` ones."""
        heapq.heappush(heap, (entry.tick, entry.hash))
        return self._rebuilt(belongs) if len(heap) > _HEAP_SLACK * live + 64 else heap

    def _rebuilt(self, belongs: Callable[[BlockEntry], bool]) -> list[tuple[int, bytes]]:
        """A heap of the evictable blocks that ``belongs`` to it, O(held blocks)."""
        heap = [(e.tick, e.hash) for e in self._entries.values() if belongs(e) and evictable(e)]
        heapq.heapify(heap)
        return heap


def _anywhere(entry: BlockEntry) -> bool:
    return True


class Lru(EvictionPolicy):
    """Least recently used evictable block first."""

    name = "lru"

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        super().__init__(capacity, entries)
        self._heap: list[tuple[int, bytes]] = []

    def offer(self, entry: BlockEntry) -> None:
        heapq.heappush(self._heap, (entry.tick, entry.hash))
        if len(self._heap) > _HEAP_SLACK * len(self._entries) + 64:
            self._heap = self._rebuilt(_anywhere)

    def victim(self) -> BlockEntry | None:
        entry = self._live(self._heap, _anywhere)
        if entry is not None:
            heapq.heappop(self._heap)
        return entry


def in_window(entry: BlockEntry) -> bool:
    """Whether ``entry`` is in a two-queue policy's first (admission) queue."""
    return entry.in_window


def in_main(entry: BlockEntry) -> bool:
    """Whether ``entry`` is in a two-queue policy's second (main) queue."""
    return not entry.in_window


class Admission(EvictionPolicy):
    """A small LRU *window* of new blocks in front of a *main* LRU, and an admission
    test between them (:meth:`wins`).

    While main has room the window's oldest arrivals join it unopposed. Once it is
    full, a slot is freed by a contest: the window's LRU leaf joins main in place of
    main's LRU leaf if it wins, else the candidate leaves. Admission is prefix-closed
    like eviction (a block joins main with its window ancestors).

    The window holds ``window`` × capacity blocks, or more while requests write more
    new blocks at once than that: when every window block is still being written or
    read, main gives up its LRU leaf and the window grows to what it holds, so the
    next such request takes its slots from the window, not from main again. The
    excess decays by 1/capacity per arrival.

    What the test may use is kept per block: its *references* (uses more than
    ``correlation`` × capacity uses apart: a request's own pins of the blocks it just
    wrote are the same reference as the write), counted up to :data:`MAX_FREQ`, the
    last one's tick, and, for blocks evicted lately (``ghost`` × capacity of them),
    both.
    """

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry], *,
                 window: float = 0.1, correlation: float = 0.5, ghost: float = 1.0) -> None:
        super().__init__(capacity, entries)
        self._window_base = max(1, int(capacity * window))
        self._window_target = float(self._window_base)
        self._correlation = int(capacity * correlation)
        self._ghost_max = int(capacity * ghost)
        # Evicted blocks' (last reference, count), oldest eviction first.
        self._ghost: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._distance = 0.0  # running mean of reuse distances (uses); 0: none seen yet
        self._arrivals: deque[bytes] = deque()  # window blocks by arrival, lazily pruned
        self._window_heap: list[tuple[int, bytes]] = []
        self._main_heap: list[tuple[int, bytes]] = []
        self._window_size = 0  # held blocks in the window, evictable or not
        self._main_size = 0

    def wins(self, candidate: BlockEntry, resident: BlockEntry) -> bool:
        """Whether ``candidate`` (the window's LRU leaf) takes ``resident``'s place (main's
        LRU leaf)."""
        raise NotImplementedError

    def _reference(self, entry: BlockEntry, previous: int, count: int) -> None:
        """A reference to ``entry`` now; ``previous``: the tick of the last one, if any."""
        if previous:
            self._mean_distance(self._tick - previous)
        entry.ref_tick, entry.freq = self._tick, min(count + 1, MAX_FREQ)

    def _mean_distance(self, distance: int) -> None:
        """Fold one reuse distance into the running mean (the first one is the mean)."""
        self._distance += (distance - self._distance) * (EWMA_ALPHA if self._distance else 1)

    def added(self, entry: BlockEntry) -> None:
        entry.tick = self._next_tick()
        entry.in_window = True
        self._window_size += 1
        self._arrivals.append(entry.hash)
        if len(self._arrivals) > _HEAP_SLACK * self._window_size + 64:
            self._arrivals = deque(h for h in self._arrivals
                                   if (a := self._entries.get(h)) is not None and a.in_window)
        self._reference(entry, *self._ghost.pop(entry.hash, (0, 0)))
        self._window_target -= (self._window_target - self._window_base) / self.capacity
        while (self._window_size > self._window_target
               and self._main_size < self.capacity - self._window_target):
            oldest = self._entries.get(self._arrivals.popleft())
            if oldest is not None and oldest.in_window:
                self._admit(oldest)

    def used(self, entry: BlockEntry) -> None:
        # _reference and _mean_distance inlined: pins of long prefixes make this the
        # hottest path.
        self._tick += 1
        tick = entry.tick = self._tick
        previous = entry.ref_tick
        if tick - previous > self._correlation:
            if previous:
                mean = self._distance
                self._distance = (mean + (tick - previous - mean) * EWMA_ALPHA if mean
                                  else float(tick - previous))
            entry.ref_tick = tick
            if entry.freq < MAX_FREQ:
                entry.freq += 1

    def offer(self, entry: BlockEntry) -> None:
        # Stale records are bounded by all held blocks (not the segment's), so that a
        # rebuild, which scans them all, stays O(1) amortized however small the segment.
        if entry.in_window:
            self._window_heap = self._push(self._window_heap, entry, len(self._entries),
                                           in_window)
        else:
            self._main_heap = self._push(self._main_heap, entry, len(self._entries),
                                         in_main)

    def victim(self) -> BlockEntry | None:
        if self._window_size > self._window_target:
            candidate = self._live(self._window_heap, in_window)
            if candidate is not None:
                resident = self._live(self._main_heap, in_main)
                if resident is None or not self.wins(candidate, resident):
                    return candidate
                self._admit(candidate)
                return resident
            # Every window block is in use: main pays, once, and the window grows to hold
            # requests this large from now on.
            self._window_target = float(self._window_size)
        return (self._live(self._main_heap, in_main)
                or self._live(self._window_heap, in_window))

    def _admit(self, entry: BlockEntry) -> None:
        """Move ``entry`` and every ancestor of it still in the window into main."""
        e: BlockEntry | None = entry
        while e is not None and e.in_window:
            e.in_window = False
            self._window_size -= 1
            self._main_size += 1
            if evictable(e):
                self.offer(e)
            e = self._entries.get(e.parent) if e.parent else None

    def removed(self, entry: BlockEntry, evicted: bool) -> None:
        if entry.in_window:
            self._window_size -= 1
        else:
            self._main_size -= 1
        if evicted and self._ghost_max:
            self._ghost[entry.hash] = (entry.ref_tick, entry.freq)
            if len(self._ghost) > self._ghost_max:
                self._ghost.popitem(last=False)


class TinyLfu(Admission):
    """:class:`Admission` by frequency (W-TinyLFU's test, on exact counts): the
    candidate joins main if it was referenced more often than main's LRU leaf, not
    counting the reference that brought it in (every newcomer has one), or if that
    leaf has gone unreferenced for over ``stale`` × the mean reuse distance (once
    there is one: until the first reuse, only counts decide).

    Ties keep the resident: in a cyclic revisit of more sessions than fit, every block
    has the same count, so a stable part of the sessions stays and hits each cycle
    (LRU evicts each session just before its turn and hits none). A one-off scan has
    no count to win with and passes through the window. The staleness escape is what
    lets a new working set in once the old one is no longer used, without waiting for
    counts to age.
    """

    name = "tinylfu"

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry], *,
                 stale: float = 1.5, **kwargs: float) -> None:
        super().__init__(capacity, entries, **kwargs)
        self._stale = stale

    def wins(self, candidate: BlockEntry, resident: BlockEntry) -> bool:
        return (candidate.freq - 1 > resident.freq
                or 0 < self._stale * self._distance < self._tick - resident.ref_tick)


PolicyFactory = Callable[[int, Mapping[bytes, "BlockEntry"]], EvictionPolicy]
"""Builds a store's policy from its slot count and its live entry map."""

POLICIES: dict[str, PolicyFactory] = {Lru.name: Lru, TinyLfu.name: TinyLfu}
"""Every :data:`EvictionName`'s policy."""
