"""UCX fault cases, each run in a fresh process by tests/test_transfer_faults.py.

A killed or paused peer aborts endpoints in this process; one process per case keeps one
case's after-effects (UCX state, threads, the peer's leftovers) out of every other test.
Handshakes after such an abort have been seen to stall in older ucxx builds; the reconnect
and dead-address cases assert that the next connection is served. Run directly:
``pytest tests/helpers/ucx_fault_cases.py``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from cpd.ops.config import DataPlaneSettings
from cpd.protocol.errors import PeerGone, TransferTimeout
from cpd.transfer import TransferClient, coalesce_runs, handshake
from cpd.transfer.framing import runs_field
from tests.helpers.ucx_harness import Peer, local_store, new_client, peer
from tests.helpers.ucx_peer import block_hash


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    c = await new_client()
    yield c
    await c.close()


@pytest.mark.timeout(60, method="thread")
async def test_peer_killed_mid_transfer_is_peer_gone_within_the_deadline(
        client: TransferClient) -> None:
    with peer("--stall-after", "5", seed=31, sizes="1048576x16") as p:
        kv = local_store(16, 1 << 20)
        task = asyncio.create_task(client.pull(p.address, p.hashes(range(16)), kv,
                                               timeout_s=10))
        assert (await p.next_line()) == {"stalled": True}  # 5 blocks sent, then stuck
        t0 = time.monotonic()
        os.kill(p.proc.pid, signal.SIGKILL)
        with pytest.raises(PeerGone):
            await task
        assert time.monotonic() - t0 < 5  # well within the 10 s deadline
        # The half-received blocks were failed and their slots returned.
        assert len(kv.store) == 0 and kv.store.free_slots == 16


@pytest.mark.timeout(60, method="thread")
async def test_peer_killed_mid_coalesced_get_is_peer_gone_within_the_deadline(
        client: TransferClient) -> None:
    # 256 x 64 KiB blocks travel as 4 coalesced runs of 4 MiB; the peer sends one.
    with peer("--stall-after", "1", seed=32, sizes="65536x256") as p:
        assert runs_field(coalesce_runs([65536] * 256, client.settings)) == [64] * 4
        kv = local_store(256, 65536)
        task = asyncio.create_task(client.pull(p.address, p.hashes(range(256)), kv,
                                               timeout_s=10))
        assert (await p.next_line()) == {"stalled": True}
        t0 = time.monotonic()
        os.kill(p.proc.pid, signal.SIGKILL)
        with pytest.raises(PeerGone):
            await task
        assert time.monotonic() - t0 < 5
        assert len(kv.store) == 0 and kv.store.free_slots == 256
        assert client.in_flight == 0  # the permit and its staging buffers came back


@pytest.mark.timeout(60, method="thread")
async def test_a_dead_address_fails_typed_within_the_deadline(client: TransferClient) -> None:
    with peer(seed=71, sizes="65536x1") as p:
        address = p.address
    t0 = time.monotonic()
    with pytest.raises((PeerGone, TransferTimeout)):
        await client.get_into(address, [block_hash(71, 0)], [np.empty(65536, np.uint8)],
                              timeout_s=2)
    assert time.monotonic() - t0 < 3
    # The refused dial left nothing behind that stalls the next handshake: a live peer
    # is served at once (ucxx 0.52 kept the refused endpoint, and later
    # handshakes stalled).
    with peer(seed=72, sizes="1048576x4") as live:
        dests = [np.empty(1 << 20, np.uint8) for _ in range(4)]
        t0 = time.monotonic()
        await client.get_into(live.address, live.hashes(range(4)), dests, timeout_s=10)
        assert time.monotonic() - t0 < 2
        assert all(np.array_equal(d, live.expected(i)) for i, d in enumerate(dests))


async def _pause_and_time_out(client: TransferClient, p: Peer, dests: list[np.ndarray]) -> float:
    """Warm a connection, SIGSTOP the peer, and return how long the next get took to
    fail with TransferTimeout (the peer is resumed afterwards)."""
    await client.get_into(p.address, p.hashes(range(len(dests))), dests)
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            await client.get_into(p.address, p.hashes(range(len(dests))), dests, timeout_s=1.0)
        return time.monotonic() - t0
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)


@pytest.mark.timeout(60, method="thread")
async def test_paused_peer_times_out_within_the_deadline(client: TransferClient) -> None:
    with peer(seed=41, sizes="1048576x8") as p:
        elapsed = await _pause_and_time_out(client, p, [np.empty(1 << 20, np.uint8)
                                                        for _ in range(8)])
        assert 1.0 <= elapsed < 2.0
    # The stall lowered the bandwidth estimate the warm-up get had set: 8 MiB in over a
    # second is far below what the unpaused get achieved.
    assert client.meter.stalls == 1 and client.meter.samples == 2
    assert client.meter.gbps < client.meter.total_bytes / client.meter.total_seconds / 1e9


@pytest.mark.timeout(60, method="thread")
async def test_paused_peer_times_out_a_coalesced_get_within_the_deadline(
        client: TransferClient) -> None:
    with peer(seed=43, sizes="65536x64") as p:
        dests = [np.empty(65536, np.uint8) for _ in range(64)]
        assert runs_field(coalesce_runs([d.nbytes for d in dests], client.settings))
        elapsed = await _pause_and_time_out(client, p, dests)
        assert 1.0 <= elapsed < 2.0


@pytest.mark.timeout(60, method="thread")
async def test_a_resumed_peer_serves_a_fresh_connection(client: TransferClient) -> None:
    with peer(seed=42, sizes="1048576x8") as p:
        dests = [np.empty(1 << 20, np.uint8) for _ in range(8)]
        await _pause_and_time_out(client, p, dests)
        # The aborted connection was dropped; the resumed peer serves a fresh one.
        dests[0][:] = 0
        await client.get_into(p.address, p.hashes(range(8)), dests, timeout_s=10)
        assert np.array_equal(dests[0], p.expected(0))


@pytest.mark.timeout(60, method="thread")
async def test_connecting_ahead_to_a_dead_peer_is_one_bounded_silent_dial(
        client: TransferClient) -> None:
    with peer(seed=73, sizes="65536x1") as p:
        address = p.address
    t0 = time.monotonic()
    assert not await client.connect_ahead(address)  # refused: reported, not raised
    assert time.monotonic() - t0 < client.settings.connect_timeout_s + 1
    assert not client.is_connected(address)
    # Nothing it left behind stalls the next peer's connection or transfer.
    with peer(seed=74, sizes="1048576x4") as live:
        assert await client.connect_ahead(live.address)
        dests = [np.empty(1 << 20, np.uint8) for _ in range(4)]
        await client.get_into(live.address, live.hashes(range(4)), dests, timeout_s=10)
        assert all(np.array_equal(d, live.expected(i)) for i, d in enumerate(dests))



@pytest.mark.timeout(60, method="thread")
async def test_a_handshake_answered_after_its_timeout_writes_into_kept_buffers() -> None:
    """A paused peer answers each dial's handshake only once resumed, after the dialler
    gave up. UCX still holds the dialler's receive then: its buffers are kept until the
    receive is done (ucxx's own exchange freed them, and the late answer wrote into freed
    memory: a segfault in the allocator some time later). Eight such dials, memory
    churned between, then a transfer from the same peer: byte exact, and nothing left
    held; the peer, whose side of each handshake timed out too, is still up."""
    client = TransferClient(DataPlaneSettings(max_concurrent_transfers=4,
                                              connect_timeout_s=0.3))
    try:
        with peer(seed=75, sizes="1048576x4") as p:
            for _ in range(8):
                os.kill(p.proc.pid, signal.SIGSTOP)
                try:
                    assert not await client.connect_ahead(p.address)
                    assert handshake.abandoned() >= 1  # the late answer has somewhere to go
                finally:
                    os.kill(p.proc.pid, signal.SIGCONT)
                await asyncio.sleep(0.3)  # the peer answers now, into the kept buffers
                gc.collect()
                churn = [bytearray(16) for _ in range(100_000)]
                del churn
            for _ in range(100):
                if not handshake.abandoned():
                    break
                await asyncio.sleep(0.05)
            assert handshake.abandoned() == 0 and p.proc.poll() is None
            dests = [np.empty(1 << 20, np.uint8) for _ in range(4)]
            await client.get_into(p.address, p.hashes(range(4)), dests, timeout_s=10)
            assert all(np.array_equal(d, p.expected(i)) for i, d in enumerate(dests))
    finally:
        await client.close()
