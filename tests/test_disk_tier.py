"""The local disk tier: block files written whole or not at all, torn and altered files
never served, capacity in policy order, and a worker's store writing behind, reading back
and finding its files again after a restart (into a real ``CPD_KV`` stream)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import nats.errors
import numpy as np
import pytest
from nats.js import api

from cpd.kvstore import BlockStore, KvStore, checksum
from cpd.kvstore import events as kvevents
from cpd.kvstore.disk import DiskTier
from cpd.kvstore.events import KvEventPublisher
from cpd.protocol import subjects, wire
from cpd.protocol.lifecycle import BlockState

NS = "ns-disk"
SLOT = 256


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(first: int, n: int) -> list[wire.BlockRef]:
    refs, parent = [], b""
    for i in range(first, first + n):
        refs.append(wire.BlockRef(h(i), parent, 16))
        parent = h(i)
    return refs


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, SLOT, dtype=np.uint8)


def written(tmp_path: Path, refs: list[wire.BlockRef], capacity: int = 64 * SLOT) -> DiskTier:
    disk = DiskTier(tmp_path, capacity, SLOT, node="n1")
    for i, r in enumerate(refs):
        assert disk.write(NS, r, payload(i), checksum(payload(i)))
    disk.register(disk.scan())
    return disk


def test_a_block_file_reads_back_exactly(tmp_path: Path) -> None:
    disk = written(tmp_path, chain(1, 3))
    assert len(disk.index) == 3 and disk.written == 3
    for i, r in enumerate(chain(1, 3)):
        dest = np.zeros(SLOT, np.uint8)
        assert disk.read_into(disk.sealed(r.hash), dest)
        assert np.array_equal(dest, payload(i))
    events = disk.index.drain_events()
    assert {e.tier for e in events} == {wire.Tier.DISK}
    sealed = [s for e in events if isinstance(e, wire.BlocksSealed) for s in e.seals]
    assert {s.hash: s.checksum for s in sealed} == {
        r.hash: checksum(payload(i)) for i, r in enumerate(chain(1, 3))}


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "header"])
def test_a_damaged_file_is_never_read(tmp_path: Path, damage: str) -> None:
    refs = chain(1, 2)
    disk = written(tmp_path, refs)
    path = disk.path(refs[1].hash)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "extend":
        data += b"\0"
    else:
        data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not disk.read_into(disk.sealed(refs[1].hash), np.zeros(SLOT, np.uint8))
    assert disk.read_into(disk.sealed(refs[0].hash), np.zeros(SLOT, np.uint8))
    # A restart's scan drops what it can tell from the size and header alone; a flipped
    # byte is only caught on read.
    again = DiskTier(tmp_path, 64 * SLOT, SLOT, node="n1")
    found = {b.ref.hash for b in again.scan()}
    assert (refs[1].hash in found) == (damage == "flip")
    assert path.exists() == (damage == "flip")


def test_a_write_a_crash_interrupted_is_removed_at_the_scan(tmp_path: Path) -> None:
    disk = written(tmp_path, chain(1, 1))
    tmp = disk.path(h(9)).with_name(disk.path(h(9)).name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"CPDKVB partial")
    assert [b.ref.hash for b in DiskTier(tmp_path, 64 * SLOT, SLOT, node="n1").scan()] == [h(1)]
    assert not tmp.exists()


def test_capacity_evicts_in_policy_order_and_removes_the_files(tmp_path: Path) -> None:
    refs = chain(1, 4)
    disk = written(tmp_path, refs, capacity=4 * SLOT)
    disk.index.allocate(NS, chain(10, 2))  # two new blocks: two leaves of the chain go
    gone = [r.hash for r in refs if not disk.path(r.hash).exists()]
    assert len(gone) == 2 and all(g not in disk for g in gone)
    # Prefix-closed: the chain's tail left, its head stayed.
    assert gone == [h(3), h(4)]
    # A smaller capacity after a restart keeps what fits and removes the rest.
    small = DiskTier(tmp_path, 1 * SLOT, SLOT, node="n1")
    assert small.register(small.scan()) == 1
    assert sum(1 for _ in tmp_path.glob("??/*.kvb")) == 1


def test_the_read_rate_is_a_running_mean_of_measured_batches(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 64 * SLOT, SLOT, node="n1")
    assert disk.read_gbps == 0.0
    disk.measured(2_000_000_000, 1.0)
    assert disk.read_gbps == 2.0
    disk.measured(1_000_000_000, 1.0)
    assert disk.read_gbps == pytest.approx(2.0 - 0.2 * 1.0)
    disk.measured(0, 1.0)  # nothing read: no figure
    disk.measured(10, 0.0)
    assert disk.read_gbps == pytest.approx(1.8)


def test_a_dropped_block_loses_its_file(tmp_path: Path) -> None:
    disk = written(tmp_path, chain(1, 2))
    assert disk.drop([h(2)]) == [h(2)] and not disk.path(h(2)).exists()
    assert disk.dropped == 1 and h(2) not in disk


async def _events(js, node: str) -> list[wire.KvEvent]:
    """Every event of ``node`` in ``CPD_KV`` so far."""
    sub = await js.subscribe(subjects.kv_events(node), ordered_consumer=True,
                             deliver_policy=api.DeliverPolicy.ALL)
    out: list[wire.KvEvent] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except nats.errors.TimeoutError:
                return out
            out.append(wire.decode(msg.data, wire.KvEvent))
    finally:
        await sub.unsubscribe()


async def _until(check, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.timeout(60)
async def test_a_store_writes_behind_reads_back_and_finds_its_files_again(
        bus, tmp_path: Path) -> None:
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    node = f"disk-{uuid.uuid4().hex[:8]}"
    refs = [wire.BlockRef(h(i), b"", 16) for i in range(1, 5)]  # four first blocks

    def store(epoch: int) -> KvStore:
        return KvStore(BlockStore(SLOT, 2, node=node), KvEventPublisher(js, node, epoch=epoch),
                       disk=DiskTier(tmp_path, 16 * SLOT, SLOT, node=node))

    kv = store(1)
    await kv.start(bus.nc, sweep_interval_s=0.05)
    try:
        for i, r in enumerate(refs[:2]):
            await kv.write_blocks(NS, [r], [payload(i)])
        await _until(lambda: all(kv.disk.sealed(r.hash) for r in refs[:2]))
        for i, r in enumerate(refs[2:], 2):  # two more: the arena of two lets 1 and 2 go
            await kv.write_blocks(NS, [r], [payload(i)])
        await _until(lambda: all(kv.disk.sealed(r.hash) for r in refs))
        assert h(1) not in kv.store and h(2) not in kv.store
        # Reading back needs room: the arena evicts its unpinned blocks for them.
        assert await kv.promote([h(1), h(2)]) == 2
        assert np.array_equal(kv.store.data(h(1)), payload(0))
        assert kv.store.get(h(2)).state is BlockState.SEALED and kv.promoted == 2
        assert kv.disk.read_gbps > 0  # measured: what the router prices disk loads with
    finally:
        await kv.close()
    events = await _events(js, node)
    disk_sealed = [s.hash for e in events if e.tier is wire.Tier.DISK
                   and isinstance(e, wire.BlocksSealed) for s in e.seals]
    assert disk_sealed == [r.hash for r in refs]

    # kill -9 leaves the files; a new incarnation announces them, and a file cut short
    # meanwhile is dropped at the scan, never announced.
    path = kv.disk.path(h(4))
    os.truncate(path, path.stat().st_size - 1)
    kv = store(2)
    await kv.start(bus.nc, sweep_interval_s=0.05)
    try:
        assert sorted(e.hash for e in kv.disk.index.entries()) == [h(1), h(2), h(3)]
        assert kv.disk.dropped == 1
        # A file altered after the scan fails its checksum when read: dropped, not served.
        flipped = kv.disk.path(h(3))
        data = bytearray(flipped.read_bytes())
        data[-1] ^= 1
        flipped.write_bytes(bytes(data))
        assert await kv.promote([h(2), h(3)]) == 1
        assert h(3) not in kv.store and h(3) not in kv.disk and not flipped.exists()
        assert np.array_equal(kv.store.data(h(2)), payload(1))
    finally:
        await kv.close()
    later = [e for e in await _events(js, node) if e.epoch == 2]
    announced = [s.hash for e in later if e.tier is wire.Tier.DISK
                 and isinstance(e, wire.BlocksSealed) for s in e.seals]
    evicted = [x for e in later if e.tier is wire.Tier.DISK
               and isinstance(e, wire.BlocksEvicted) for x in e.hashes]
    assert sorted(announced) == [h(1), h(2), h(3)] and evicted == [h(3)]


async def test_a_read_cut_short_by_its_callers_deadline_gives_its_slots_back(
        tmp_path: Path) -> None:
    """A promote cancelled mid-read (a get's deadline) lets the read finish before the
    arena slots it writes into go back; the disk copy stays, unpinned."""
    kv = KvStore(BlockStore(SLOT, 2, node="n1"), None,
                 disk=DiskTier(tmp_path, 16 * SLOT, SLOT, node="n1"))
    ref = wire.BlockRef(h(1), b"", 16)
    assert kv.disk.write(NS, ref, payload(0), checksum(payload(0)))
    kv.disk.register(kv.disk.scan())
    task = asyncio.create_task(kv.promote([h(1)]))
    await asyncio.sleep(0)  # it is reading now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h(1) not in kv.store and kv.store.free_slots == 2
    assert kv.disk.sealed(h(1)).pins == 0
    assert await kv.promote([h(1)]) == 1  # and reads fine afterwards
    assert np.array_equal(kv.store.data(h(1)), payload(0))
