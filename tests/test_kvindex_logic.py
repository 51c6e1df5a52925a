"""kvindex's pure logic: lifecycle rules, visibility, leases, GPU mapping, snapshots,
and property tests over random event sequences (no server needed)."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpd.protocol import wire
from cpd.protocol.hashing import Namespace, block_hashes
from cpd.protocol.lifecycle import BlockState, can_transition
from services.kvindex.index import SNAPSHOT_VERSION, Index, LocKey

NS = "0" * 31 + "1"
NS2 = "0" * 31 + "2"
DRAM, GPU, DISK = wire.Tier.DRAM, wire.Tier.GPU, wire.Tier.DISK


def H(name: str) -> bytes:
    return name.encode().ljust(16, b".")


# A small forest: A0→A1→A2→A3, A1→B2→B3 (a branch), C0→C1.
TREE = {"A0": "", "A1": "A0", "A2": "A1", "A3": "A2", "B2": "A1", "B3": "B2", "C0": "", "C1": "C0"}
CHAINS = [["A0", "A1", "A2", "A3"], ["A0", "A1", "B2", "B3"], ["C0", "C1"]]
NODES = ["n0", "n1", "n2"]


def ref(name: str) -> wire.BlockRef:
    return wire.BlockRef(H(name), H(TREE[name]) if TREE[name] else b"", 16)


class Writer:
    """A well-behaved node: numbers its events like cpd.kvstore.events does."""

    def __init__(self, node: str, epoch: int = 1) -> None:
        self.node, self.epoch, self.seq = node, epoch, 0

    def ev(self, cls: type, **kw: object) -> wire.KvEvent:
        self.seq += 1
        kw.setdefault("namespace", NS)
        return cls(node=self.node, seq=self.seq, epoch=self.epoch, **kw)

    def alloc(self, *names: str, tier: wire.Tier = DRAM) -> wire.KvEvent:
        return self.ev(wire.BlocksAllocated, blocks=[ref(n) for n in names], tier=tier)

    def seal(self, *names: str, tier: wire.Tier = DRAM, nbytes: int = 64,
             checksums: tuple[int, ...] = ()) -> wire.KvEvent:
        sums = checksums or (7,) * len(names)
        return self.ev(wire.BlocksSealed, tier=tier, seals=[
            wire.BlockSeal(H(n), nbytes, c) for n, c in zip(names, sums, strict=True)])

    def evict(self, *names: str) -> wire.KvEvent:
        return self.ev(wire.BlocksEvicted, hashes=[H(n) for n in names])


def hb(node: str, epoch: int = 1, ttl_ms: int = 5000, spec: bytes = b"",
       ns: str = "") -> wire.Heartbeat:
    return wire.Heartbeat(node=node, role="prefill", started_unix_ms=epoch, lease_ttl_ms=ttl_ms,
                          namespace=ns, namespace_spec=spec)


def chain_hashes(*names: str) -> bytes:
    return b"".join(H(n) for n in names)


def test_state_machine() -> None:
    assert can_transition(BlockState.ALLOCATED, BlockState.WRITING)
    assert can_transition(BlockState.ALLOCATED, BlockState.SEALED)
    assert can_transition(BlockState.SEALED, BlockState.VISIBLE)
    assert not can_transition(BlockState.ALLOCATED, BlockState.VISIBLE)
    assert not can_transition(BlockState.EVICTED, BlockState.ALLOCATED)
    assert not can_transition(BlockState.VISIBLE, BlockState.SEALED)


def test_only_sealed_blocks_with_visible_parents_become_visible() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), now=0)
    idx.apply(w.alloc("A0", "A1", "A2"))
    assert idx.lookup(NS, chain_hashes("A0", "A1", "A2"), now=1).num_blocks == 0
    ch = idx.apply(w.seal("A1", "A2"))  # children sealed before their parent
    assert not ch.visible
    ch = idx.apply(w.seal("A0"))
    assert [h for *_, h in ch.visible] == [H("A0"), H("A1"), H("A2")] or \
        sorted(h for *_, h in ch.visible) == sorted([H("A0"), H("A1"), H("A2")])
    r = idx.lookup(NS, chain_hashes("A0", "A1", "A2", "A3"), now=1)
    assert r.status == "ok" and r.num_blocks == 3
    assert r.matches == [wire.TierMatch("n0", DRAM, 3)]


def test_illegal_transitions_are_rejected_and_reported() -> None:
    idx, w = Index(), Writer("n0")
    ch = idx.apply(w.seal("A0"))  # never allocated
    assert ch.illegal and idx.location(NS, H("A0"), "n0", DRAM) is None
    idx.apply(w.alloc("A0"))
    ch = idx.apply(w.alloc("A0"))  # twice
    assert ch.illegal
    ch = idx.apply(w.ev(wire.BlocksWriting, hashes=[H("A1")]))
    assert ch.illegal


def test_dram_blocks_without_bytes_never_become_visible() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), 0)
    idx.apply(w.alloc("A0"))
    idx.apply(w.seal("A0", nbytes=0))
    assert idx.location(NS, H("A0"), "n0", DRAM).state is BlockState.SEALED


def test_eviction_is_prefix_closed_and_invalidates() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), 0)
    idx.apply(w.alloc("A0", "A1", "A2", "A3"))
    idx.apply(w.seal("A0", "A1", "A2", "A3"))
    ch = idx.apply(w.evict("A1"))  # a bad writer evicting an inner block: descendants go too
    assert sorted(h for *_, h in ch.invalidated) == sorted([H("A1"), H("A2"), H("A3")])
    assert idx.lookup(NS, chain_hashes("A0", "A1", "A2"), 1).num_blocks == 1


def test_duplicates_gaps_and_stale_epochs() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), 0)
    e1 = w.alloc("A0")
    idx.apply(e1)
    assert idx.apply(e1).duplicates == 1
    w.seq += 3  # three events lost
    ch = idx.apply(w.seal("A0"))
    assert ch.reannounce == {"n0"}
    assert idx.lookup(NS, chain_hashes("A0"), 1).num_blocks == 1
    # A new epoch: the node restarted with empty caches.
    w2 = Writer("n0", epoch=2)
    ch = idx.apply(w2.alloc("C0"))
    assert [h for *_, h in ch.invalidated] == [H("A0")]
    old = Writer("n0", epoch=1)
    old.seq = 100
    assert idx.apply(old.alloc("C1")).stale == 1


def test_leases_gate_lookups_and_expiry_drops_blocks() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0", ttl_ms=1000), now=0)
    idx.apply(w.alloc("A0"))
    idx.apply(w.seal("A0"))
    assert idx.lookup(NS, chain_hashes("A0"), now=0.5).num_blocks == 1
    assert idx.lookup(NS, chain_hashes("A0"), now=1.5).num_blocks == 0  # lease ran out
    assert idx.expired_leases(now=1.5) == [("n0", 1)]
    idx.mark_expiry_published("n0", 1)
    assert idx.expired_leases(now=1.5) == []
    ch = idx.apply(wire.LeaseExpired(node="n0", seq=0, epoch=1))
    assert [h for *_, h in ch.invalidated] == [H("A0")]
    # The node was only slow: it comes back and is asked to re-announce.
    assert idx.heartbeat(hb("n0", ttl_ms=1000), now=2).reannounce == {"n0"}
    assert idx.heartbeat(hb("n0", ttl_ms=1000), now=2.5).reannounce == set()


def test_lookup_statuses_pending_and_ordering() -> None:
    idx = Index()
    assert idx.lookup(NS, chain_hashes("A0"), 0).status == "unknown_namespace"
    a, b = Writer("n0"), Writer("n1")
    for n in ("n0", "n1"):
        idx.heartbeat(hb(n), 0)
    idx.apply(a.alloc("A0", "A1"))
    idx.apply(a.seal("A0", "A1"))
    idx.apply(b.alloc("A0", "A1", "A2", "A3"))
    idx.apply(b.seal("A0"))
    r = idx.lookup(NS, chain_hashes("A0", "A1", "A2", "A3"), 1)
    assert r.num_blocks == 2
    assert r.matches == [wire.TierMatch("n0", DRAM, 2), wire.TierMatch("n1", DRAM, 1)]
    assert r.pending == [wire.PendingMatch("n1", 4)]
    assert idx.lookup(NS, chain_hashes("A0", "A1"), 1, include_pending=False).pending == []
    assert idx.lookup(NS, chain_hashes("C0"), 1).num_blocks == 0


def test_a_lookup_carries_each_dram_locations_sealed_checksums() -> None:
    """Asked for, each DRAM match lists the checksums its node sealed for the matched
    blocks (copies computed apart may differ: each location has its own), in chain order;
    not asked, none (the lookup stays a binary search per location)."""
    idx = Index()
    a, b = Writer("n0"), Writer("n1")
    for n in ("n0", "n1"):
        idx.heartbeat(hb(n), 0)
    idx.apply(a.alloc("A0", "A1", "A2"))
    idx.apply(a.seal("A0", "A1", "A2", checksums=(11, 12, (1 << 64) - 1)))
    idx.apply(b.alloc("A0", "A1"))
    idx.apply(b.seal("A0", "A1", checksums=(21, 22)))
    hashes = chain_hashes("A0", "A1", "A2", "A3")
    got = {m.node: wire.unpack_checksums(m.checksums)
           for m in idx.lookup(NS, hashes, 1, checksums=True).matches}
    assert got == {"n0": [11, 12, (1 << 64) - 1], "n1": [21, 22]}
    assert all(not m.checksums for m in idx.lookup(NS, hashes, 1).matches)
    # A puller asks about one node only (and gets no capability).
    assert wire.unpack_checksums(idx.checksums(NS, "n1", hashes, 1)) == [21, 22]
    assert wire.unpack_checksums(idx.checksums(NS, "n0", hashes[16:], 1)) == [
        12, (1 << 64) - 1]  # a run that starts past the chain's first block
    assert idx.checksums(NS, "n2", hashes, 1) == b""  # no such copy
    assert idx.checksums(NS, "n0", hashes, 10) == b""  # its lease ran out


def test_a_gpu_visible_prefix_does_not_hide_dram_blocks_still_being_written() -> None:
    idx = Index()
    w = Writer("n1")
    idx.heartbeat(hb("n1"), 0)
    idx.apply(w.alloc("A0", "A1", "A2", tier=GPU))
    idx.apply(w.seal("A0", "A1", "A2", tier=GPU))
    idx.apply(w.alloc("A0", "A1", "A2"))  # the DRAM write-through, not sealed yet
    r = idx.lookup(NS, chain_hashes("A0", "A1", "A2"), 1)
    assert r.matches == [wire.TierMatch("n1", GPU, 3)]
    assert r.pending == [wire.PendingMatch("n1", 3)]
    idx.apply(w.seal("A0", "A1", "A2"))
    r = idx.lookup(NS, chain_hashes("A0", "A1", "A2"), 1)
    assert {(m.tier, m.num_blocks) for m in r.matches} == {(GPU, 3), (DRAM, 3)}
    assert r.pending == []


def test_gpu_events_map_to_cpd_hashes_through_token_ids() -> None:
    spec = Namespace(model_id="m", model_revision="r", tokenizer_hash="t", kv_dtype="float32",
                     block_size=32)
    idx = Index()
    idx.heartbeat(hb("g0", spec=spec.to_spec(), ns=spec.id), 0)
    tokens = list(range(100))
    ours = block_hashes(spec, tokens)  # 3 full CPD blocks of 32 tokens
    w = Writer("g0")
    # vLLM pages of 16 tokens, reported in two batches, the second chained to the first.
    idx.apply(w.ev(wire.GpuBlocksStored, namespace=spec.id, tier=GPU, engine_hashes=[11, 12, 13],
                   parent_engine_hash=None, tokens=wire.pack_tokens(tokens[:48]),
                   engine_block_size=16))
    idx.apply(w.ev(wire.GpuBlocksStored, namespace=spec.id, tier=GPU,
                   engine_hashes=[b"\x0e", 15, 16], parent_engine_hash=13,
                   tokens=wire.pack_tokens(tokens[48:96]), engine_block_size=16))
    r = idx.lookup(spec.id, ours, 1)
    assert r.num_blocks == 3 and r.matches == [wire.TierMatch("g0", GPU, 3)]
    # Removing the page in the middle of CPD block 1 breaks blocks 1 and 2 on the GPU.
    # They were their only copies: the cluster lost them, and a lookup misses them.
    idx.apply(w.ev(wire.GpuBlocksRemoved, namespace=spec.id, tier=GPU, engine_hashes=[b"\x0e"]))
    assert idx.lookup(spec.id, ours, 1).num_blocks == 1
    assert (idx.last_evicted, idx.misses) == (2, 2)
    idx.apply(w.ev(wire.NodeCleared, tier=GPU))  # a restart, not an eviction
    assert idx.lookup(spec.id, ours, 1).num_blocks == 0
    assert (idx.last_evicted, idx.misses) == (2, 2)
    # Unknown chain parents and unregistered namespaces are counted, not guessed.
    ch = idx.apply(w.ev(wire.GpuBlocksStored, namespace=spec.id, tier=GPU, engine_hashes=[99],
                        parent_engine_hash=12345, tokens=wire.pack_tokens(range(16)),
                        engine_block_size=16))
    assert ch.unmapped == 1


def test_a_gpu_block_stored_again_is_the_same_fact_not_an_error() -> None:
    """vLLM reports BlockStored again for the last full block of a prompt its cache
    already holds: kvindex keeps the block visible and logs nothing illegal."""
    spec = Namespace(model_id="m", model_revision="r", tokenizer_hash="t", kv_dtype="float32",
                     block_size=32)
    idx = Index()
    idx.heartbeat(hb("g0", spec=spec.to_spec(), ns=spec.id), 0)
    tokens = list(range(64))
    w = Writer("g0")

    def stored(hashes: list[int], parent: int | None, toks: list[int]) -> wire.KvEvent:
        return w.ev(wire.GpuBlocksStored, namespace=spec.id, tier=GPU, engine_hashes=hashes,
                    parent_engine_hash=parent, tokens=wire.pack_tokens(toks),
                    engine_block_size=32)

    assert idx.apply(stored([1, 2], None, tokens)).illegal == []
    again = idx.apply(stored([2], 1, tokens[32:]))
    assert again.illegal == [] and again.transitions == 0
    assert idx.lookup(spec.id, block_hashes(spec, tokens), 1).num_blocks == 2


def test_gpu_events_carry_their_namespace_so_a_replay_maps_them_without_heartbeats() -> None:
    spec = Namespace(model_id="m", model_revision="r", tokenizer_hash="t", kv_dtype="float32",
                     block_size=32)
    tokens = list(range(64))

    def stored(w: Writer, **spec_field: bytes) -> wire.KvEvent:
        return w.ev(wire.GpuBlocksStored, namespace=spec.id, tier=GPU, engine_hashes=[1, 2],
                    parent_engine_hash=None, tokens=wire.pack_tokens(tokens),
                    engine_block_size=32, **spec_field)

    # A rebuild from the stream applies events before any heartbeat has arrived.
    bare, idx = Index(), Index()
    assert bare.apply(stored(Writer("g0"))).unmapped == 2
    assert idx.apply(stored(Writer("g0"), namespace_spec=spec.to_spec())).unmapped == 0
    for index in (bare, idx):  # then the node's heartbeats resume
        index.heartbeat(hb("g0", spec=spec.to_spec(), ns=spec.id), 0)
    assert bare.lookup(spec.id, block_hashes(spec, tokens), 1).num_blocks == 0  # lost
    assert idx.lookup(spec.id, block_hashes(spec, tokens), 1).num_blocks == 2
    other = Namespace(model_id="x", model_revision="r", tokenizer_hash="t",
                      kv_dtype="float32", block_size=32)
    ch = Index().apply(stored(Writer("g1"), namespace_spec=other.to_spec()))
    assert ch.illegal and ch.unmapped == 2  # a spec that is not the event's namespace


def test_snapshot_restore_round_trip() -> None:
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), 0)
    idx.apply(w.alloc("A0", "A1", "B2"))
    idx.apply(w.seal("A0", "A1"))
    back, seq = Index.restore(idx.snapshot(stream_seq=42))
    assert seq == 42 and back.fingerprint() == idx.fingerprint()
    # Leases are live facts, not restored: no hits until the node's next heartbeat.
    assert back.lookup(NS, chain_hashes("A0", "A1"), 1).num_blocks == 0
    back.heartbeat(hb("n0"), 1)
    assert back.lookup(NS, chain_hashes("A0", "A1"), 1).num_blocks == 2
    # And the restored index keeps applying events exactly like the original.
    e = w.seal("B2")
    assert back.apply(e).visible == idx.apply(e).visible


def _snapshot_of_a0(v: int, key: object) -> bytes:
    """A snapshot (version ``v``) of n0 holding A0 VISIBLE in DRAM, its copy keyed by
    ``key``: ``"n0/dram"`` as version 1 wrote it, ``["n0", "dram"]`` as the current one."""
    return msgspec.msgpack.encode({
        "v": v, "stream_seq": 7,
        "blocks": {NS: {H("A0"): [b"", 16, {key: [int(BlockState.VISIBLE), 1, 64, 7]}, None]}},
        "by_node": {"n0": [[NS, H("A0"), "dram"]]},
        "nodes": [["n0", 1, 2, -1, False, [], {}]], "namespaces": []})


# A snapshot of another version is refused (the service then rebuilds from the stream);
# only the current version, with its copies keyed by [node, tier], is restored.
SNAPSHOTS = [
    ("v1 as written, 'node/tier' keys", _snapshot_of_a0(1, "n0/dram"), ValueError),
    ("v1 header, current body", _snapshot_of_a0(1, ("n0", "dram")), ValueError),
    ("unknown older version", _snapshot_of_a0(0, ("n0", "dram")), ValueError),
    ("unknown newer version", _snapshot_of_a0(SNAPSHOT_VERSION + 1, ("n0", "dram")),
     ValueError),
    ("current version, 'node/tier' keys", _snapshot_of_a0(SNAPSHOT_VERSION, "n0/dram"),
     msgspec.ValidationError),
    ("current version", _snapshot_of_a0(SNAPSHOT_VERSION, ("n0", "dram")), None),
]


@pytest.mark.parametrize(("data", "refused"), [row[1:] for row in SNAPSHOTS],
                         ids=[row[0] for row in SNAPSHOTS])
def test_snapshot_versions(data: bytes, refused: type[Exception] | None) -> None:
    if refused is not None:
        with pytest.raises(refused):
            Index.restore(data)
        return
    idx, seq = Index.restore(data)
    assert seq == 7 and list(idx.blocks[NS][H("A0")].locs) == [LocKey("n0", DRAM)]
    assert idx.location(NS, H("A0"), "n0", DRAM).state is BlockState.VISIBLE
    assert idx.num_locations == 1
    idx.heartbeat(hb("n0"), 0)
    assert idx.lookup(NS, chain_hashes("A0"), 1).matches == [wire.TierMatch("n0", DRAM, 1)]


def test_disk_blocks_are_served_locations_cleared_apart_from_dram() -> None:
    """A node's disk tier is a location of its own: visible once sealed with bytes, with
    the node's capability and checksums (its data plane serves it), and a re-announce of
    one tier clears that tier alone."""
    idx, w = Index(), Writer("n0")
    idx.heartbeat(hb("n0"), 0)
    idx.apply(w.alloc("A0", "A1"))
    idx.apply(w.seal("A0", "A1", checksums=(5, 6)))
    idx.apply(w.alloc("A0", "A1", "A2", tier=DISK))
    idx.apply(w.seal("A0", "A1", tier=DISK, nbytes=0))  # no bytes: never visible
    idx.apply(w.ev(wire.BlocksSealed, tier=DISK, seals=[wire.BlockSeal(H("A2"), 64, 9)],
                   capability=b"cap"))
    idx.apply(w.alloc("C0", tier=DISK))
    idx.apply(w.seal("C0", tier=DISK, checksums=(3,)))
    hashes = chain_hashes("A0", "A1", "A2")
    got = {m.tier: m.num_blocks for m in idx.lookup(NS, hashes, 1).matches}
    assert got == {DRAM: 2}  # A0 and A1 on disk came with no bytes
    idx.apply(w.ev(wire.NodeCleared, tier=DISK))
    idx.apply(w.alloc("A0", "A1", "A2", tier=DISK))
    idx.apply(w.ev(wire.BlocksSealed, tier=DISK, capability=b"cap", seals=[
        wire.BlockSeal(H(n), 64, c) for n, c in (("A0", 5), ("A1", 6), ("A2", 9))]))
    reply = idx.lookup(NS, hashes, 1, checksums=True)
    by_tier = {m.tier: m for m in reply.matches}
    assert (by_tier[DISK].num_blocks, by_tier[DRAM].num_blocks) == (3, 2)
    assert by_tier[DISK].capability == by_tier[DRAM].capability == b"cap"
    assert wire.unpack_checksums(by_tier[DISK].checksums) == [5, 6, 9]
    # A puller's record covers the node's served tiers: A2 is on its disk alone.
    assert wire.unpack_checksums(idx.checksums(NS, "n0", hashes, 1)) == [5, 6, 9]
    assert idx.lookup(NS, chain_hashes("C0"), 1).num_blocks == 0  # cleared with its tier
    idx.apply(w.ev(wire.NodeCleared, tier=DRAM))
    assert [(m.tier, m.num_blocks) for m in idx.lookup(NS, hashes, 1).matches] == [(DISK, 3)]
    assert wire.unpack_checksums(idx.checksums(NS, "n0", hashes, 1)) == [5, 6, 9]


def test_dram_copies_hear_when_they_gain_or_lose_their_other_copies() -> None:
    """A DRAM block's only served copy says nothing (a block never named is the last
    one); a second copy makes both DRAM ones shared; a third changes nothing for the
    first two; losing copies down to one makes that one, if in DRAM, the last again. A
    node's own disk copy counts as a copy elsewhere."""
    idx = Index()
    a, b, c = Writer("n0"), Writer("n1"), Writer("n2")
    for n in ("n0", "n1", "n2"):
        idx.heartbeat(hb(n), 0)

    def copies(ev: wire.KvEvent) -> list[tuple[str, str, bool]]:
        return [(node, h.decode().rstrip("."), shared)
                for _, node, h, shared in idx.apply(ev).copies]

    assert copies(a.alloc("A0")) == [] and copies(a.seal("A0")) == []
    assert copies(b.alloc("A0")) == []
    assert copies(b.seal("A0")) == [("n1", "A0", True), ("n0", "A0", True)]
    copies(c.alloc("A0"))
    assert copies(c.seal("A0")) == [("n2", "A0", True)]
    assert copies(b.evict("A0")) == []
    assert copies(c.evict("A0")) == [("n0", "A0", False)]
    # n0's own disk copy: its DRAM copy is shared; the disk copy hears nothing.
    copies(a.alloc("A0", tier=DISK))
    assert copies(a.seal("A0", tier=DISK)) == [("n0", "A0", True)]
    assert copies(a.evict("A0")) == []  # the DRAM copy left; disk holds the last copy
    # A node's lease expiring counts as its copies leaving.
    copies(b.alloc("C0"))
    copies(b.seal("C0"))
    copies(a.alloc("C0"))
    assert copies(a.seal("C0")) == [("n0", "C0", True), ("n1", "C0", True)]
    assert copies(wire.LeaseExpired(node="n0", seq=0, epoch=1)) == [("n1", "C0", False)]


def test_lost_blocks_are_counted_and_lookups_that_miss_them_too() -> None:
    """A block evicted from its last visible copy, of any tier on any node, is lost
    (``last_evicted``, kept in snapshots); not a copy evicted while another is visible,
    not a block that never became visible, not one its writer failed or a lease expiry
    dropped. A lookup counts the lost blocks right past its match (``misses``, for
    ``BlockCopies``) until a block is written again."""
    idx, a, b = Index(), Writer("n0"), Writer("n1")
    for node in ("n0", "n1"):
        idx.heartbeat(hb(node), 0)

    def lost(ev: wire.KvEvent) -> int:
        before = idx.last_evicted
        idx.apply(ev)
        return idx.last_evicted - before

    for ev in (a.alloc("A0", "A1", "A2"), a.seal("A0", "A1", "A2"), b.alloc("A0"),
               b.seal("A0")):
        lost(ev)
    assert lost(a.evict("A0")) == 2      # A0 stays on n1; A1-A2 (its children) were alone
    assert idx.lookup(NS, chain_hashes("A0", "A1", "A2", "A3"), 1).num_blocks == 1
    assert idx.misses == 2               # A1, A2 lost right past n1's A0; A3 never seen
    assert lost(b.evict("A0")) == 1
    idx.lookup(NS, chain_hashes("C0"), 1)
    assert idx.misses == 2               # not lost: never held
    assert lost(a.alloc("C0")) == 0 and lost(a.evict("C0")) == 0   # never visible
    for ev in (a.alloc("C0"), a.seal("C0")):
        lost(ev)
    assert lost(a.ev(wire.BlocksFailed, hashes=[H("C0")])) == 0
    for ev in (a.alloc("C0"), a.seal("C0"), a.alloc("C0", tier=DISK),
               a.seal("C0", tier=DISK)):
        lost(ev)
    assert lost(a.evict("C0")) == 0      # the DRAM copy left; the disk copy is visible
    assert lost(wire.LeaseExpired(node="n0", seq=0, epoch=1)) == 0
    assert idx.last_evicted == 3
    lost(b.alloc("A0"))                  # A0 is being written again: no longer lost
    idx.lookup(NS, chain_hashes("A0", "A1"), 1)
    assert idx.misses == 2
    back, _ = Index.restore(idx.snapshot(stream_seq=9))
    assert back.last_evicted == 3


def test_locations_are_keyed_by_node_and_tier() -> None:
    """Copies of one block on one node are told apart by tier; the key is never parsed,
    so even a node id with a slash in it keeps its locations apart."""
    idx, w = Index(), Writer("rack/n0")
    idx.apply(w.alloc("A0"))
    idx.apply(w.alloc("A0", tier=GPU))
    ch = idx.apply(w.seal("A0"))
    assert ch.visible == [(NS, "rack/n0", DRAM, H("A0"))]
    assert set(idx.blocks[NS][H("A0")].locs) == {LocKey("rack/n0", DRAM),
                                                   LocKey("rack/n0", GPU)}
    ch = idx.apply(w.alloc("A0"))
    assert ch.illegal == [f"rack/n0/dram: allocate {H('A0').hex()} while VISIBLE"]
    back, _ = Index.restore(idx.snapshot(0))
    assert back.fingerprint() == idx.fingerprint()
    assert back.location(NS, H("A0"), "rack/n0", GPU).state is BlockState.ALLOCATED


# ---------------------------------------------------------------- property tests

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "write", "seal", "seal0", "evict", "fail",
                                          "clear", "restart", "expire"]),
                         st.integers(0, 2), st.sampled_from(list(TREE)),
                         st.sampled_from([DRAM, GPU])),
               max_size=60)


def _writer_events(ops: list, prefix_closed: bool
                   ) -> tuple[list[wire.KvEvent | wire.Heartbeat], dict]:
    """Events of well-behaved writers, and their ground truth per (node, tier). A restart
    is seen as a real one is: the new incarnation's first heartbeat."""
    writers = {n: Writer(n) for n in NODES}
    truth: dict[tuple[str, wire.Tier], dict[str, str]] = {}
    events: list[wire.KvEvent | wire.Heartbeat] = []
    for op, ni, name, tier in ops:
        node = NODES[ni]
        w, t = writers[node], truth.setdefault((node, tier), {})
        if op == "alloc" and name not in t:
            events.append(w.alloc(name, tier=tier))
            t[name] = "alloc"
        elif op == "write" and t.get(name) == "alloc":
            events.append(w.ev(wire.BlocksWriting, hashes=[H(name)], tier=tier))
            t[name] = "writing"
        elif op in ("seal", "seal0") and t.get(name) in ("alloc", "writing"):
            nbytes = 0 if op == "seal0" else 64
            events.append(w.seal(name, tier=tier, nbytes=nbytes))
            t[name] = "sealed" if nbytes or tier is GPU else "sealed-nobytes"
        elif op in ("evict", "fail") and name in t:
            kids = [k for k, p in TREE.items() if p == name and k in t]
            if prefix_closed and kids:
                continue
            cls = wire.BlocksEvicted if op == "evict" else wire.BlocksFailed
            events.append(w.ev(cls, hashes=[H(name)], tier=tier))
            del t[name]
        elif op == "clear":
            events.append(w.ev(wire.NodeCleared, tier=tier))
            t.clear()
        elif op == "restart":
            writers[node] = Writer(node, epoch=w.epoch + 1)
            events.append(hb(node, epoch=w.epoch + 1))
            for tr in (DRAM, GPU):
                truth.setdefault((node, tr), {}).clear()
        elif op == "expire":
            events.append(wire.LeaseExpired(node=node, seq=0, epoch=w.epoch))
            for tr in (DRAM, GPU):
                truth.setdefault((node, tr), {}).clear()
    return events, truth


def _visible_truth(truth: dict) -> set[tuple[str, wire.Tier, str]]:
    out = set()
    for (node, tier), t in truth.items():
        for name in t:
            chain, cur = [], name
            while cur:
                chain.append(cur)
                cur = TREE[cur]
            if all(t.get(c) == "sealed" for c in chain):
                out.add((node, tier, name))
    return out


def _visible_index(idx: Index) -> set[tuple[str, wire.Tier, str]]:
    """VISIBLE locations of each node's live incarnation (what lookups may return)."""
    names = {H(n): n for n in TREE}
    return {(node, tier, names[h]) for ns, h, node, tier, loc in idx.iter_locations()
            if ns == NS and loc.state is BlockState.VISIBLE
            and loc.epoch == idx.nodes[node].live_epoch}


def _deliver(idx: Index, e: wire.KvEvent | wire.Heartbeat) -> None:
    if isinstance(e, wire.Heartbeat):
        idx.heartbeat(e, 0)
    else:
        idx.apply(e)


def _check_structure(idx: Index, now: float) -> None:
    for ns, h, node, tier, loc in idx.iter_locations():
        if loc.state is not BlockState.VISIBLE:
            continue
        if tier is DRAM:
            assert loc.checksum is not None and loc.nbytes > 0
        parent = idx.blocks[ns][h].parent
        if parent:
            ploc = idx.location(ns, parent, node, tier)
            assert ploc is not None and ploc.state is BlockState.VISIBLE, "orphan visible"
    for chain in CHAINS:
        r = idx.lookup(NS, chain_hashes(*chain), now)
        for m in r.matches:
            for name in chain[: m.num_blocks]:
                loc = idx.location(NS, H(name), m.node, m.tier)
                assert loc is not None and loc.state is BlockState.VISIBLE
            assert idx.nodes[m.node].alive(now)


@settings(max_examples=300, deadline=None)
@given(OPS)
# A restart as the last step: only the new incarnation's heartbeat tells kvindex.
@example([("alloc", 2, "A0", DRAM), ("seal", 2, "A0", DRAM), ("restart", 2, "A0", DRAM)])
def test_in_order_delivery_matches_the_specification(ops: list) -> None:
    """With every event delivered (duplicates allowed), VISIBLE is exactly: sealed with
    bytes, every ancestor at that location sealed, in the live incarnation."""
    events, truth = _writer_events(ops, prefix_closed=True)
    idx = Index()
    for n in NODES:
        idx.heartbeat(hb(n, epoch=1), 0)
    rng = random.Random(len(ops))
    for e in events:
        _deliver(idx, e)
        if rng.random() < 0.3:
            _deliver(idx, e)  # redelivery changes nothing
        _check_structure(idx, 0.5)
    assert _visible_index(idx) == _visible_truth(truth)


@settings(max_examples=300, deadline=None)
@given(OPS, st.randoms(use_true_random=False))
def test_chaos_never_breaks_the_invariants(ops: list, rnd: random.Random) -> None:
    """Duplicates, reordering, loss and misbehaving writers: never an unsealed, bytes-less
    or orphaned block visible, never a hit that is not VISIBLE on a live node."""
    events, truth = _writer_events(ops, prefix_closed=False)
    mangled = []
    for e in events:
        r = rnd.random()
        if r < 0.1:
            continue  # lost
        mangled.append(e)
        if r > 0.85:
            mangled.append(e)  # duplicated
    for i in range(len(mangled) - 1):
        if rnd.random() < 0.15:
            mangled[i], mangled[i + 1] = mangled[i + 1], mangled[i]
    idx, replica = Index(), Index()
    for n in NODES:
        idx.heartbeat(hb(n, epoch=1), 0)
    for e in mangled:
        _deliver(idx, e)
        _deliver(replica, e)
        _check_structure(idx, 0.5)
    sealed_somewhere = {(node, tier, n) for (node, tier), t in truth.items()
                        for n, s in t.items() if s == "sealed"}
    # Whatever the index shows visible was really sealed by its writer at some point.
    ever_sealed = {(e.node, e.tier, n) for e in events if isinstance(e, wire.BlocksSealed)
                   for n in TREE for s in e.seals if s.hash == H(n)}
    assert _visible_index(idx) <= ever_sealed | sealed_somewhere
    # Replicas fed the same stream agree; a snapshot restores the same state.
    assert replica.fingerprint() == idx.fingerprint()
    back, _ = Index.restore(idx.snapshot(0))
    assert back.fingerprint() == idx.fingerprint()


@pytest.mark.parametrize("bad", [b"short", b"x" * 17])
def test_malformed_hashes_are_refused(bad: bytes) -> None:
    idx, w = Index(), Writer("n0")
    ch = idx.apply(w.ev(wire.BlocksAllocated, blocks=[wire.BlockRef(bad, b"", 16)]))
    assert ch.illegal and idx.num_blocks == 0
    ch = idx.apply(w.ev(wire.BlocksAllocated, namespace="not-a-namespace",
                        blocks=[ref("A0")]))
    assert ch.illegal and idx.num_blocks == 0
