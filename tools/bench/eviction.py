"""Block hit rate of the arena's eviction policies under session-revisit patterns.

Pure Python, no services: each pattern is a list of *accesses*, each the block chain of
one prompt (block ``i``'s parent is block ``i - 1``; a session's chain only grows), and
:func:`replay` drives a :class:`~cpd.kvstore.BlockStore` the way a prefill worker does:
pin the held prefix for the load, allocate, write and seal the missing rest, unpin,
then pin the whole chain for the decode hand-off and unpin it. The hit rate is held
prefix blocks over all blocks, counted after each pattern's warm-up accesses.

Besides the store's own policies (``lru``, ``tinylfu``) it measures four more of the
same family, adapted to prefix-closed eviction: ``tinylfu``'s frequency test alone,
admission by reuse distance (LIRS's test) on the same window and main, S3-FIFO and 2Q. Run
``python -m tools.bench.eviction`` for the table (and ``--touches`` for the cost of a
million touches per policy).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpd.kvstore import BlockStore
from cpd.kvstore.eviction import (
    POLICIES,
    Admission,
    EvictionPolicy,
    PolicyFactory,
    in_main,
    in_window,
)
from cpd.protocol import wire
from cpd.protocol.lifecycle import BlockState

if TYPE_CHECKING:
    from cpd.kvstore import BlockEntry

Chain = tuple[bytes, ...]

NS = "bench"


@dataclass(frozen=True)
class Pattern:
    """Accesses replayed in order; the first ``warmup`` ones are not counted."""

    name: str
    accesses: list[Chain]
    warmup: int


def _block(session: int, index: int) -> bytes:
    return struct.pack(">QQ", session + 1, index)


def _chain(session: int, length: int) -> Chain:
    return tuple(_block(session, i) for i in range(length))


def _lengths(rng: random.Random, total: int, mean: int) -> list[int]:
    """Session lengths in blocks (uniform in [mean/2, 3·mean/2]) adding up to ``total``."""
    out: list[int] = []
    while sum(out) < total:
        out.append(rng.randint(mean // 2, mean * 3 // 2))
    return out


def cyclic(capacity: int, factor: float, *, mean: int = 16, passes: int = 4,
           shuffle: bool = False, seed: int = 0) -> Pattern:
    """Sessions of ``factor`` × capacity blocks in all, revisited 1, 2, …, N, 1, 2, …
    (``passes`` counted after one warm-up pass); with ``shuffle`` each pass visits
    them all in a new random order."""
    rng = random.Random(seed)
    order = [_chain(s, n) for s, n in enumerate(_lengths(rng, int(capacity * factor), mean))]
    accesses: list[Chain] = []
    for _ in range(passes + 1):
        if shuffle:
            rng.shuffle(order)
        accesses += order
    return Pattern(f"cyclic {factor:g}x{' shuffled' if shuffle else ''}", accesses, len(order))


def random_revisit(capacity: int, factor: float = 2.0, *, mean: int = 16,
                   passes: int = 4, seed: int = 0) -> Pattern:
    """Sessions of ``factor`` × capacity blocks, each access a uniformly random one."""
    rng = random.Random(seed)
    chains = [_chain(s, n) for s, n in enumerate(_lengths(rng, int(capacity * factor), mean))]
    n = len(chains)
    return Pattern(f"random {factor:g}x", [rng.choice(chains) for _ in range(n * (passes + 1))],
                   n)


def hot_set(capacity: int, share: float = 0.5, *, mean: int = 16, passes: int = 4,
            seed: int = 0) -> Pattern:
    """A hot set of ``share`` × capacity blocks revisited cyclically: it fits."""
    lengths = _lengths(random.Random(seed), int(capacity * share), mean)
    hot = [_chain(s, n) for s, n in enumerate(lengths)]
    return Pattern(f"hot {share:g}x fits", hot * (passes + 1), len(hot))


def hot_with_scan(capacity: int, share: float = 0.5, scan: float = 2.0, *, mean: int = 16,
                  seed: int = 0) -> Pattern:
    """A hot set that fits (``share`` × capacity, two warm-up passes), then four passes
    over it of which the first two interleave a one-off scan of cold sessions
    (``scan`` × capacity blocks in all, none revisited)."""
    rng = random.Random(seed)
    hot = [_chain(s, n) for s, n in enumerate(_lengths(rng, int(capacity * share), mean))]
    cold_lengths = _lengths(rng, int(capacity * scan), mean)
    cold = iter([_chain(len(hot) + s, n) for s, n in enumerate(cold_lengths)])
    per_hot = len(cold_lengths) / (2 * len(hot))
    accesses, owed = hot * 2, 0.0
    for p in range(4):
        for chain in hot:
            accesses.append(chain)
            owed += per_hot if p < 2 else 0.0
            while owed >= 1:
                accesses.append(next(cold))
                owed -= 1
    return Pattern(f"hot {share:g}x + scan {scan:g}x", accesses, 2 * len(hot))


def growing(capacity: int, sessions: int = 16, *, first: float = 0.5, last: float = 2.0,
            passes: int = 12) -> Pattern:
    """``sessions`` sessions revisited cyclically, each revisit one turn longer: from
    ``first`` × capacity blocks in all on the first pass to ``last`` × on the last."""
    start = max(1, int(capacity * first) // sessions)
    turn = max(1, int(capacity * (last - first)) // (sessions * (passes - 1)))
    accesses = [_chain(s, start + p * turn) for p in range(passes) for s in range(sessions)]
    return Pattern(f"growing {first:g}x to {last:g}x", accesses, sessions)


def shift(capacity: int, share: float = 0.7, *, mean: int = 16, passes: int = 6,
          seed: int = 0) -> Pattern:
    """Hot set A (``share`` × capacity) for ``passes`` passes, then hot set B of the same
    size for as many: how soon a policy lets go of A."""
    rng = random.Random(seed)
    a = [_chain(s, n) for s, n in enumerate(_lengths(rng, int(capacity * share), mean))]
    b = [_chain(len(a) + s, n) for s, n in enumerate(_lengths(rng, int(capacity * share), mean))]
    return Pattern(f"shift {share:g}x", a * passes + b * passes, len(a) * passes)


def chat(capacity: int, active: float = 0.6, *, turns: int = 4, turn: int = 4,
         mean: int = 12, length: int = 0, seed: int = 0) -> Pattern:
    """Sessions come and go: ``active`` × capacity blocks of live sessions, each access
    one turn (``turn`` blocks) more of a random live one; after ``turns`` revisits a
    session ends and a new one starts, ``length`` accesses in all (0: 4 per slot).
    Reuse distances stay under the capacity, the sessions seen over the run exceed it
    many times."""
    rng = random.Random(seed)
    length = length or 4 * capacity
    live: list[list[int]] = []  # [session, length, visits]
    ids = 0
    accesses: list[Chain] = []
    while len(accesses) < length:
        while sum(x[1] for x in live) < capacity * active:
            live.append([ids, rng.randint(mean // 2, mean * 3 // 2), 0])
            ids += 1
        x = rng.choice(live)
        accesses.append(_chain(x[0], x[1]))
        x[1] += turn
        x[2] += 1
        if x[2] > turns:
            live.remove(x)
    return Pattern(f"chat {active:g}x", accesses, length // 5)


def zipf(capacity: int, factor: float = 4.0, *, alpha: float = 1.0, mean: int = 16,
         length: int = 0, seed: int = 0) -> Pattern:
    """Sessions of ``factor`` × capacity blocks, each access one drawn with Zipf
    (``alpha``) popularity, ``length`` accesses in all (0: 4 per slot)."""
    rng = random.Random(seed)
    length = length or 4 * capacity
    chains = [_chain(s, n) for s, n in enumerate(_lengths(rng, int(capacity * factor), mean))]
    weights = [1 / (i + 1) ** alpha for i in range(len(chains))]
    return Pattern(f"zipf {factor:g}x", rng.choices(chains, weights, k=length), length // 5)


def patterns(capacity: int, seed: int = 0) -> list[Pattern]:
    """The measured patterns for an arena of ``capacity`` slots."""
    return [cyclic(capacity, 1.5, seed=seed), cyclic(capacity, 3.0, seed=seed),
            cyclic(capacity, 1.5, shuffle=True, seed=seed), random_revisit(capacity, seed=seed),
            hot_set(capacity, seed=seed), hot_with_scan(capacity, seed=seed), growing(capacity),
            shift(capacity, seed=seed), chat(capacity, seed=seed), zipf(capacity, seed=seed)]


def replay(store: BlockStore, pattern: Pattern, *, handoff: bool = True) -> float:
    """Drive ``store`` through ``pattern`` as a prefill worker would; the block hit rate
    after the warm-up."""
    hits = total = 0
    for n, chain in enumerate(pattern.accesses):
        held = 0
        while held < len(chain) and (e := store.get(chain[held])) is not None \
                and e.state is BlockState.SEALED:
            held += 1
        if n >= pattern.warmup:
            hits += held
            total += len(chain)
        lease = f"load-{n}"
        store.pin(lease, chain[:held], ttl_s=60)
        refs = [wire.BlockRef(h, chain[i - 1] if i else b"", 16)
                for i, h in enumerate(chain) if i >= held]
        store.allocate(NS, refs)
        store.begin_write([r.hash for r in refs])
        store.seal([(r.hash, 1, None, 0) for r in refs])
        store.unpin(lease)
        if handoff:
            store.pin(f"handoff-{n}", chain, ttl_s=60)
            store.unpin(f"handoff-{n}")
        store.drain_events()
    return hits / total if total else 0.0


def hit_rate(eviction: str | PolicyFactory, pattern: Pattern, capacity: int) -> float:
    """``pattern``'s block hit rate on a fresh store of ``capacity`` slots."""
    return replay(BlockStore(1, capacity, node="bench", eviction=eviction), pattern)


# ------------------------------------------------------------ candidates not kept in the store


class _Fifos(EvictionPolicy):
    """Two lazy FIFO heaps of evictable leaves (``in_window``: the first one), keyed by
    insertion order; a block moved between them is re-keyed."""

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        super().__init__(capacity, entries)
        self._heaps: list[list[tuple[int, bytes]]] = [[], []]  # first, second
        self._sizes = [0, 0]

    def _place(self, entry: BlockEntry, first: bool) -> None:
        entry.in_window = first
        entry.tick = self._next_tick()
        self._sizes[0 if first else 1] += 1

    def used(self, entry: BlockEntry) -> None:  # FIFO: a hit does not reorder
        pass

    def offer(self, entry: BlockEntry) -> None:
        i = 0 if entry.in_window else 1
        self._heaps[i] = self._push(self._heaps[i], entry, len(self._entries),
                                    in_window if entry.in_window else in_main)

    def _head(self, first: bool) -> BlockEntry | None:
        return self._live(self._heaps[0 if first else 1], in_window if first else in_main)

    def _move(self, entry: BlockEntry) -> None:
        """Move ``entry`` and its ancestors in the first FIFO to the second's tail."""
        e: BlockEntry | None = entry
        while e is not None and e.in_window:
            self._sizes[0] -= 1
            self._place(e, first=False)
            e = self._entries.get(e.parent) if e.parent else None
        self.offer(entry)

    def removed(self, entry: BlockEntry, evicted: bool) -> None:
        self._sizes[0 if entry.in_window else 1] -= 1


class S3Fifo(_Fifos):
    """S3-FIFO: a small FIFO (10 %), a main FIFO with up to 3 reinsertions, and a ghost
    list of blocks evicted from the small one (as many as main holds). Uses count once
    per half the slots' worth of uses, as in the store's policy."""

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        super().__init__(capacity, entries)
        self._small_target = max(1, capacity // 10)
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._correlation = capacity // 2
        self._freq: dict[bytes, int] = {}

    def added(self, entry: BlockEntry) -> None:
        remembered = entry.hash in self._ghost
        if remembered:
            del self._ghost[entry.hash]
        self._place(entry, first=not remembered)
        self._freq[entry.hash], entry.ref_tick = 0, self._tick

    def used(self, entry: BlockEntry) -> None:
        self._tick += 1
        if self._tick - entry.ref_tick > self._correlation:
            self._freq[entry.hash] = min(self._freq[entry.hash] + 1, 3)
            entry.ref_tick = self._tick

    def victim(self) -> BlockEntry | None:
        while True:
            small = self._head(first=True)
            if small is not None and (self._sizes[0] >= self._small_target
                                      or self._head(first=False) is None):
                if self._freq[small.hash]:
                    self._freq[small.hash] = 0
                    self._move(small)
                    continue
                self._ghost[small.hash] = None
                if len(self._ghost) > self.capacity - self._small_target:
                    self._ghost.popitem(last=False)
                return small
            main = self._head(first=False)
            if main is None or not self._freq[main.hash]:
                return main
            self._freq[main.hash] -= 1
            main.tick = self._next_tick()  # reinserted at the tail
            self.offer(main)

    def removed(self, entry: BlockEntry, evicted: bool) -> None:
        super().removed(entry, evicted)
        del self._freq[entry.hash]


class FrequencyOnly(Admission):
    """W-TinyLFU's admission alone: ``tinylfu`` without its staleness escape."""

    def wins(self, candidate: BlockEntry, resident: BlockEntry) -> bool:
        return candidate.freq - 1 > resident.freq


class ReuseDistance(Admission):
    """Admission by reuse distance (LIRS's test): the candidate joins main if its
    previous reference is more recent than main's LRU leaf's last one, or that leaf
    is stale as in ``tinylfu``."""

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        super().__init__(capacity, entries)
        self._previous: dict[bytes, int] = {}

    def _reference(self, entry: BlockEntry, previous: int, count: int) -> None:
        self._previous[entry.hash] = previous
        super()._reference(entry, previous, count)

    def removed(self, entry: BlockEntry, evicted: bool) -> None:
        super().removed(entry, evicted)
        del self._previous[entry.hash]

    def wins(self, candidate: BlockEntry, resident: BlockEntry) -> bool:
        return (self._previous[candidate.hash] > resident.ref_tick
                or 0 < 1.5 * self._distance < self._tick - resident.ref_tick)


class TwoQ(_Fifos):
    """2Q: new blocks in a FIFO (A1in, 25 %; hits there are correlated and ignored),
    blocks evicted from it remembered (A1out, half the slots); a miss on a remembered
    block, or a hit after A1in, puts it in the LRU (Am)."""

    def __init__(self, capacity: int, entries: Mapping[bytes, BlockEntry]) -> None:
        super().__init__(capacity, entries)
        self._in_target = max(1, capacity // 4)
        self._out: OrderedDict[bytes, None] = OrderedDict()

    def added(self, entry: BlockEntry) -> None:
        remembered = entry.hash in self._out
        if remembered:
            del self._out[entry.hash]
        self._place(entry, first=not remembered)

    def used(self, entry: BlockEntry) -> None:
        if not entry.in_window:
            entry.tick = self._next_tick()  # Am is an LRU

    def victim(self) -> BlockEntry | None:
        a1in = self._head(first=True)
        if a1in is not None and (self._sizes[0] > self._in_target
                                 or self._head(first=False) is None):
            self._out[a1in.hash] = None
            if len(self._out) > self.capacity // 2:
                self._out.popitem(last=False)
            return a1in
        return self._head(first=False) or a1in


CANDIDATES: dict[str, PolicyFactory] = {**POLICIES, "lfu-only": FrequencyOnly,
                                         "reuse": ReuseDistance, "s3fifo": S3Fifo, "2q": TwoQ}
"""Every measured policy: the store's own and the candidates above."""


def measure(capacity: int = 1024, policies: Mapping[str, PolicyFactory] = CANDIDATES,
            seeds: int = 1) -> dict[str, dict[str, float]]:
    """Hit rate of each pattern (rows) under each policy (columns), the mean over
    ``seeds`` draws of the patterns."""
    runs = [patterns(capacity, seed) for seed in range(seeds)]
    return {draws[0].name: {name: round(sum(hit_rate(f, p, capacity) for p in draws) / seeds, 3)
                            for name, f in policies.items()}
            for draws in zip(*runs, strict=True)}


def touch_cost(eviction: str | PolicyFactory, *, sessions: int = 1000, blocks: int = 100,
               touches: int = 1_000_000) -> float:
    """ns per block of ``touches`` touches of whole held chains (``sessions`` of
    ``blocks`` blocks, all sealed, the arena full; ``blocks=1``: childless blocks,
    each touch an eviction candidate again), best of three."""
    store = BlockStore(1, sessions * blocks, node="bench", eviction=eviction)
    chains = [_chain(s, blocks) for s in range(sessions)]
    for c in chains:
        store.allocate(NS, [wire.BlockRef(h, c[i - 1] if i else b"", 16)
                            for i, h in enumerate(c)])
        store.seal(list(c))
    store.drain_events()
    # One touch call per chain, or per 100 childless blocks (a pin's batch).
    batches = chains if blocks > 1 else [sum(chains[i:i + 100], ())
                                         for i in range(0, sessions, 100)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(max(1, touches // (sessions * blocks))):
            for batch in batches:
                store.touch(batch)
        best = min(best, time.perf_counter() - t0)
    return best / touches * 1e9


def _table(rates: dict[str, dict[str, float]]) -> str:
    names = list(next(iter(rates.values())))
    width = max(len(p) for p in rates)
    lines = [" " * width + "".join(f"{n:>9}" for n in names)]
    lines += [p.ljust(width) + "".join(f"{r[n]:>9.3f}" for n in names)
              for p, r in rates.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], object] = print) -> None:
    """Print the hit-rate table (and, with ``--touches``, each policy's touch cost)."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.eviction")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--touches", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rates = measure(args.capacity, seeds=args.seeds)
    out(json.dumps(rates) if args.json else _table(rates))
    if args.touches:
        for name in POLICIES:
            out(f"touch {name}: {touch_cost(name):.0f} ns/block in chains of 100, "
                f"{touch_cost(name, sessions=100_000, blocks=1):.0f} ns/block childless")


if __name__ == "__main__":
    main()
