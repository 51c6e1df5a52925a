"""The host-DRAM block store: slots, lifecycle events, pins and leases, prefix-closed LRU
eviction (against a naive reference model), and publishing into a real ``CPD_KV`` stream."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import nats.js.errors
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js import api

from cpd.bus import Bus
from cpd.engines.profile import engine_profile
from cpd.kvstore import BlockStore, CopiesFirstGate, KvStore, as_byte_array, checksum
from cpd.kvstore import events as kvevents
from cpd.kvstore.events import MAX_BLOCKS_PER_EVENT, KvEventPublisher
from cpd.modelbuild import PRESETS
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ArenaFull, BlockEvicted, ChecksumMismatch, CpdError, ErrorCode
from cpd.protocol.lifecycle import BlockState

NS = "ns1"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(first: int, n: int, parent: bytes = b"") -> list[wire.BlockRef]:
    refs = []
    for i in range(first, first + n):
        refs.append(wire.BlockRef(h(i), parent, 16))
        parent = h(i)
    return refs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sealed_store(slots: int, refs: list[wire.BlockRef], slot: int = 64,
                 clock: Clock | None = None) -> BlockStore:
    s = BlockStore(slot, slots, node="n1", clock=clock or Clock())
    s.allocate(NS, refs)
    s.seal([r.hash for r in refs])
    s.drain_events()
    return s


def kinds(events: list[wire.KvEvent]) -> list[str]:
    return [e.__struct_config__.tag for e in events]


@pytest.mark.timeout(10)
def test_slot_bytes_derive_from_the_model() -> None:
    s = load_settings(environ={})
    tiny = PRESETS["tiny"]
    # 4 layers × (K, V) × 256 tokens × 2 KV heads × 64 × fp32 = 1 MiB
    assert (engine_profile(s).slot_bytes == 4 * 2 * 256 * 2 * 64 * 4
            == tiny.kv_bytes_per_token() * 256 == 1 << 20)
    half = load_settings(environ={}, overrides=["model.dtype=bfloat16", "cache.block_size=128"])
    assert engine_profile(half).slot_bytes == 1 << 18
    fixed = load_settings(environ={}, overrides=["dataplane.block_bytes=4096",
                                                 "dataplane.arena_bytes=65536"])
    store = BlockStore.from_settings(fixed, engine_profile(fixed).slot_bytes, node="n1")
    assert (store.slot_bytes, store.num_slots, store.total_bytes) == (4096, 16, 65536)


@pytest.mark.timeout(10)
def test_lifecycle_events_views_and_checksums() -> None:
    s = BlockStore(1024, 4, node="n1")
    refs = chain(1, 2)
    entries = s.allocate(NS, refs)
    assert [e.state for e in entries] == [BlockState.ALLOCATED] * 2
    s.begin_write([refs[0].hash, refs[1].hash])
    v = s.view(refs[0].hash)
    assert np.shares_memory(v, s.arena) and v.nbytes == 1024
    v[:] = np.arange(1024) % 251
    s.view(refs[1].hash)[:100] = 7
    seals = s.seal([refs[0].hash, (refs[1].hash, 100)])
    assert seals[0].checksum == xxhash.xxh3_64_intdigest(v.tobytes())
    assert (seals[1].nbytes, seals[1].checksum) == (100, checksum(bytes([7] * 100)))
    assert s.data(refs[1].hash).nbytes == 100
    ev = s.drain_events()
    assert kinds(ev) == ["kv_allocated", "kv_writing", "kv_sealed"]
    assert ev[0].blocks == refs and ev[0].namespace == NS and ev[0].node == "n1"
    assert ev[2].seals == seals
    assert s.drain_events() == []
    # Allocating what is held is a hit (None), not a second copy.
    assert s.allocate(NS, refs[:1]) == [None]
    assert s.drain_events() == []


@pytest.mark.timeout(10)
def test_arena_is_reused_and_never_grows() -> None:
    s = BlockStore(256, 2, node="n1")
    arena = s.arena
    slots = set()
    for i in range(50):
        [e] = s.allocate(NS, [wire.BlockRef(h(i), b"", 1)])
        slots.add(e.slot)
        s.seal([h(i)])
    assert s.arena is arena and slots == {0, 1} and len(s) == 2 and s.evictions == 48


@pytest.mark.timeout(10)
def test_failed_and_mismatched_blocks_free_their_slots() -> None:
    s = BlockStore(64, 3, node="n1")
    refs = chain(1, 3)
    s.allocate(NS, refs)
    s.view(h(2))[:] = 1
    good = checksum(s.view(h(2)))
    with pytest.raises(ChecksumMismatch):
        s.seal([(h(2), 64, good), (h(3), 64, good ^ 1)])
    assert s.get(h(2)).state is BlockState.SEALED and h(3) not in s
    s.fail([h(1)], "cancelled")
    assert h(1) not in s and s.free_slots == 2
    ev = s.drain_events()
    assert kinds(ev) == ["kv_allocated", "kv_sealed", "kv_failed", "kv_failed"]
    assert (ev[2].hashes, ev[2].reason) == ([h(3)], "checksum")
    assert (ev[3].hashes, ev[3].reason) == ([h(1)], "cancelled")
    with pytest.raises(ValueError):
        s.fail([h(2)], "sealed blocks are evicted, not failed")


@pytest.mark.timeout(10)
def test_corrupt_sealed_blocks_are_detected_and_discarded_unless_pinned() -> None:
    s = BlockStore(64, 4, node="n1", clock=Clock())
    refs = chain(1, 3)
    s.allocate(NS, refs)
    for r in refs:
        s.view(r.hash)[:] = 7
    s.seal([(r.hash, 64, checksum(s.view(r.hash))) for r in refs])
    s.drain_events()
    assert all(s.intact(r.hash) for r in refs)
    s.view(h(2))[5] ^= 0xFF  # a bit flip after sealing
    s.view(h(3))[0] ^= 0xFF
    assert [s.intact(r.hash) for r in refs] == [True, False, False]
    s.pin("reader", [h(3)], ttl_s=10)
    assert s.discard([h(2), h(3), h(9)]) == [h(2)]  # h(3) is being read: kept for now
    assert h(2) not in s and h(3) in s and s.free_slots == 2
    assert [(e.__struct_config__.tag, e.hashes) for e in s.drain_events()] == [
        ("kv_evicted", [h(2)])]
    s.unpin("reader")
    assert s.discard([h(3)]) == [h(3)] and len(s) == 1  # the orphan goes too once free


@pytest.mark.timeout(10)
def test_eviction_is_prefix_closed_then_lru() -> None:
    # a → b → c and a → d; a is the most recently used, yet leaves go first.
    s = sealed_store(4, [*chain(1, 3), wire.BlockRef(h(4), h(1), 16)])
    s.touch([h(4)])
    s.touch([h(1)])
    assert s.evict(1) == 1 and h(3) not in s  # c: the oldest leaf
    assert s.evict(1) == 1 and h(2) not in s  # b is a leaf now and older than d
    assert s.evict(1) == 1 and h(4) not in s
    assert s.evict(5) == 1 and len(s) == 0
    assert [e.hashes for e in s.drain_events()] == [[h(3)], [h(2)], [h(4)], [h(1)]]


@pytest.mark.timeout(10)
def test_pins_protect_blocks_and_their_ancestors_until_the_lease_ends() -> None:
    clock = Clock()
    s = sealed_store(3, chain(1, 3), clock=clock)
    s.pin("L1", [h(3)], ttl_s=5)
    with pytest.raises(ArenaFull):
        s.allocate(NS, [wire.BlockRef(h(9), b"", 1)])
    assert len(s) == 3 and h(9) not in s  # all or nothing
    with pytest.raises(BlockEvicted):
        s.pin("L2", [h(3), h(42)], ttl_s=5)
    assert "L2" not in {lease.lease_id for lease in s.leases()} and s.get(h(3)).pins == 1
    clock.now += 4
    assert s.expire_leases() == []
    clock.now += 2
    assert s.expire_leases() == ["L1"] and s.get(h(3)).pins == 0
    s.allocate(NS, [wire.BlockRef(h(9), b"", 1)])
    assert h(3) not in s and h(9) in s
    s.pin("L3", [h(2)], ttl_s=1)
    assert s.unpin("L3") and not s.unpin("L3")


@pytest.mark.timeout(10)
def test_parents_in_the_same_batch_and_late_parents_are_protected() -> None:
    s = sealed_store(2, chain(1, 1))
    # Allocating a child of h(1) when h(1) is the only evictable block must not evict it.
    with pytest.raises(ArenaFull):
        s.allocate(NS, chain(2, 2, parent=h(1)))
    assert h(1) in s and h(2) not in s
    # A child that arrives before its parent is adopted when the parent comes.
    s2 = BlockStore(64, 3, node="n1")
    s2.allocate(NS, [wire.BlockRef(h(2), h(1), 16)])
    s2.allocate(NS, [wire.BlockRef(h(1), b"", 16)])
    s2.seal([h(1), h(2)])
    s2.touch([h(2)])
    assert s2.evict(1) == 1 and h(2) not in s2 and h(1) in s2


@pytest.mark.timeout(10)
def test_snapshot_reannounces_parents_first() -> None:
    s = BlockStore(64, 8, node="n1")
    s.allocate(NS, [wire.BlockRef(h(3), h(2), 16)])  # child first
    s.allocate(NS, chain(1, 2))
    s.allocate("ns2", chain(7, 1))
    s.begin_write([h(7)])
    s.seal([h(1), h(2), h(3)])
    ev = s.snapshot_events()
    assert kinds(ev) == ["kv_cleared", "kv_allocated", "kv_sealed", "kv_allocated",
                         "kv_writing"]
    assert [b.hash for b in ev[1].blocks] == [h(1), h(2), h(3)]
    assert [x.hash for x in ev[2].seals] == [h(1), h(2), h(3)]
    assert ev[3].namespace == "ns2" and ev[4].hashes == [h(7)]


@pytest.mark.timeout(10)
def test_big_batches_are_split_into_bounded_events() -> None:
    n = MAX_BLOCKS_PER_EVENT + 10
    s = BlockStore(1, n, node="n1")
    s.allocate(NS, [wire.BlockRef(h(i), b"", 1) for i in range(n)])
    ev = s.drain_events()
    assert [len(e.blocks) for e in ev] == [MAX_BLOCKS_PER_EVENT, 10]


@pytest.mark.timeout(10)
def test_a_torch_tensor_can_be_the_arena_without_copies() -> None:
    t = torch.zeros(4, 8, dtype=torch.float32)  # 4 slots of 32 bytes
    assert np.shares_memory(as_byte_array(t), t.numpy())
    s = BlockStore(32, 4, arena=t)
    s.allocate(NS, [wire.BlockRef(h(1), b"", 1)])
    s.view(h(1))[:4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
    assert t[0, 0].item() == 1.5
    with pytest.raises(ValueError):
        BlockStore(32, 8, arena=t)


# ---------------------------------------------------------------- property test vs a model


class Model:
    """Naive reference: O(n) scans instead of counters and a lazy heap."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.blocks: dict[bytes, dict] = {}
        self.tick = 0
        self.leases: dict[str, tuple[list[bytes], float]] = {}

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def children(self, x: bytes) -> int:
        return sum(1 for b in self.blocks.values() if b["parent"] == x)

    def pins(self, x: bytes) -> int:
        return sum(hs.count(x) for hs, _ in self.leases.values())

    def victim(self) -> bytes | None:
        cands = [(b["tick"], k) for k, b in self.blocks.items()
                 if b["sealed"] and not self.pins(k) and not self.children(k)]
        return min(cands)[1] if cands else None

    def evict_one(self, evicted: list[bytes]) -> bool:
        v = self.victim()
        if v is None:
            return False
        # The property under test: nothing left in the store descends from the victim.
        assert self.children(v) == 0
        del self.blocks[v]
        evicted.append(v)
        return True

    def allocate(self, refs: list[wire.BlockRef], evicted: list[bytes]) -> bool:
        new = []
        for r in refs:
            if r.hash in self.blocks:
                self.blocks[r.hash]["tick"] = self.next_tick()
            else:
                self.blocks[r.hash] = {"parent": r.parent, "sealed": False,
                                       "tick": self.next_tick()}
                new.append(r.hash)
        while self.slots - (len(self.blocks) - len(new)) < len(new):
            if not self.evict_one(evicted):
                for x in new:
                    del self.blocks[x]
                return False
        return True


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 30), st.integers(1, 4)),
    st.tuples(st.just("seal"), st.integers(0, 30)),
    st.tuples(st.just("fail"), st.integers(0, 30)),
    st.tuples(st.just("touch"), st.integers(0, 30)),
    st.tuples(st.just("pin"), st.lists(st.integers(0, 30), min_size=1, max_size=3),
              st.integers(1, 5)),
    st.tuples(st.just("unpin"), st.integers(0, 5)),
    st.tuples(st.just("time"), st.integers(1, 3)),
    st.tuples(st.just("evict"), st.integers(1, 3)),
), max_size=60)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.integers(2, 8), ops)
def test_store_matches_the_reference_model(slots: int, program: list[tuple]) -> None:
    clock = Clock()
    s = BlockStore(8, slots, node="n1", clock=clock)
    m = Model(slots)
    known: list[bytes] = []  # every hash ever allocated, for picking targets
    next_id = 1
    lease_ids: list[str] = []

    def pick(i: int) -> bytes | None:
        return known[i % len(known)] if known else None

    for op in program:
        evicted: list[bytes] = []
        kind = op[0]
        if kind == "alloc":
            parent = pick(op[1]) if op[1] % 3 else b""
            refs = chain(next_id, op[2], parent=parent or b"")
            if known and op[1] % 5 == 0:  # re-allocate something held: a hit
                refs = [wire.BlockRef(pick(op[1]), b"", 16), *refs]
                if refs[0].hash in {r.hash for r in refs[1:]}:
                    refs = refs[1:]
                if refs[0].hash in s:
                    refs[0] = wire.BlockRef(refs[0].hash, s.get(refs[0].hash).parent, 16)
                else:
                    refs = refs[1:]
            next_id += op[2]
            fits = m.allocate(refs, evicted)
            if fits:
                s.allocate(NS, refs)
                known += [r.hash for r in refs if r.hash not in known]
            else:
                with pytest.raises(ArenaFull):
                    s.allocate(NS, refs)
        elif kind in ("seal", "fail"):
            x = pick(op[1])
            if x is None or x not in s or s.get(x).state is BlockState.SEALED:
                continue
            if kind == "seal":
                s.seal([x])
                m.blocks[x]["sealed"] = True
            else:
                s.fail([x], "test")
                del m.blocks[x]
        elif kind == "touch":
            x = pick(op[1])
            if x is not None and x in s:
                s.touch([x])
                m.blocks[x]["tick"] = m.next_tick()
        elif kind == "pin":
            hs = list(dict.fromkeys(x for x in map(pick, op[1]) if x is not None))
            lid = f"L{len(lease_ids)}"
            if hs and all(x in m.blocks and m.blocks[x]["sealed"] for x in hs):
                s.pin(lid, hs, ttl_s=op[2])
                for x in hs:
                    m.blocks[x]["tick"] = m.next_tick()
                m.leases[lid] = (hs, clock.now + op[2])
                lease_ids.append(lid)
            elif hs:
                with pytest.raises(BlockEvicted):
                    s.pin(lid, hs, ttl_s=op[2])
        elif kind == "unpin":
            if lease_ids:
                lid = lease_ids[op[1] % len(lease_ids)]
                assert s.unpin(lid) == (m.leases.pop(lid, None) is not None)
        elif kind == "time":
            clock.now += op[1]
            expired = s.expire_leases()
            gone = [lid for lid, (_, exp) in m.leases.items() if exp <= clock.now]
            for lid in gone:
                del m.leases[lid]
            assert sorted(expired) == sorted(gone)
        elif kind == "evict":
            for _ in range(op[1]):
                if not m.evict_one(evicted):
                    break
            assert s.evict(op[1]) == len(evicted)
        got = [x for e in s.drain_events() if isinstance(e, wire.BlocksEvicted)
               for x in e.hashes]
        assert got == evicted, kind  # same victims, same (LRU, prefix-closed) order
        # Invariants: same contents, pinned blocks held, slots consistent.
        assert set(m.blocks) == {e.hash for e in s.entries()}
        for hs, _ in m.leases.values():
            assert all(x in s for x in hs)
        used = [e.slot for e in s.entries()]
        assert len(set(used)) == len(used) and s.free_slots == slots - len(used)
        for e in s.entries():
            assert e.children == m.children(e.hash) and e.pins == m.pins(e.hash)


# ----------------------------------------------------------------------- into CPD_KV


@pytest.mark.timeout(60)
async def test_a_decode_store_follows_kvindex_misses_at_its_hand_offs(bus) -> None:
    """A decode worker's store (with a CopiesFirstGate) evicts copies first from the
    start, keeps to its policy after 256 quiet hand-offs, and evicts copies first again
    once kvindex's copies notices (over NATS) report lookups that missed lost blocks."""
    node = f"kvs-{uuid.uuid4().hex[:8]}"
    kv = KvStore(BlockStore(64, 2, node=node, copies_first=True), None,
                 gate=CopiesFirstGate("adaptive"))
    await kv.start(bus.nc, sweep_interval_s=0.05)
    try:
        for _ in range(256):
            assert kv.store.copies_first
            kv.handoff()
        assert not kv.store.copies_first
        for misses in (10, 60):  # a replica's first count, then 50 more
            await bus.nc.publish(subjects.kv_copies(node), wire.encode(wire.BlockCopies(
                namespace=NS, kvindex="kvi-0", misses=misses)))
        await bus.nc.flush()
        for _ in range(100):  # the next hand-off once the notices are in
            kv.handoff()
            if kv.store.copies_first:
                break
            await asyncio.sleep(0.02)
        assert kv.store.copies_first
    finally:
        await kv.close()


@pytest.mark.timeout(60)
async def test_lifecycle_events_land_in_the_cpd_kv_stream(bus) -> None:
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    node = f"kvs-{uuid.uuid4().hex[:8]}"
    kv = KvStore(BlockStore(64, 2, node=node), KvEventPublisher(js, node, epoch=7))
    await kv.start(bus.nc, sweep_interval_s=0.05)
    try:
        refs = chain(1, 2)
        await kv.write_blocks(NS, refs, [np.full(64, i, np.uint8) for i in range(2)])
        await kv.allocate(NS, [wire.BlockRef(h(5), b"", 16)])  # evicts h(2), the leaf
        await kv.fail([h(5)], "cancelled")
        kv.pin("lease", [h(1)], ttl_s=0.1)
        # kvindex asks for a re-announce over NATS; the store answers it.
        await bus.nc.request(subjects.kv_reannounce(node),
                             wire.encode(wire.Reannounce(reason="test")), timeout=5)
        assert kv.store.get(h(1)).pins == 1
        # The lease sweeper releases the pin once the lease expires.
        for _ in range(100):
            if not kv.store.leases():
                break
            await asyncio.sleep(0.02)
        assert kv.store.get(h(1)).pins == 0 and not kv.store.leases()
    finally:
        await kv.close()
    sub = await js.subscribe(subjects.kv_events(node), ordered_consumer=True,
                             deliver_policy=api.DeliverPolicy.ALL)
    got = []
    for _ in range(9):
        got.append(wire.decode((await sub.next_msg(timeout=5)).data, wire.KvEvent))
    await sub.unsubscribe()
    assert kinds(got) == ["kv_allocated", "kv_writing", "kv_sealed", "kv_evicted",
                          "kv_allocated", "kv_failed",
                          "kv_cleared", "kv_allocated", "kv_sealed"]
    assert [e.seq for e in got] == list(range(1, 10))
    assert {(e.node, e.epoch) for e in got} == {(node, 7)}
    assert got[2].seals[1].checksum == checksum(np.full(64, 1, np.uint8))
    assert got[3].hashes == [h(2)] and got[7].blocks == refs[:1]


@pytest.mark.parametrize("now_ms, last, epoch", [
    (1_000, None, 1_000),       # a node the stream has never seen: its start time
    (1_000, 900, 1_000),        # the clock moved on since the last incarnation
    (1_000, 1_000, 1_001),      # restarted within the same millisecond
    (1_000, 5_000, 5_001),      # the clock was set back: past the last epoch anyway
])
def test_a_new_epoch_is_always_past_the_last(now_ms: int, last: int | None,
                                             epoch: int) -> None:
    assert kvevents.next_epoch(now_ms, last) == epoch


@pytest.mark.timeout(60)
async def test_a_node_finds_its_last_epoch_in_the_stream(bus) -> None:
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    node, other = f"kve-{uuid.uuid4().hex[:8]}", f"kve-{uuid.uuid4().hex[:8]}"
    assert await kvevents.last_epoch(js, node) is None
    for n, epoch in ((node, 41), (node, 9_000_000_000_000), (other, 10**13)):
        await KvEventPublisher(js, n, epoch=epoch).cleared()
    assert await kvevents.last_epoch(js, node) == 9_000_000_000_000
    assert kvevents.next_epoch(1_000, await kvevents.last_epoch(js, node)) == 9_000_000_000_001


class _StoreRaceJetStream:
    """The JetStream API answering a stream's creation as a server does while a stream of
    that name, just deleted, is still being torn down: a 500 first, then success."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def add_stream(self, config: api.StreamConfig) -> api.StreamInfo:
        self.calls += 1
        if self.calls <= self.failures:
            raise nats.js.errors.ServerError(code=500, err_code=10049,
                                             description="error creating store for stream")
        return api.StreamInfo(config=config, state=None)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
async def test_a_stream_recreated_during_the_old_ones_teardown_is_retried() -> None:
    js = _StoreRaceJetStream(failures=2)
    info = await kvevents.ensure_stream(js, wait_s=5)  # type: ignore[arg-type]
    assert (js.calls, info.config.name) == (3, subjects.KV_STREAM)
    with pytest.raises(CpdError) as e:  # a server that keeps failing is reported, typed
        await kvevents.ensure_stream(_StoreRaceJetStream(failures=100),  # type: ignore[arg-type]
                                     wait_s=0.6)
    assert e.value.code is ErrorCode.UNAVAILABLE


@contextlib.asynccontextmanager
async def _outage_store(server: NatsServer, slots: int, **kw: int
                        ) -> AsyncIterator[tuple[KvStore, Any]]:
    """A store on ``server`` whose publishes give up fast (NATS is stopped under it),
    and the JetStream context to read its stream with afterwards."""
    s = load_settings(environ={}, overrides=[f"nats.servers={server.url}",
                                             "nats.reconnect_wait_s=0.1"])
    b = await Bus.open(s, "kvstore-outbox")
    js = b.nc.jetstream()
    await kvevents.ensure_stream(js)
    node = f"kvo-{uuid.uuid4().hex[:8]}"
    kv = KvStore(BlockStore(64, slots, node=node),
                 KvEventPublisher(js, node, epoch=3, ack_timeout_s=0.3, retry_window_s=0.5),
                 **kw)
    assert kv.outbox is not None
    kv.outbox.retry_pause_s = 0.1
    try:
        yield kv, js
    finally:
        await kv.close()
        await b.close()


async def _flushed_once_back(kv: KvStore) -> None:
    """Flush until NATS takes the events again (the client reconnects meanwhile)."""
    for _ in range(100):
        with contextlib.suppress(CpdError):
            await kv.flush()
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the events were never stored")


async def _stream(js: Any, node: str) -> list[wire.KvEvent]:
    """Every event of ``node`` in ``CPD_KV``, in stream order."""
    sub = await js.subscribe(subjects.kv_events(node), ordered_consumer=True,
                             deliver_policy=api.DeliverPolicy.ALL)
    got = []
    with contextlib.suppress(nats.errors.TimeoutError):
        while True:
            got.append(wire.decode((await sub.next_msg(timeout=1)).data, wire.KvEvent))
    await sub.unsubscribe()
    return got


@pytest.mark.timeout(120)
async def test_events_go_out_behind_the_caller_and_survive_a_nats_outage(
        fresh_nats: NatsServer) -> None:
    """The request path does not wait for JetStream: with NATS down a store keeps
    working and its events stay queued, in order; once NATS is back they are stored
    with contiguous seqs (a retried event keeps its seq, so no gap and no duplicate)."""
    async with _outage_store(fresh_nats, 4) as (kv, js):
        assert kv.outbox is not None
        await kv.write_blocks(NS, chain(1, 2), [np.full(64, i, np.uint8) for i in range(2)])
        await kv.flush()
        assert kv.outbox.pending == 0
        fresh_nats.stop()
        # Down: the store goes on; its three events wait in the outbox.
        seals = await kv.write_blocks(NS, chain(3, 1, parent=h(2)), [np.full(64, 3, np.uint8)])
        assert [x.hash for x in seals] == [h(3)] and kv.store.get(h(3)).state is BlockState.SEALED
        assert kv.outbox.pending == 3
        with pytest.raises(CpdError) as err:
            await kv.flush()
        assert err.value.code is ErrorCode.UNAVAILABLE and kv.outbox.pending == 3
        fresh_nats.start()
        await _flushed_once_back(kv)
        got = await _stream(js, kv.node)
    assert kinds(got) == ["kv_allocated", "kv_writing", "kv_sealed"] * 2  # none twice
    assert [e.seq for e in got] == list(range(1, 7))
    assert got[5].seals[0].hash == h(3)


@pytest.mark.timeout(120)
async def test_a_long_outage_replaces_the_queued_events_by_the_stores_state(
        fresh_nats: NatsServer) -> None:
    """Past its bound the outbox holds the store's state, not every transition: memory
    stays bounded and, once NATS is back, the stream ends with a re-announce of exactly
    what the store holds, with no gap in its seqs."""
    async with _outage_store(fresh_nats, 8, max_queued_events=4) as (kv, js):
        assert kv.outbox is not None
        await kv.write_blocks(NS, chain(1, 1), [np.full(64, 1, np.uint8)])
        await kv.flush()
        fresh_nats.stop()
        for i in range(2, 5):  # three events each: past the bound of four
            await kv.write_blocks(NS, chain(i, 1, parent=h(i - 1)), [np.full(64, i, np.uint8)])
            assert kv.outbox.pending <= 4
        fresh_nats.start()
        await _flushed_once_back(kv)
        got = await _stream(js, kv.node)
    assert [e.seq for e in got] == list(range(1, len(got) + 1)) and len(got) <= 7
    assert kinds(got[:3]) == ["kv_allocated", "kv_writing", "kv_sealed"]
    assert kinds(got[-3:]) == ["kv_cleared", "kv_allocated", "kv_sealed"]
    assert [r.hash for r in got[-2].blocks] == [h(i) for i in range(1, 5)]
    assert [x.hash for x in got[-1].seals] == [h(i) for i in range(1, 5)]


# ------------------------------------------------------------ copies elsewhere go first


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
@pytest.mark.parametrize(("shared", "last", "pinned", "evicted"), [
    ((), (), (), [h(1), h(2)]),                      # the policy's order
    ((3,), (), (), [h(3), h(1)]),                    # a copy elsewhere leaves first
    ((3, 4), (), (), [h(3), h(4)]),                  # least recently used among them
    ((3,), (3,), (), [h(1), h(2)]),                  # the last copy again: policy order
    ((3,), (), (3,), [h(1), h(2)]),                  # pinned: stays
    ((6,), (), (), [h(1), h(2)]),                    # a parent with its child held: stays
])
def test_blocks_with_a_copy_elsewhere_leave_first(policy: str, shared: tuple, last: tuple,
                                                  pinned: tuple, evicted: list) -> None:
    """Roots 1-4 used in order, then a chain 5 → 6 → 7: kvindex's word on copies
    decides before the policy, prefix-closed and never for a pinned block."""
    s = BlockStore(64, 7, node="n1", clock=Clock(), eviction=policy)
    roots = [wire.BlockRef(h(i), b"", 16) for i in range(1, 5)]
    for r in [*roots, *chain(5, 3)]:
        s.allocate(NS, [r])
        s.seal([r.hash])
    s.drain_events()
    s.mark_copies([h(i) for i in shared], [])
    s.mark_copies([], [h(i) for i in last])
    for i in pinned:
        s.pin(f"p{i}", [h(i)], ttl_s=60)
    assert s.evict(2) == 2
    gone = [e for ev in s.drain_events() if isinstance(ev, wire.BlocksEvicted)
            for e in ev.hashes]
    assert gone == evicted


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
@pytest.mark.parametrize(("copies_first", "evicted"), [
    (True, [h(3), h(4)]),     # copies elsewhere first
    (False, [h(1), h(2)]),    # the policy alone (dataplane.decode_copies_first off)
])
def test_an_arena_that_does_not_evict_copies_first_follows_its_policy(
        policy: str, copies_first: bool, evicted: list) -> None:
    """Roots 1-4 used in order, 3 and 4 with a copy elsewhere."""
    s = BlockStore(64, 4, node="n1", clock=Clock(), eviction=policy,
                   copies_first=copies_first)
    for i in range(1, 5):
        r = wire.BlockRef(h(i), b"", 16)
        s.allocate(NS, [r])
        s.seal([r.hash])
    s.drain_events()
    s.mark_copies([h(3), h(4)], [])
    assert s.evict(2) == 2
    gone = [e for ev in s.drain_events() if isinstance(ev, wire.BlocksEvicted)
            for e in ev.hashes]
    assert gone == evicted


def test_copies_of_blocks_not_held_are_ignored() -> None:
    s = sealed_store(2, chain(1, 2))
    assert s.mark_copies([h(9)], [h(8)]) == 0
    assert s.mark_copies([h(2)], [h(1)]) == 2
    assert s.get(h(2)).shared and not s.get(h(1)).shared
