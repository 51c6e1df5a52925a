"""Data-plane capabilities (cpd.protocol.capability): the keyring's MACs, their flow through the
block store's sealed events, and a real UCX peer (tests/helpers/ucx_peer.py, its own process)
that serves a block only against the capability of its namespace: a client that knows or
guesses block hashes reads nothing, not even whether the blocks exist."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from cpd.kvstore import BlockStore
from cpd.protocol import wire
from cpd.protocol.capability import CAPABILITY_BYTES, Keyring
from cpd.protocol.errors import BlockEvicted, CapabilityDenied, error_from_wire
from cpd.transfer import TransferClient
from tests.helpers.ucx_harness import Peer, local_store, new_client, peer
from tests.helpers.ucx_peer import NAMESPACE, block_payload, block_refs

SECRET = bytes(range(32))


# ------------------------------------------------------------------------- pure parts


def test_keyring_capabilities_bind_namespace_node_epoch_secret_and_operation() -> None:
    k = Keyring("n1", 5, SECRET)
    cap = k.issue("ns-a")
    assert len(cap) == CAPABILITY_BYTES
    assert k.verify("ns-a", cap) and Keyring("n1", 5, SECRET).verify("ns-a", cap)
    # Anything else differing gives another capability that does not verify here.
    others = [k.issue("ns-b"), k.issue("ns-a", "put"), Keyring("n2", 5, SECRET).issue("ns-a"),
              Keyring("n1", 6, SECRET).issue("ns-a"),
              Keyring("n1", 5, bytes(32)).issue("ns-a"), Keyring("n1", 5).issue("ns-a")]
    assert len({cap, *others}) == len(others) + 1
    assert not any(k.verify("ns-a", o) for o in others)
    assert not k.verify("ns-a", cap, "put")  # a read capability never writes
    for bad in (b"", cap[:-1], cap + b"\x00", bytes(CAPABILITY_BYTES)):
        assert not k.verify("ns-a", bad)
    assert not k.verify("", k.issue(""))  # a capability always names a namespace
    # Two incarnations of one node draw different secrets: a restart voids old ones.
    assert Keyring("n1", 5).issue("ns-a") != Keyring("n1", 5).issue("ns-a")
    with pytest.raises(ValueError):
        Keyring("n1", 5, b"short")


def test_sealed_events_and_reannounce_carry_the_namespace_capability() -> None:
    k = Keyring("w", 1, SECRET)
    st = BlockStore(64, 8, node="w", capability=k.issue)
    for ns, seed in (("ns-a", 1), ("ns-b", 2)):
        refs = block_refs(seed, 2)
        st.allocate(ns, refs)
        st.begin_write([r.hash for r in refs])
        st.seal([r.hash for r in refs])
    sealed = [e for e in st.drain_events() if isinstance(e, wire.BlocksSealed)]
    assert {e.namespace: e.capability for e in sealed} == {"ns-a": k.issue("ns-a"),
                                                           "ns-b": k.issue("ns-b")}
    again = [e for e in st.snapshot_events() if isinstance(e, wire.BlocksSealed)]
    assert {e.namespace: e.capability for e in again} == {"ns-a": k.issue("ns-a"),
                                                          "ns-b": k.issue("ns-b")}
    # Without a keyring (tools) no capability is attached.
    plain = BlockStore(64, 2, node="t")
    plain.allocate("ns-a", block_refs(3, 1))
    plain.begin_write([block_refs(3, 1)[0].hash])
    plain.seal([block_refs(3, 1)[0].hash])
    assert [e.capability for e in plain.drain_events()
            if isinstance(e, wire.BlocksSealed)] == [b""]


def test_capability_denied_round_trips_as_its_own_typed_error() -> None:
    err = error_from_wire("capability_denied", "no capability", False)
    assert isinstance(err, CapabilityDenied) and not err.retryable


# ------------------------------------------------------------------------ real UCX


@pytest.fixture(scope="module")
def guarded() -> Iterator[Peer]:
    with peer("--secret", SECRET.hex(), "--slots", "8", seed=81, sizes="65536x4") as p:
        yield p


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    c = await new_client()
    yield c
    await c.close()


def _dests(n: int) -> list[np.ndarray]:
    return [np.full(65536, 0xAB, np.uint8) for _ in range(n)]


@pytest.mark.timeout(60, method="thread")
async def test_a_client_guessing_block_hashes_reads_nothing(guarded: Peer,
                                                            client: TransferClient) -> None:
    keys = Keyring("peer", 1, SECRET)  # the peer's keyring
    hashes = guarded.hashes(range(4))  # the right hashes: all the guesser lacks is the cap
    attempts = [
        {"namespace": NAMESPACE},  # no capability
        {"namespace": NAMESPACE, "capability": os.urandom(CAPABILITY_BYTES)},  # a guess
        {"namespace": NAMESPACE, "capability": keys.issue("other-ns")},  # another tenant's
        {"namespace": NAMESPACE, "capability": Keyring("peer", 2, SECRET).issue(NAMESPACE)},
        {"namespace": NAMESPACE, "capability": keys.issue(NAMESPACE, "put")},
        {"namespace": "", "capability": keys.issue(NAMESPACE)},  # must name the namespace
    ]
    for kwargs in attempts:
        dests = _dests(4)
        with pytest.raises(CapabilityDenied):
            await client.get_into(guarded.address, hashes, dests, **kwargs)  # type: ignore
        assert all((d == 0xAB).all() for d in dests), kwargs  # not one byte arrived
    # A valid capability of another namespace (another tenant's) sees these blocks as
    # absent, like blocks nobody holds.
    dests = _dests(4)
    with pytest.raises(BlockEvicted):
        await client.get_into(guarded.address, hashes, dests, namespace="other-ns",
                              capability=keys.issue("other-ns"))
    assert all((d == 0xAB).all() for d in dests)
    # Hashes nobody holds are refused the same way: no oracle of what is cached.
    with pytest.raises(CapabilityDenied):
        await client.get_into(guarded.address, [os.urandom(16)], _dests(1),
                              namespace=NAMESPACE)
    # A pull without the capability fails typed and leaves the local store as it was.
    kv = local_store(4, 65536)
    with pytest.raises(CapabilityDenied):
        await client.pull(guarded.address, hashes, kv, namespace=NAMESPACE)
    assert len(kv.store) == 0 and kv.store.free_slots == 4
    # With the capability the same client gets every byte, over the same peer.
    dests = _dests(4)
    got = await client.get_into(guarded.address, hashes, dests, namespace=NAMESPACE,
                                capability=keys.issue(NAMESPACE))
    assert [f.ref.hash for f in got] == hashes
    for i, d in enumerate(dests):
        assert np.array_equal(d, guarded.expected(i))
    seals = await client.pull(guarded.address, hashes[:2], kv, namespace=NAMESPACE,
                              capability=keys.issue(NAMESPACE))
    assert len(seals) == 2 and np.array_equal(kv.store.data(hashes[1]), guarded.expected(1))


@pytest.mark.timeout(60, method="thread")
async def test_pushing_blocks_needs_the_write_capability(guarded: Peer,
                                                         client: TransferClient) -> None:
    keys = Keyring("peer", 1, SECRET)
    mine = local_store(2, 65536)
    refs = block_refs(99, 2)
    await mine.write_blocks(NAMESPACE, refs, [block_payload(99, i, 65536) for i in range(2)])
    hashes = [r.hash for r in refs]
    for cap in (b"", keys.issue(NAMESPACE)):  # none, and a read capability
        with pytest.raises(CapabilityDenied):
            await client.put(guarded.address, hashes, mine, capability=cap)
    with pytest.raises(BlockEvicted):  # nothing landed: the peer holds no such block
        await client.get_into(guarded.address, hashes[:1], _dests(1), namespace=NAMESPACE,
                              capability=keys.issue(NAMESPACE))
    assert await client.put(guarded.address, hashes, mine,
                            capability=keys.issue(NAMESPACE, "put")) == 2
    dests = _dests(2)
    await client.get_into(guarded.address, hashes, dests, namespace=NAMESPACE,
                          capability=keys.issue(NAMESPACE))
    assert np.array_equal(dests[1], block_payload(99, 1, 65536))
