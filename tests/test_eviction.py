"""The arena's eviction policies (cpd.kvstore.eviction): block hit rates under the
session-revisit patterns of tools/bench/eviction.py, and what every policy keeps to: it
never evicts a pinned, unsealed or parent-with-children block, and the lifecycle events
and counters are the same whichever policy runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.engines.profile import engine_profile
from cpd.kvstore import BlockStore
from cpd.kvstore.eviction import POLICIES, EvictionName
from cpd.ops.config import DataPlaneSettings, load_settings
from cpd.protocol import wire
from cpd.protocol.errors import ArenaFull
from cpd.protocol.lifecycle import BlockState
from tools.bench import eviction as bench

NS = "ns1"
CAPACITY = 1024  # slots; the patterns' sessions average 16 blocks

Build = Callable[[int], bench.Pattern]

# Measured block hit rates (seed 0, CAPACITY slots; docs/architecture.md, "KV tiers and
# the data plane"), as the band each policy must stay in: LRU's low ceilings are what
# the admission policy is for.
RATES: list[tuple[str, Build, str, float, float]] = [
    # pattern, its builder, policy, floor, ceiling
    ("cyclic 1.5x", lambda c: bench.cyclic(c, 1.5), "tinylfu", 0.55, 1.0),
    ("cyclic 1.5x", lambda c: bench.cyclic(c, 1.5), "lru", 0.0, 0.02),
    ("cyclic 3x", lambda c: bench.cyclic(c, 3.0), "tinylfu", 0.27, 1.0),
    ("cyclic 3x", lambda c: bench.cyclic(c, 3.0), "lru", 0.0, 0.02),
    ("cyclic 1.5x shuffled", lambda c: bench.cyclic(c, 1.5, shuffle=True), "tinylfu", 0.43, 1.0),
    ("cyclic 1.5x shuffled", lambda c: bench.cyclic(c, 1.5, shuffle=True), "lru", 0.25, 0.35),
    ("random 2x", bench.random_revisit, "tinylfu", 0.47, 1.0),
    ("random 2x", bench.random_revisit, "lru", 0.47, 1.0),
    ("hot set fits", bench.hot_set, "tinylfu", 1.0, 1.0),
    ("hot set fits", bench.hot_set, "lru", 1.0, 1.0),
    ("hot set + one-off scan", bench.hot_with_scan, "tinylfu", 0.45, 1.0),
    ("hot set + one-off scan", bench.hot_with_scan, "lru", 0.0, 0.3),
    ("growing sessions", bench.growing, "tinylfu", 0.6, 1.0),
    ("growing sessions", bench.growing, "lru", 0.0, 0.25),
    ("working set shift", bench.shift, "tinylfu", 0.78, 1.0),
    ("working set shift", bench.shift, "lru", 0.8, 1.0),
    ("chat", bench.chat, "tinylfu", 0.64, 1.0),
    ("chat", bench.chat, "lru", 0.66, 1.0),
    ("zipf", bench.zipf, "tinylfu", 0.68, 1.0),
    ("zipf", bench.zipf, "lru", 0.66, 1.0),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("pattern", "build", "policy", "low", "high"), RATES,
                         ids=[f"{r[0]}-{r[2]}" for r in RATES])
def test_block_hit_rates(pattern: str, build: Build, policy: str, low: float,
                         high: float) -> None:
    assert low <= bench.hit_rate(policy, build(CAPACITY), CAPACITY) <= high


@pytest.mark.timeout(60)
@pytest.mark.parametrize("build", [bench.hot_set, bench.random_revisit, bench.shift, bench.chat])
def test_the_admission_policy_stays_within_a_few_percent_of_lru_where_lru_does_well(
        build: Build) -> None:
    pattern = build(CAPACITY)
    lru = bench.hit_rate("lru", pattern, CAPACITY)
    assert bench.hit_rate("tinylfu", pattern, CAPACITY) >= lru * 0.95


def test_small_arenas_and_long_sessions_keep_the_cyclic_advantage() -> None:
    # 64 slots, sessions of 8 to 24 blocks: a request's own blocks fill the window,
    # which grows to hold them instead of taking main's residents.
    pattern = bench.cyclic(64, 1.5)
    assert bench.hit_rate("lru", pattern, 64) == 0
    assert bench.hit_rate("tinylfu", pattern, 64) >= 0.25


def test_the_setting_selects_the_policy() -> None:
    names = set(get_args(get_type_hints(DataPlaneSettings)["eviction"]))
    assert names == set(POLICIES) == set(get_args(EvictionName)) == {"lru", "tinylfu"}
    s = load_settings(environ={}, overrides=["dataplane.block_bytes=4096",
                                             "dataplane.arena_bytes=65536"])
    assert s.dataplane.eviction == "tinylfu"
    assert BlockStore.from_settings(s, engine_profile(s).slot_bytes, node="n1").eviction \
        == "tinylfu"
    lru = load_settings(environ={}, overrides=["dataplane.eviction=lru",
                                               "dataplane.arena_bytes=65536"])
    assert BlockStore.from_settings(lru, 4096, node="n1").eviction == "lru"
    assert BlockStore(64, 4).eviction == "lru"  # the constructor's default
    with pytest.raises(ValueError, match="unknown eviction policy"):
        BlockStore(64, 4, eviction="mru")


# --------------------------------------------------------------------- what is never evicted


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def ref(i: int, parent: int = 0) -> wire.BlockRef:
    return wire.BlockRef(h(i), h(parent) if parent else b"", 16)


def _fill(s: BlockStore, first: int, count: int) -> None:
    """Sealed one-block sessions ``first`` …, touched again: residents of main too."""
    for i in range(first, first + count):
        s.allocate(NS, [ref(i)])
        s.seal([h(i)])
    s.touch([h(i) for i in range(first, first + count)] * 2)


def _pinned_leaf(s: BlockStore) -> None:
    s.allocate(NS, [ref(1), ref(2, 1), ref(3, 2)])
    s.seal([h(1), h(2), h(3)])
    s.pin("L", [h(3)], ttl_s=60)


def _pinned_middle(s: BlockStore) -> None:
    s.allocate(NS, [ref(1), ref(2, 1), ref(3, 2)])
    s.seal([h(1), h(2), h(3)])
    s.pin("L", [h(2)], ttl_s=60)


def _unsealed_child(s: BlockStore) -> None:
    s.allocate(NS, [ref(1), ref(2, 1)])
    s.seal([h(1), h(2)])
    s.allocate(NS, [ref(3, 2)])  # still ALLOCATED: its ancestors stay
    s.allocate(NS, [ref(4)])
    s.begin_write([h(4)])  # WRITING


def _branch(s: BlockStore) -> None:
    s.allocate(NS, [ref(1), ref(2, 1), ref(3, 1)])
    s.seal([h(1), h(2), h(3)])
    s.pin("L", [h(3)], ttl_s=60)


def _orphan(s: BlockStore) -> None:
    s.allocate(NS, [ref(2, 1)])  # a child whose parent arrives later
    s.seal([h(2)])
    s.allocate(NS, [ref(1)])  # the parent, unsealed: the child may go, not the parent
    s.pin("L", [h(2)], ttl_s=60)
    s.unpin("L")


# (scenario, setup, blocks no eviction may take)
NEVER: list[tuple[str, Callable[[BlockStore], None], set[int]]] = [
    ("a pinned leaf and its ancestors", _pinned_leaf, {1, 2, 3}),
    ("a pinned inner block and its ancestors", _pinned_middle, {1, 2}),
    ("unsealed blocks and the ancestors of one", _unsealed_child, {1, 2, 3, 4}),
    ("the parent of a pinned child", _branch, {1, 3}),
    ("an unsealed parent", _orphan, {1}),
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(("scenario", "setup", "kept"), NEVER, ids=[n[0] for n in NEVER])
def test_never_evicted(scenario: str, setup: Callable[[BlockStore], None], kept: set[int],
                       policy: str) -> None:
    s = BlockStore(8, 24, node="n1", eviction=policy)
    setup(s)
    _fill(s, 100, 24 - len(s))  # the arena full, both segments of tinylfu populated
    s.touch([h(i) for i in kept])
    with pytest.raises(ArenaFull):  # more than the rest: all or nothing
        s.allocate(NS, [ref(i) for i in range(200, 200 + 24 - len(kept) + 1)])
    assert all(h(i) in s for i in kept)
    s.evict(100)
    assert {int.from_bytes(e.hash, "big") for e in s.entries()} == kept
    for e in s.entries():  # what is left cannot leave: pinned, unsealed, or a parent
        assert e.pins or e.state is not BlockState.SEALED or e.children
    _check_evictions(s.drain_events())


def _check_evictions(events: list[wire.KvEvent]) -> None:
    """kvindex's view, replayed: every evicted block was sealed and had no child held."""
    held: dict[bytes, bytes] = {}  # hash → parent
    sealed: set[bytes] = set()
    for e in events:
        if isinstance(e, wire.BlocksAllocated):
            held.update((b.hash, b.parent) for b in e.blocks)
        elif isinstance(e, wire.BlocksSealed):
            sealed.update(x.hash for x in e.seals)
        elif isinstance(e, wire.BlocksFailed):
            for x in e.hashes:
                del held[x]
        elif isinstance(e, wire.BlocksEvicted):
            for x in e.hashes:
                assert x in sealed and x not in held.values(), x.hex()
                del held[x]
                sealed.discard(x)


# ------------------------------------------------------------------ random programs, any policy

programs = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 40), st.integers(1, 5)),
    st.tuples(st.just("seal"), st.integers(0, 40)),
    st.tuples(st.just("fail"), st.integers(0, 40)),
    st.tuples(st.just("touch"), st.integers(0, 40)),
    st.tuples(st.just("pin"), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
    st.tuples(st.just("unpin"), st.integers(0, 8)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
), max_size=80)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(slots=st.integers(2, 12), program=programs)
def test_random_programs_never_evict_a_protected_block(policy: str, slots: int,
                                                       program: list[tuple]) -> None:
    s = BlockStore(8, slots, node="n1", eviction=policy)
    known: list[bytes] = []
    leases: list[str] = []
    next_id = 1

    def pick(i: int) -> bytes | None:
        return known[i % len(known)] if known else None

    for op in program:
        before = {e.hash: (e.state, e.pins, e.parent) for e in s.entries()}
        new: list[wire.BlockRef] = []
        if op[0] == "alloc":
            parent = pick(op[1]) if op[1] % 3 else None
            parent = parent if parent in s else None
            new = [wire.BlockRef(h(next_id + i), (h(next_id + i - 1) if i else parent) or b"", 16)
                   for i in range(op[2])]
            next_id += op[2]
            try:
                s.allocate(NS, new)
                known += [r.hash for r in new]
            except ArenaFull:
                new = []
        elif op[0] in ("seal", "fail", "touch"):
            x = pick(op[1])
            if x is not None and x in s:
                sealed = s.get(x).state is BlockState.SEALED  # type: ignore[union-attr]
                if op[0] == "touch":
                    s.touch([x])
                elif not sealed and op[0] == "seal":
                    s.seal([x])
                elif not sealed:
                    s.fail([x], "test")
        elif op[0] == "pin":
            hs = list(dict.fromkeys(x for x in map(pick, op[1]) if x is not None))
            if hs and all(x in s and s.get(x).state is BlockState.SEALED  # type: ignore[union-attr]
                          for x in hs):
                leases.append(f"L{len(leases)}")
                s.pin(leases[-1], hs, ttl_s=60)
        elif op[0] == "unpin" and leases:
            s.unpin(leases[op[1] % len(leases)])
        elif op[0] == "evict":
            s.evict(op[1])
        # Each eviction of this step took a block sealed and unpinned before it, with no
        # child left in the store at that moment.
        present = {**{x: p for x, (_, _, p) in before.items()}, **{r.hash: r.parent for r in new}}
        for event in s.drain_events():
            if isinstance(event, wire.BlocksEvicted):
                for x in event.hashes:
                    state, pins, _ = before[x]
                    assert state is BlockState.SEALED and pins == 0
                    del present[x]
                    assert x not in present.values()
        assert set(present) >= {e.hash for e in s.entries()}
        used = [e.slot for e in s.entries()]
        assert len(set(used)) == len(used) and s.free_slots == slots - len(used)


@pytest.mark.timeout(60)
def test_events_and_counters_do_not_depend_on_the_policy() -> None:
    # Both policies under the same cyclic replay: same event kinds per operation, one
    # BlocksEvicted hash per counted eviction, and the events alone rebuild the store.
    pattern = bench.cyclic(256, 1.5, passes=2)
    for policy in POLICIES:
        s = BlockStore(1, 256, node="n1", eviction=policy)
        kv: dict[bytes, str] = {}
        evicted = 0
        for n, chain in enumerate(pattern.accesses):
            held = next((i for i, x in enumerate(chain) if x not in s), len(chain))
            s.pin(f"L{n}", chain[:held], ttl_s=60)
            refs = [wire.BlockRef(x, chain[i - 1] if i else b"", 16)
                    for i, x in enumerate(chain) if i >= held]
            s.allocate(NS, refs)
            s.seal([r.hash for r in refs])
            s.unpin(f"L{n}")
            events = s.drain_events()
            tags = [e.__struct_config__.tag for e in events]
            assert tags == (["kv_evicted"] if "kv_evicted" in tags else []) + (
                ["kv_allocated", "kv_sealed"] if refs else [])
            for e in events:
                if isinstance(e, wire.BlocksAllocated):
                    kv.update((b.hash, "allocated") for b in e.blocks)
                elif isinstance(e, wire.BlocksSealed):
                    kv.update((x.hash, "sealed") for x in e.seals)
                elif isinstance(e, wire.BlocksEvicted):
                    evicted += len(e.hashes)
                    for x in e.hashes:
                        del kv[x]
        assert s.evictions == evicted > 0
        assert kv == {e.hash: "sealed" for e in s.entries()}
