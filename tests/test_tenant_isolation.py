"""Tenant isolation of the cache (docs/architecture.md, "Block identity"): blocks of different
tenants, cache salts,
model revisions, tokenizers or adapters never match (hypothesis properties over
cpd.hashing and kvindex's pure index), and kvindex carries each node's data-plane
capability from its sealed events to lookup replies, across a restart (snapshot + stream
replay), a re-announce and a node restart (real nats-server with JetStream)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpd.bus import Bus
from cpd.kvstore import BlockStore, KvStore
from cpd.kvstore import events as kvevents
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.capability import Keyring
from cpd.protocol.hashing import Namespace, block_hashes
from services.kvindex import Index, KvIndexService

BS = 4
BASE = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="t0",
                 kv_dtype="float32", block_size=BS)

names = st.text(min_size=0, max_size=8)
token_lists = st.lists(st.integers(0, 2**32 - 1), min_size=BS, max_size=6 * BS)


# ------------------------------------------------------------------ block identity


@settings(max_examples=300, deadline=None)
@given(t1=names, s1=names, t2=names, s2=names, tokens=token_lists)
def test_different_tenants_or_cache_salts_never_share_a_block(
        t1: str, s1: str, t2: str, s2: str, tokens: list[int]) -> None:
    if (t1, s1) == (t2, s2):
        return
    a, b = BASE.with_salt(t1, s1), BASE.with_salt(t2, s2)
    assert a.id != b.id and a.id != BASE.id != b.id
    ha, hb = block_hashes(a, tokens), block_hashes(b, tokens)
    assert not set(wire.split_hashes(ha)) & set(wire.split_hashes(hb))


_variants = st.sampled_from(["model_id", "model_revision", "tokenizer_hash", "kv_dtype",
                             "parallel_layout", "adapter_id", "tenant_salt"])


@settings(max_examples=300, deadline=None)
@given(field=_variants, value=st.text(min_size=1, max_size=12), tokens=token_lists,
       other=token_lists)
def test_other_model_revision_tokenizer_or_adapter_never_matches(
        field: str, value: str, tokens: list[int], other: list[int]) -> None:
    changed = msgspec.structs.replace(BASE, **{field: value})
    if changed == BASE:
        return
    assert changed.id != BASE.id
    # Not even a different prompt in the changed namespace lands on one of our blocks.
    ours = set(wire.split_hashes(block_hashes(BASE, tokens)))
    for toks in (tokens, other):
        assert not ours & set(wire.split_hashes(block_hashes(changed, toks)))


# --------------------------------------------------------- kvindex, pure properties

NODES = ("w0", "w1", "w2")
NAMESPACES = tuple(BASE.with_salt(t).id for t in ("acme", "globex", "initech"))
# One chain of hash bytes shared by every namespace: kvindex must keep them apart by
# namespace even when a (misbehaving) writer reuses the very same hashes.
CHAIN = [bytes([i + 1]) * 16 for i in range(8)]

writes = st.lists(st.tuples(st.integers(0, len(NAMESPACES) - 1),
                            st.integers(0, len(NODES) - 1),
                            st.integers(1, len(CHAIN))), max_size=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes=writes, query=st.integers(0, len(NAMESPACES) - 1))
def test_kvindex_lookups_never_cross_namespaces(writes: list[tuple[int, int, int]],
                                                query: int) -> None:
    idx = Index()
    keys = {n: Keyring(n, 1) for n in NODES}
    seq = dict.fromkeys(NODES, 0)
    for n in NODES:
        idx.heartbeat(wire.Heartbeat(node=n, role="prefill", started_unix_ms=1,
                                     lease_ttl_ms=60_000), now=0.0)
    held: dict[tuple[str, str], int] = {}  # (ns, node) → blocks of CHAIN written there

    def emit(ev: wire.KvEvent) -> None:
        seq[ev.node] += 1
        ev.seq, ev.epoch = seq[ev.node], 1
        idx.apply(ev)

    for ns_i, node_i, length in writes:
        ns, node = NAMESPACES[ns_i], NODES[node_i]
        have = held.get((ns, node), 0)
        if length <= have:
            continue
        new = range(have, length)
        emit(wire.BlocksAllocated(node=node, seq=0, namespace=ns, blocks=[
            wire.BlockRef(CHAIN[i], CHAIN[i - 1] if i else b"", BS) for i in new]))
        emit(wire.BlocksSealed(node=node, seq=0, namespace=ns, capability=keys[node].issue(ns),
                               seals=[wire.BlockSeal(CHAIN[i], 64, 7) for i in new]))
        held[(ns, node)] = length
    ns = NAMESPACES[query]
    reply = idx.lookup(ns, b"".join(CHAIN), now=1.0)
    want = {node: n for (s, node), n in held.items() if s == ns}
    if not want:
        assert reply.num_blocks == 0 and not reply.matches
        return
    assert {m.node: m.num_blocks for m in reply.matches} == want
    assert reply.num_blocks == max(want.values())
    for m in reply.matches:  # the capability of this namespace at that node, never another
        assert keys[m.node].verify(ns, m.capability)
        assert not any(keys[m.node].verify(o, m.capability) for o in NAMESPACES if o != ns)


# ---------------------------------------------- kvindex service: capabilities flow


def _settings(server: NatsServer, tmp: Path) -> Settings:
    return load_settings(environ={}, overrides=[
        f"nats.servers={server.url}", "nats.reconnect_wait_s=0.1", "nats.drain_timeout_s=2",
        "node.node_id=kvi-cap", f"kvindex.snapshot_dir={tmp / 'snap'}",
        "kvindex.lease_sweep_interval_s=0.05"])


async def _heartbeats(bus: Bus, node: str, epoch: int) -> None:
    while True:
        await bus.publish(subjects.heartbeat(node), wire.Heartbeat(
            node=node, role="prefill", started_unix_ms=epoch, lease_ttl_ms=3000))
        await asyncio.sleep(0.05)


async def _lookup(bus: Bus, ns: Namespace, hs: bytes) -> wire.LookupReply:
    return await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
        request_id="q", namespace=ns.id, block_hashes=hs), expect=wire.LookupReply)


async def _until_matches(bus: Bus, ns: Namespace, hs: bytes, want: list[wire.TierMatch],
                         timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    got: object = None
    while time.monotonic() < deadline:
        got = (await _lookup(bus, ns, hs)).matches
        if got == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"lookup gave {got}, wanted {want}")


class _Worker:
    """A worker's block store publishing into CPD_KV, as the real worker does it."""

    def __init__(self, bus: Bus, node: str, epoch: int) -> None:
        self.keys = Keyring(node, epoch)
        self.kv = KvStore(BlockStore(64, 32, node=node, capability=self.keys.issue),
                          kvevents.KvEventPublisher(bus.nc.jetstream(), node, epoch=epoch))
        self.beat = asyncio.create_task(_heartbeats(bus, node, epoch))

    async def write(self, ns: Namespace, tokens: list[int]) -> bytes:
        hs = block_hashes(ns, tokens)
        split = wire.split_hashes(hs)
        refs = [wire.BlockRef(h, split[i - 1] if i else b"", BS) for i, h in enumerate(split)]
        await self.kv.write_blocks(ns.id, refs,
                                   [np.full(64, i, np.uint8) for i in range(len(refs))])
        return hs

    async def stop(self) -> None:
        self.beat.cancel()
        await asyncio.gather(self.beat, return_exceptions=True)


@pytest.fixture
async def bus(fresh_nats: NatsServer, tmp_path: Path) -> AsyncIterator[Bus]:
    s = _settings(fresh_nats, tmp_path)
    b = await Bus.open(s, "tenant-test")
    await kvevents.ensure_stream(b.nc.jetstream())
    yield b
    await b.close()


@pytest.mark.timeout(60)
async def test_capabilities_flow_from_sealed_events_to_lookups_and_survive_restarts(
        fresh_nats: NatsServer, tmp_path: Path, bus: Bus) -> None:
    s = _settings(fresh_nats, tmp_path)
    acme, globex = BASE.with_salt("acme"), BASE.with_salt("globex")
    tokens = list(range(4 * BS))
    w = _Worker(bus, "w0", epoch=11)
    svc = KvIndexService(s)
    await svc.start()
    try:
        ha = await w.write(acme, tokens)
        await _until_matches(bus, acme, ha, [
            wire.TierMatch("w0", wire.Tier.DRAM, 4, w.keys.issue(acme.id))])
    finally:
        await svc.stop()  # writes its snapshot
    assert svc.snapshot_path.exists()
    # While kvindex is down, the same prompt is cached for another tenant: only the
    # stream tail (replayed after the snapshot) knows it.
    hg = await w.write(globex, tokens)
    assert not set(wire.split_hashes(ha)) & set(wire.split_hashes(hg))
    svc = KvIndexService(s)
    await svc.start()
    try:
        await _until_matches(bus, acme, ha, [
            wire.TierMatch("w0", wire.Tier.DRAM, 4, w.keys.issue(acme.id))])
        await _until_matches(bus, globex, hg, [
            wire.TierMatch("w0", wire.Tier.DRAM, 4, w.keys.issue(globex.id))])
        # Each namespace's lookup sees its own blocks only, with its own capability.
        assert (await _lookup(bus, acme, hg)).num_blocks == 0
        assert w.keys.issue(acme.id) != w.keys.issue(globex.id)
        # A re-announce (NodeCleared, then every block) brings the capabilities again.
        await w.kv.reannounce()
        await _until_matches(bus, acme, ha, [
            wire.TierMatch("w0", wire.Tier.DRAM, 4, w.keys.issue(acme.id))])
        # The node restarts: a new epoch and secret; the old capability is gone with
        # the old blocks, and the new incarnation's comes with its new blocks.
        await w.stop()
        w2 = _Worker(bus, "w0", epoch=12)
        await _until_matches(bus, acme, ha, [])  # new epoch's heartbeat: old blocks gone
        await w2.write(acme, tokens)
        new_cap = w2.keys.issue(acme.id)
        await _until_matches(bus, acme, ha, [wire.TierMatch("w0", wire.Tier.DRAM, 4, new_cap)])
        assert new_cap != w.keys.issue(acme.id)
        assert not w2.keys.verify(acme.id, w.keys.issue(acme.id))
        await w2.stop()
    finally:
        await svc.stop()
