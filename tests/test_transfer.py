"""The UCX data plane between real processes: each peer is a separate Python process
(tests/helpers/ucx_peer.py) serving deterministic blocks from its own arena; this process pulls,
gets and puts over UCX and checks every byte, deadline and typed error. The fault cases
(killed, paused, vanished peers) run in processes of their own: tests/test_transfer_faults.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from cpd.kvstore import BlockStore, KvStore, checksum
from cpd.ops.config import load_settings
from cpd.protocol import wire
from cpd.protocol.errors import BlockEvicted, ChecksumMismatch, ConfigError, MalformedMessage
from cpd.transfer import BandwidthMeter, TransferClient, decode_address, encode_address
from tests.helpers.ucx_harness import MIXED, Peer, local_store, new_client, peer
from tests.helpers.ucx_peer import NAMESPACE, block_payload, block_refs


@pytest.fixture(scope="module")
def mixed() -> Iterator[Peer]:
    with peer(seed=11, sizes=MIXED) as p:
        yield p


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    c = await new_client()
    yield c
    await c.close()


# --------------------------------------------------------------------------- integrity


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("batch", [[3], [0, 1, 2, 3], list(range(4, 12)),
                                   [19, 0, 12, 5, 18], list(range(20))])
async def test_get_into_is_byte_exact(mixed: Peer, client: TransferClient,
                                      batch: list[int]) -> None:
    dests = [np.full(mixed.sizes[i] + 3, 0xAB, np.uint8) for i in batch]  # oversized
    got = await client.get_into(mixed.address, mixed.hashes(batch), dests)
    for i, d, f in zip(batch, dests, got, strict=True):
        n = mixed.sizes[i]
        assert f.seal.nbytes == n and f.namespace == NAMESPACE
        assert np.array_equal(d[:n], mixed.expected(i))
        assert (d[n:] == 0xAB).all()  # nothing written past the block
    assert [f.ref.hash for f in got] == mixed.hashes(batch)


@pytest.mark.timeout(60, method="thread")
async def test_pull_into_the_local_store_is_byte_exact_and_sealed(
        mixed: Peer, client: TransferClient) -> None:
    kv = local_store(24)
    idx = list(range(20))
    seals = await client.pull(mixed.address, mixed.hashes(idx), kv, namespace=NAMESPACE)
    assert len(seals) == 20
    for i in idx:
        e = kv.store.get(mixed.hashes([i])[0])
        assert e.namespace == NAMESPACE and e.ref == block_refs(mixed.seed, 20)[i]
        assert np.array_equal(kv.store.data(e.hash), mixed.expected(i))
        assert e.checksum == checksum(mixed.expected(i))
        assert np.shares_memory(kv.store.data(e.hash), kv.store.arena)
    # Held blocks are not fetched again.
    assert await client.pull(mixed.address, mixed.hashes(idx), kv) == []
    # Events a kvindex would get: allocated, writing, sealed.
    kinds = [e.__struct_config__.tag for e in kv.store.drain_events()]
    assert kinds == []  # the KvStore wrapper drained them (publisher None drops them)


@pytest.mark.timeout(90, method="thread")
async def test_many_concurrent_transfers_stay_correct(client: TransferClient) -> None:
    with peer(seed=21, sizes="65536x64,262144x32") as a, \
            peer(seed=22, sizes="131072x48,4096x16") as b:
        rng = random.Random(5)
        peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, client.in_flight)
                await asyncio.sleep(0)

        async def one(p: Peer) -> None:
            idx = rng.sample(range(len(p.sizes)), rng.randint(1, 24))
            dests = [np.empty(p.sizes[i], np.uint8) for i in idx]
            await client.get_into(p.address, p.hashes(idx), dests, timeout_s=30)
            for i, d in zip(idx, dests, strict=True):
                assert np.array_equal(d, p.expected(i))

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(one(a if k % 2 else b) for k in range(48)))
        stop.set()
        await watcher
        assert 1 < peak <= 4  # concurrency was real and bounded
        assert len(client._conns) == 2  # one reused connection per peer


# --------------------------------------------------------------------------- failures


@pytest.mark.timeout(60, method="thread")
async def test_evicted_block_is_a_typed_error_and_put_lands_byte_exact(
        client: TransferClient) -> None:
    # The peer's arena is full with one chain of 6 blocks; a put of 2 new blocks makes it
    # evict the 2 youngest leaves of the chain (prefix-closed: from the tail).
    with peer("--slots", "6", seed=51, sizes="65536x6") as p:
        mine = local_store(4, 65536)
        refs = block_refs(99, 2)
        payloads = [block_payload(99, i, 65536) for i in range(2)]
        await mine.write_blocks(NAMESPACE, refs, payloads)
        assert await client.put(p.address, [r.hash for r in refs], mine) == 2
        assert mine.store.leases() == []  # the local pin ended with the put
        # Pushing again sends nothing: the peer holds them already.
        assert await client.put(p.address, [r.hash for r in refs], mine) == 0
        with pytest.raises(BlockEvicted):
            await client.get_into(p.address, p.hashes([5]), [np.empty(65536, np.uint8)])
        with pytest.raises(BlockEvicted):
            await client.get_into(p.address, p.hashes([0, 4]),
                                  [np.empty(65536, np.uint8) for _ in range(2)])
        # The connection survives a clean error; the rest is intact.
        dests = [np.empty(65536, np.uint8) for _ in range(4)]
        await client.get_into(p.address, [*p.hashes([0, 3]), refs[0].hash, refs[1].hash],
                              dests)
        assert np.array_equal(dests[1], p.expected(3))
        assert np.array_equal(dests[2], payloads[0]) and np.array_equal(dests[3], payloads[1])
        # A namespace filter hides blocks of other namespaces.
        with pytest.raises(BlockEvicted):
            await client.get_into(p.address, p.hashes([0]), dests[:1], namespace="other")


@pytest.mark.timeout(60, method="thread")
async def test_corrupted_block_is_detected_by_checksum(client: TransferClient) -> None:
    with peer("--corrupt", "2", seed=61, sizes="65536x4") as p:
        with pytest.raises(ChecksumMismatch):
            await client.get_into(p.address, p.hashes(range(4)),
                                  [np.empty(65536, np.uint8) for _ in range(4)])
        kv = KvStore(BlockStore(65536, 4, node="me"), None)
        with pytest.raises(ChecksumMismatch):
            await client.pull(p.address, p.hashes(range(4)), kv)
        held = {e.hash for e in kv.store.entries()}
        assert held == set(p.hashes([0, 1, 3]))  # the bad block was failed, not sealed
        assert kv.store.free_slots == 1


@pytest.mark.timeout(60, method="thread")
async def test_a_peer_cannot_vouch_for_bytes_it_forged(client: TransferClient) -> None:
    """Blocks 1 and 2 altered after sealing, served with seals that match the altered
    bytes: a pull that believes the peer's reply takes them; one that checks the bytes
    against what the writer sealed (kvindex's record, ``expected``) fails exactly those,
    and seals the others."""
    with peer("--forge", "1,2", seed=62, sizes="65536x4") as p:
        hashes = p.hashes(range(4))
        believing = local_store(4, 65536)
        await client.pull(p.address, hashes, believing)
        assert {e.hash for e in believing.store.entries()} == set(hashes)  # forged, taken
        kv = local_store(4, 65536)
        with pytest.raises(ChecksumMismatch):
            await client.pull(p.address, hashes, kv, expected={
                h: checksum(p.expected(i)) for i, h in enumerate(hashes)})
        assert {e.hash for e in kv.store.entries()} == set(p.hashes([0, 3]))
        assert kv.store.free_slots == 2

        async def recorded() -> dict[bytes, int]:  # looked up while the bytes travel
            return {h: checksum(p.expected(i)) if i != 3 else -1  # 3: not recorded
                    for i, h in enumerate(hashes)}

        late = local_store(4, 65536)
        with pytest.raises(ChecksumMismatch):
            await client.pull(p.address, hashes, late, expected=recorded)
        assert {e.hash for e in late.store.entries()} == set(p.hashes([0]))


@pytest.mark.timeout(60, method="thread")
async def test_a_reply_of_another_namespace_is_refused(client: TransferClient) -> None:
    with peer("--foreign", seed=63, sizes="65536x2") as p:
        kv = local_store(2, 65536)
        with pytest.raises(MalformedMessage):
            await client.pull(p.address, p.hashes(range(2)), kv, namespace=NAMESPACE)
        assert not list(kv.store.entries()) and kv.store.free_slots == 2


# ------------------------------------------------------------------------- pure parts


@pytest.mark.timeout(60, method="thread")
async def test_a_connection_opened_ahead_is_the_one_the_first_transfer_uses(
        mixed: Peer, client: TransferClient) -> None:
    assert not client.is_connected(mixed.address)
    assert await client.connect_ahead(mixed.address)
    assert client.is_connected(mixed.address)
    ep = client._conns[mixed.address].ep
    assert await client.connect_ahead(mixed.address)  # already open: no second dial
    dests = [np.empty(mixed.sizes[i], np.uint8) for i in range(4)]
    await client.get_into(mixed.address, mixed.hashes(range(4)), dests)
    assert client._conns[mixed.address].ep is ep
    assert all(np.array_equal(d, mixed.expected(i)) for i, d in enumerate(dests))


@pytest.mark.timeout(10)
def test_bandwidth_meter_is_an_ewma_of_large_transfers() -> None:
    m = BandwidthMeter(alpha=0.5, min_bytes=1000)
    assert m.gbps == 0.0
    m.record(100, 1e-6)  # tiny: latency, not bandwidth
    assert m.gbps == 0.0 and m.total_bytes == 100
    m.record(2_000_000_000, 1.0)
    assert m.gbps == pytest.approx(2.0)
    m.record(4_000_000_000, 1.0)
    assert m.gbps == pytest.approx(3.0)
    report = wire.LoadReport(node="n", role="prefill", kv_bandwidth_gbps=m.gbps)
    assert wire.decode(wire.encode(report), wire.LoadReport).kv_bandwidth_gbps == 3.0


@pytest.mark.parametrize(("before", "stall", "after"), [
    # (records before: (bytes, s)), the stalled transfer (bytes, s), the estimate after
    ([], (4_000_000_000, 2.0), 2.0),                       # the first estimate is the bound
    ([(4_000_000_000, 1.0)], (1_000_000_000, 1.0), 2.5),   # below: a sample (alpha 0.5)
    ([(4_000_000_000, 1.0)], (8_000_000_000, 1.0), 4.0),   # above: says nothing, ignored
    ([(4_000_000_000, 1.0)], (500, 1.0), 2.00000025),      # a stalled small one counts too
    ([(4_000_000_000, 1.0)], (1_000, 0.0), 4.0),           # no time: nothing to learn
])
def test_a_stalled_transfer_lowers_the_bandwidth_estimate(
        before: list[tuple[int, float]], stall: tuple[int, float], after: float) -> None:
    m = BandwidthMeter(alpha=0.5, min_bytes=1000)
    for nbytes, seconds in before:
        m.record(nbytes, seconds)
    moved = m.total_bytes
    m.stalled(*stall)
    assert m.gbps == pytest.approx(after)
    assert m.stalls == 1 and m.total_bytes == moved  # its bytes did not move


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


G = 1_000_000_000


@pytest.mark.parametrize(("samples", "after", "shifts"), [
    # (("r", bytes, s) a finished transfer | ("s", bytes, s) a stalled one), estimate
    ([("r", 4 * G, 1.0), ("r", 2 * G, 1.0)], 3.0, 0),         # within the band: EWMA
    ([("r", 4 * G, 1.0), ("r", G // 2, 1.0)], 2.25, 0),       # one outlier: EWMA only
    # Two in a row under a quarter of the estimate: the link changed; their mean.
    ([("r", 4 * G, 1.0), ("r", G // 2, 1.0), ("r", G // 4, 1.0)], 0.375, 1),
    # A stall's bound counts as one of them.
    ([("r", 4 * G, 1.0), ("s", G // 2, 1.0), ("r", G // 4, 1.0)], 0.375, 1),
    # An in-band sample between breaks the run.
    ([("r", 4 * G, 1.0), ("r", G // 2, 1.0), ("r", 4 * G, 1.0), ("r", G // 2, 1.0)],
     1.8125, 0),
    # Two in a row over four times it: a restored link, believed at once.
    ([("r", G // 2, 1.0), ("r", 4 * G, 1.0), ("r", 8 * G, 1.0)], 6.0, 1),
    # One below then one above: not a run (the second starts one of its own).
    ([("r", 2 * G, 1.0), ("r", G // 10, 1.0), ("r", 9 * G, 1.0)], 5.025, 0),
])
def test_the_bandwidth_estimate_restarts_when_the_link_changes(
        samples: list[tuple[str, int, float]], after: float, shifts: int) -> None:
    m = BandwidthMeter(alpha=0.5, min_bytes=1000)
    for kind, nbytes, seconds in samples:
        (m.record if kind == "r" else m.stalled)(nbytes, seconds)
    assert m.gbps == pytest.approx(after, rel=1e-3)
    assert m.shifts == shifts


def test_an_old_bandwidth_estimate_expires_and_the_next_transfer_measures_afresh() -> None:
    clock = _Clock()
    m = BandwidthMeter(alpha=0.5, min_bytes=1000, max_age_s=60.0, clock=clock)
    m.record(G // 100, 1.0)               # a slow link: 0.01 GB/s
    clock.t += 59.0
    assert m.gbps == pytest.approx(0.01)  # still fresh
    clock.t += 2.0
    assert m.gbps == 0.0                  # unknown: the router prices at its default
    m.record(2 * G, 1.0)                  # the next transfer is the estimate
    assert m.gbps == pytest.approx(2.0)
    never = BandwidthMeter(alpha=0.5, min_bytes=1000, clock=clock)
    never.record(G, 1.0)
    clock.t += 1e6
    assert never.gbps == pytest.approx(1.0)  # max_age_s 0: never expires
    with pytest.raises(ValueError):
        BandwidthMeter(max_age_s=-1.0)


@pytest.mark.timeout(10)
def test_addresses_and_settings() -> None:
    assert decode_address(encode_address("10.0.0.5", 4242)) == ("10.0.0.5", 4242)
    for bad in (b"nohost", b"h:0", b":12", b"h:x"):
        with pytest.raises(MalformedMessage):
            decode_address(bad)
    with pytest.raises(ConfigError):
        load_settings(environ={"CPD_DATAPLANE__UCX_TLS": "posix,cma"})


