"""Coalesced gets: runs of small blocks travel as one UCX message each.

The run layout (:func:`cpd.transfer.coalesce_runs`) is pure and tested here directly; the
rest runs against real peer processes (tests/helpers/ucx_peer.py) like tests/test_transfer.py:
byte-exact results across block sizes, batch sizes and message limits, checksums of
blocks inside a run, and what peers of other builds or settings answer. The killed and
paused peer cases of a coalesced get are in tests/helpers/ucx_fault_cases.py.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import numpy as np
import pytest

from cpd.kvstore import BlockStore, KvStore
from cpd.ops.config import DataPlaneSettings
from cpd.protocol import wire
from cpd.protocol.errors import ChecksumMismatch, InvalidRequest, MalformedMessage
from cpd.transfer import TransferClient, coalesce_runs
from cpd.transfer.framing import runs_field, runs_from_field
from tests.helpers.ucx_harness import Peer, local_store, peer
from tests.helpers.ucx_peer import NAMESPACE, block_refs

KIB = 1 << 10
MIB = 1 << 20

# 70 blocks: runs of small ones, a 1 B and a 0-slack block, and zero-copy ones between.
SIZES = "4096x40,1x1,4097x3,65536x20,262144x2,1048576x2,4096x2"


def _settings(below: int = 256 * KIB, message: int = 4 * MIB) -> DataPlaneSettings:
    return DataPlaneSettings(max_concurrent_transfers=4, coalesce_below_bytes=below,
                             coalesce_message_bytes=message)


@pytest.fixture(scope="module")
def small() -> Iterator[Peer]:
    with peer(seed=81, sizes=SIZES) as p:
        yield p


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    c = TransferClient(_settings())
    yield c
    await c.close()


# ------------------------------------------------------------------------ run layout


@pytest.mark.timeout(10)
def test_runs_split_at_the_message_limit() -> None:
    s = _settings(message=4 * MIB)
    assert coalesce_runs([64 * KIB] * 130, s) == [(0, 64), (64, 64), (128, 2)]
    assert coalesce_runs([4 * KIB] * 5, _settings(message=20_000)) == [(0, 4), (4, 1)]
    assert coalesce_runs([], s) == []


@pytest.mark.timeout(10)
def test_large_blocks_keep_a_message_of_their_own() -> None:
    s = _settings(below=256 * KIB)
    caps = [4 * KIB, 4 * KIB, 256 * KIB, 4 * KIB, MIB, 4 * KIB, 4 * KIB, 4 * KIB]
    assert coalesce_runs(caps, s) == [(0, 2), (2, 1), (3, 1), (4, 1), (5, 3)]
    # Under the threshold but over the message limit: alone as well.
    assert coalesce_runs([8 * KIB, 8 * KIB], _settings(message=4 * KIB)) == [(0, 1), (1, 1)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("below, message", [(0, 4 * MIB), (256 * KIB, 0), (0, 0)])
def test_either_setting_at_zero_turns_coalescing_off(below: int, message: int) -> None:
    runs = coalesce_runs([4 * KIB] * 6, _settings(below, message))
    assert runs == [(i, 1) for i in range(6)]
    assert runs_field(runs) == []  # the request is the one of builds without coalescing


@pytest.mark.timeout(10)
def test_runs_cover_every_block_once_in_order_within_the_limits() -> None:
    rng = random.Random(3)
    for _ in range(300):
        s = _settings(below=rng.choice([1, 4 * KIB, 64 * KIB, 256 * KIB]),
                      message=rng.choice([1, 8 * KIB, 100 * KIB, 4 * MIB]))
        caps = [rng.choice([0, 1, 4096, 4097, 65536, 262144, MIB])
                for _ in range(rng.randint(0, 80))]
        runs = coalesce_runs(caps, s)
        assert [i for start, count in runs for i in range(start, start + count)] == \
            list(range(len(caps)))
        for start, count in runs:
            members = caps[start:start + count]
            if count > 1:
                assert all(c < s.coalesce_below_bytes for c in members)
                assert sum(members) <= s.coalesce_message_bytes
        # Greedy: a run of small blocks ends where the next small one would not fit.
        for (a, _), (b, _) in itertools.pairwise(runs):
            grown = caps[a:b + 1]
            if all(c < s.coalesce_below_bytes for c in grown):
                assert sum(grown) > s.coalesce_message_bytes
        if runs_field(runs):
            assert runs_from_field(runs_field(runs), len(caps)) == runs


@pytest.mark.timeout(10)
@pytest.mark.parametrize("counts, n", [([0, 3], 3), ([2, 2], 3), ([5], 4), ([1], 2)])
def test_a_layout_that_does_not_cover_the_request_is_refused(counts: list[int],
                                                              n: int) -> None:
    with pytest.raises(InvalidRequest):
        runs_from_field(counts, n)


@pytest.mark.timeout(10)
def test_wire_fields_default_to_the_protocol_before_coalescing() -> None:
    # A header of an older client decodes with no layout; an older server's reply says
    # nothing was coalesced.
    class OldGet(wire.Message, tag="blk_get", kw_only=True):
        xfer_id: int
        hashes: bytes

    class OldReply(wire.Message, tag="blk_reply", kw_only=True):
        xfer_id: int

    get = wire.decode(msgspec.msgpack.encode(OldGet(xfer_id=3, hashes=b"h" * 16)))
    assert isinstance(get, wire.BlockGet) and get.runs == []
    reply = wire.decode(msgspec.msgpack.encode(OldReply(xfer_id=3)), wire.BlockReply)
    assert reply.coalesced is False
    new = wire.BlockGet(xfer_id=4, hashes=b"h" * 48, runs=[2, 1])
    assert wire.decode(wire.encode(new), wire.BlockGet).runs == [2, 1]


# -------------------------------------------------------------------- real transfers


@pytest.mark.timeout(90, method="thread")
@pytest.mark.parametrize("below, message, slack", [
    (256 * KIB, 4 * MIB, 0),  # defaults: the small blocks in one run each stretch
    (256 * KIB, 16 * KIB, 0),  # runs of 4 x 4 KiB split at the message limit
    (256 * KIB, 20_000, 3),  # a limit that is no multiple of the capacities
    (128 * KIB, 200 * KIB, 5),  # 64 KiB blocks in runs of 3, 4 KiB ones in long runs
    (0, 4 * MIB, 0),  # off: one message per block (what older clients ask for)
])
async def test_coalesced_gets_are_byte_exact(small: Peer, below: int, message: int,
                                             slack: int) -> None:
    settings = _settings(below, message)
    client = TransferClient(settings)
    rng = random.Random(below ^ message)
    everything = list(range(len(small.sizes)))
    batches = [everything, everything[:45], list(range(38, 47)), [41], [0, 1],
               rng.sample(everything, 33), rng.sample(everything, 12)]
    coalesced = 0
    try:
        for batch in batches:
            # Landing views larger than the blocks (slack): the run layout goes by the
            # views, the packing by the blocks' real lengths.
            dests = [np.full(small.sizes[i] + slack, 0xAB, np.uint8) for i in batch]
            coalesced += bool(runs_field(coalesce_runs([d.nbytes for d in dests],
                                                        settings)))
            # A reply that did not coalesce what was asked would raise MalformedMessage.
            got = await client.get_into(small.address, small.hashes(batch), dests,
                                        namespace=NAMESPACE)
            for i, d, f in zip(batch, dests, got, strict=True):
                n = small.sizes[i]
                assert f.seal.nbytes == n
                assert np.array_equal(d[:n], small.expected(i)), (batch, i)
                assert (d[n:] == 0xAB).all()  # nothing written past the block
    finally:
        await client.close()
    assert coalesced >= (5 if below else 0) and (below or not coalesced)


@pytest.mark.timeout(60, method="thread")
async def test_pull_of_blocks_shorter_than_the_slots_is_byte_exact(
        small: Peer, client: TransferClient) -> None:
    kv = local_store(50, 8 * KIB)  # 4 KiB and 4097 B blocks in 8 KiB slots: coalesced
    idx = list(range(44))
    assert runs_field(coalesce_runs([8 * KIB] * len(idx), client.settings)) == [44]
    seals = await client.pull(small.address, small.hashes(idx), kv, namespace=NAMESPACE)
    assert len(seals) == len(idx)
    for i in idx:
        h = small.hashes([i])[0]
        assert np.array_equal(kv.store.data(h), small.expected(i))
        assert kv.store.get(h).ref == block_refs(small.seed, len(small.sizes))[i]
    assert kv.store.free_slots == 50 - len(idx)


@pytest.mark.timeout(90, method="thread")
async def test_concurrent_coalesced_gets_share_the_staging_buffers_correctly(
        small: Peer) -> None:
    # 4 permits × 2 lanes of 16 KiB: every get has several runs per lane, and 24 of them
    # reuse each staging buffer in turn.
    client = TransferClient(_settings(message=16 * KIB))
    rng = random.Random(9)
    try:
        async def one() -> None:
            idx = rng.sample(range(44), rng.randint(2, 44))
            dests = [np.empty(small.sizes[i], np.uint8) for i in idx]
            await client.get_into(small.address, small.hashes(idx), dests, timeout_s=30)
            for i, d in zip(idx, dests, strict=True):
                assert np.array_equal(d, small.expected(i))

        await asyncio.gather(*(one() for _ in range(24)))
    finally:
        await client.close()


@pytest.mark.timeout(60, method="thread")
async def test_a_corrupted_block_inside_a_run_is_detected_by_checksum(
        client: TransferClient) -> None:
    with peer("--corrupt", "5", seed=62, sizes="4096x12") as p:
        assert runs_field(coalesce_runs([4096] * 12, client.settings)) == [12]
        dests = [np.empty(4096, np.uint8) for _ in range(12)]
        with pytest.raises(ChecksumMismatch, match="1 of 12"):
            await client.get_into(p.address, p.hashes(range(12)), dests)
        kv = KvStore(BlockStore(4096, 12, node="me"), None)
        with pytest.raises(ChecksumMismatch):
            await client.pull(p.address, p.hashes(range(12)), kv)
        held = {e.hash for e in kv.store.entries()}
        assert held == set(p.hashes([i for i in range(12) if i != 5]))  # 5 was failed
        assert kv.store.free_slots == 1
        for i in range(12):
            if i != 5:
                assert np.array_equal(kv.store.data(p.hashes([i])[0]), p.expected(i))


# ------------------------------------------------------------- other builds, settings


@pytest.mark.timeout(60, method="thread")
async def test_a_peer_that_ignores_the_layout_fails_typed_at_once() -> None:
    with peer("--legacy", seed=63, sizes="4096x16") as p:
        # A client that does not coalesce (an older one) is served as before...
        plain = TransferClient(_settings(below=0))
        try:
            dests = [np.empty(4096, np.uint8) for _ in range(16)]
            await plain.get_into(p.address, p.hashes(range(16)), dests)
            assert all(np.array_equal(d, p.expected(i)) for i, d in enumerate(dests))
        finally:
            await plain.close()
        # ...one that asks for runs learns from the reply that the peer did not follow
        # them, instead of waiting for messages that never come.
        asking = TransferClient(_settings())
        try:
            t0 = time.monotonic()
            with pytest.raises(MalformedMessage, match="ignored the coalesced layout"):
                await asking.get_into(p.address, p.hashes(range(16)),
                                      [np.empty(4096, np.uint8) for _ in range(16)],
                                      timeout_s=10)
            assert time.monotonic() - t0 < 5
        finally:
            await asking.close()


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("server_limit, match", [
    ("8192", "exceeds this server's"),
    ("0", "coalesced gets are off"),
])
async def test_a_server_refuses_runs_it_cannot_stage(client: TransferClient,
                                                     server_limit: str, match: str) -> None:
    with peer("--coalesce-message-bytes", server_limit, seed=64, sizes="4096x8") as p:
        with pytest.raises(InvalidRequest, match=match):
            await client.get_into(p.address, p.hashes(range(8)),
                                  [np.empty(4096, np.uint8) for _ in range(8)])
        # Blocks that travel alone need no staging there.
        one = [np.empty(4096, np.uint8)]
        await client.get_into(p.address, p.hashes([3]), one)
        assert np.array_equal(one[0], p.expected(3))
