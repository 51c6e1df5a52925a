"""kvindex against a real nats-server with JetStream: events in, lookups out, leases,
dead letters, re-announce requests, replicas, and kill -9 recovery."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.js import api

from cpd.bus import Bus
from cpd.kvstore import events as kvevents
from cpd.ops.config import Settings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import subjects, wire
from cpd.protocol.errors import InvalidRequest
from cpd.protocol.hashing import Namespace, block_hashes
from services.kvindex import Index, KvIndexService

pytestmark = pytest.mark.timeout(90)

NS = Namespace(model_id="cpd-tiny", model_revision="r1", tokenizer_hash="t",
               kv_dtype="float32", block_size=4)


def _settings(server: NatsServer, tmp: Path, node: str, **extra: str) -> Settings:
    overrides = [f"nats.servers={server.url}", "nats.reconnect_wait_s=0.1",
                 "nats.drain_timeout_s=2", f"node.node_id={node}",
                 f"kvindex.snapshot_dir={tmp / 'snap'}", "kvindex.lease_sweep_interval_s=0.05"]
    return load_settings(environ={}, overrides=overrides + [f"{k}={v}" for k, v in
                                                            extra.items()])


def _chain(n_blocks: int, seed: int = 0) -> tuple[bytes, list[wire.BlockRef]]:
    tokens = [(seed * 1000 + i) % 50_000 for i in range(n_blocks * NS.block_size)]
    hs = block_hashes(NS, tokens)
    refs = [wire.BlockRef(hs[i * 16:(i + 1) * 16], hs[(i - 1) * 16:i * 16] if i else b"",
                          NS.block_size) for i in range(n_blocks)]
    return hs, refs


async def _write(pub: kvevents.KvEventPublisher, refs: list[wire.BlockRef]) -> None:
    await pub.allocated(NS.id, refs)
    await pub.sealed(NS.id, [wire.BlockSeal(r.hash, 4096, 1234) for r in refs])


class Heartbeats:
    """Keeps a node's lease alive, as a worker would."""

    def __init__(self, bus: Bus, node: str, epoch: int, ttl_ms: int = 2000) -> None:
        self.bus, self.node, self.epoch, self.ttl = bus, node, epoch, ttl_ms
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.bus.publish(subjects.heartbeat(self.node), wire.Heartbeat(
                node=self.node, role="prefill", started_unix_ms=self.epoch,
                lease_ttl_ms=self.ttl, namespace=NS.id, namespace_spec=NS.to_spec()))
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def env(fresh_nats: NatsServer, tmp_path: Path) -> AsyncIterator[tuple]:
    s = _settings(fresh_nats, tmp_path, "kvi-0")
    svc = KvIndexService(s)
    await svc.start()
    bus = await Bus.open(s, "kvindex-test")
    js = bus.nc.jetstream()
    yield svc, bus, js
    await bus.close()
    await svc.stop()


async def _lookup(bus: Bus, hs: bytes, ns: str = NS.id) -> wire.LookupReply:
    return await bus.request(subjects.KVINDEX_LOOKUP,
                             wire.LookupRequest(request_id="q", namespace=ns, block_hashes=hs),
                             expect=wire.LookupReply)


async def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_events_make_blocks_visible_and_lookups_find_them(env: tuple) -> None:
    _, bus, js = env
    visible = await bus.nc.subscribe(subjects.KV_VISIBLE)
    hb = Heartbeats(bus, "w0", epoch=7)
    pub = kvevents.KvEventPublisher(js, "w0", epoch=7)
    hs, refs = _chain(10)
    await pub.allocated(NS.id, refs)
    await pub.writing(NS.id, [r.hash for r in refs])
    await pub.sealed(NS.id, [wire.BlockSeal(r.hash, 4096, 99) for r in refs[:6]])

    async def six() -> bool:
        return (await _lookup(bus, hs)).num_blocks == 6
    await _until(six)
    r = await _lookup(bus, hs)
    assert r.matches == [wire.TierMatch("w0", wire.Tier.DRAM, 6)]
    assert r.pending == [wire.PendingMatch("w0", 10)]
    note = wire.decode((await visible.next_msg(timeout=5)).data, wire.BlocksVisible)
    assert note.node == "w0" and note.block_hashes == hs[: 6 * 16]
    # A different tenant's namespace never matches these blocks.
    other = NS.with_salt("tenant-b")
    assert (await _lookup(bus, block_hashes(other, list(range(40))), other.id)).status == \
        "unknown_namespace"
    await hb.stop()


async def test_lookup_bad_input_gets_typed_errors(env: tuple) -> None:
    _, bus, _ = env
    with pytest.raises(InvalidRequest):
        await _lookup(bus, b"\x00" * 16, ns="not-a-namespace")
    with pytest.raises(InvalidRequest):
        await _lookup(bus, b"\x00" * 17)
    with pytest.raises(InvalidRequest):
        await _lookup(bus, b"\x00" * 16 * 9000)
    assert (await _lookup(bus, b"\x00" * 16)).status == "unknown_namespace"


async def test_lease_expiry_invalidates_and_is_durable(env: tuple) -> None:
    svc, bus, js = env
    inval = await bus.nc.subscribe(subjects.KV_INVALIDATE)
    hb = Heartbeats(bus, "w1", epoch=3, ttl_ms=300)
    pub = kvevents.KvEventPublisher(js, "w1", epoch=3)
    hs, refs = _chain(4, seed=1)
    await _write(pub, refs)

    async def hit() -> bool:
        return (await _lookup(bus, hs)).num_blocks == 4
    await _until(hit)
    await hb.stop()  # the worker goes silent

    async def miss() -> bool:
        return (await _lookup(bus, hs)).num_blocks == 0
    await _until(miss, timeout=5)
    got = wire.decode((await inval.next_msg(timeout=5)).data, wire.BlocksInvalidated)
    assert got.node == "w1"
    # The expiry went into the stream, so replays and replicas forget the node too.
    sub = await js.subscribe(subjects.kv_events(subjects.KVINDEX_EVENTS_NODE),
                             ordered_consumer=True)
    ev = wire.decode((await sub.next_msg(timeout=5)).data, wire.LeaseExpired)
    assert (ev.node, ev.epoch) == ("w1", 3)

    async def gone() -> bool:
        return svc.index.location(NS.id, refs[0].hash, "w1", wire.Tier.DRAM) is None
    await _until(gone)
    # When the node comes back it is asked to re-announce its blocks.
    ask = await bus.nc.subscribe(subjects.kv_reannounce("w1"))
    hb2 = Heartbeats(bus, "w1", epoch=3, ttl_ms=300)
    wire.decode((await ask.next_msg(timeout=5)).data, wire.Reannounce)
    await hb2.stop()


async def test_lookups_say_how_far_behind_the_event_stream_the_index_is(env: tuple) -> None:
    """Events that land faster than kvindex applies them (here: its first one held at
    publishing what it changed): lookups answered meanwhile carry the backlog
    (``lag_events``), none once applied."""
    svc, bus, js = env
    held, release = asyncio.Event(), asyncio.Event()
    publish = svc._publish

    async def slow_publish(ch: object) -> None:
        held.set()
        await release.wait()
        await publish(ch)
    svc._publish = slow_publish
    chains = [_chain(64, seed=100 + i) for i in range(100)]
    await asyncio.gather(*(kvevents.KvEventPublisher(js, f"lag{i}", epoch=3)
                           .allocated(NS.id, refs) for i, (_, refs) in enumerate(chains)))
    await asyncio.wait_for(held.wait(), 5)

    async def behind() -> bool:
        return (await _lookup(bus, chains[0][0])).lag_events >= 10
    await _until(behind)
    release.set()

    async def caught_up() -> bool:
        return (await _lookup(bus, chains[-1][0])).lag_events == 0
    await _until(caught_up)
    last = (await js.stream_info(subjects.KV_STREAM)).state.last_seq
    assert svc.applied_seq == last


async def test_a_recreated_stream_is_replayed_and_every_node_asked_to_reannounce(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """CPD_KV deleted and created again under a running kvindex (its events start again
    at 1): the index forgets what the lost events built, asks every node to re-announce,
    and applies the new stream's events."""
    s = _settings(fresh_nats, tmp_path, "kvi-s", **{"kvindex.stream_check_interval_s": "0.2"})
    svc = KvIndexService(s)
    await svc.start()
    bus = await Bus.open(s, "reset-test")
    js = bus.nc.jetstream()
    hb = Heartbeats(bus, "w7", epoch=5)
    try:
        old, refs = _chain(8, seed=70)
        await _write(kvevents.KvEventPublisher(js, "w7", epoch=5), refs)
        await _until(lambda: _holds(bus, old, 8))
        asks = await bus.nc.subscribe(subjects.kv_reannounce("w7"))
        await js.delete_stream(subjects.KV_STREAM)
        await kvevents.ensure_stream(js)
        wire.decode((await asks.next_msg(timeout=10)).data, wire.Reannounce)
        assert (await _lookup(bus, old)).num_blocks == 0  # what the lost events built
        # The node's events from now on (its re-announcement) reach the index.
        new, refs = _chain(4, seed=71)
        await _write(kvevents.KvEventPublisher(js, "w7", epoch=5), refs)
        await _until(lambda: _holds(bus, new, 4))
        last = (await js.stream_info(subjects.KV_STREAM)).state.last_seq
        assert svc.applied_seq == last and svc.stream_resets == 1
    finally:
        await hb.stop()
        await bus.close()
        await svc.stop()


async def test_a_stream_that_grows_while_it_is_checked_is_not_taken_as_reset(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """Events go on arriving while the stream's state is asked for: kvindex may have
    applied past the last sequence the answer gives, which is not a younger stream."""
    s = _settings(fresh_nats, tmp_path, "kvi-g", **{"kvindex.stream_check_interval_s": "0.01"})
    svc = KvIndexService(s)
    await svc.start()
    bus = await Bus.open(s, "grow-test")
    js = bus.nc.jetstream()
    try:
        pubs = [kvevents.KvEventPublisher(js, f"grow{i}", epoch=1) for i in range(12)]
        for round_ in range(20):  # ~1 s of events, each node a chain of its own per round
            await asyncio.gather(*(p.allocated(NS.id, _chain(64, seed=12 * round_ + i)[1])
                                   for i, p in enumerate(pubs)))
        last = (await js.stream_info(subjects.KV_STREAM)).state.last_seq

        async def caught_up() -> bool:
            return svc.applied_seq == last
        await _until(caught_up)
        assert svc.stream_resets == 0
    finally:
        await bus.close()
        await svc.stop()


async def test_a_snapshot_newer_than_the_stream_is_dropped_at_start(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """The stream was recreated while kvindex was down: its snapshot describes events
    the stream no longer has, so it starts from the new stream alone and asks every
    node to re-announce."""
    s = _settings(fresh_nats, tmp_path, "kvi-t")
    bus = await Bus.open(s, "reset-start-test")
    js = bus.nc.jetstream()
    hb = Heartbeats(bus, "w8", epoch=2)
    svc = KvIndexService(s)
    await svc.start()
    try:
        old, refs = _chain(8, seed=80)
        pub = kvevents.KvEventPublisher(js, "w8", epoch=2)
        for i in range(8):  # more events than the new stream will hold
            await _write(pub, refs[i:i + 1])
        await _until(lambda: _holds(bus, old, 8))
        await svc.stop()  # writes its snapshot
        await js.delete_stream(subjects.KV_STREAM)
        await kvevents.ensure_stream(js)
        new, refs = _chain(2, seed=81)
        await _write(kvevents.KvEventPublisher(js, "w8", epoch=2), refs)
        asks = await bus.nc.subscribe(subjects.kv_reannounce("w8"))
        svc = KvIndexService(s)
        await svc.start()
        wire.decode((await asks.next_msg(timeout=10)).data, wire.Reannounce)
        await _until(lambda: _holds(bus, new, 2))
        assert (await _lookup(bus, old)).num_blocks == 0
    finally:
        await hb.stop()
        await bus.close()
        await svc.stop()


async def _holds(bus: Bus, hs: bytes, n: int) -> bool:
    return (await _lookup(bus, hs)).num_blocks == n


async def test_sequence_gap_asks_for_reannounce(env: tuple) -> None:
    _, bus, js = env
    ask = await bus.nc.subscribe(subjects.kv_reannounce("w2"))
    pub = kvevents.KvEventPublisher(js, "w2", epoch=1)
    _, refs = _chain(2, seed=2)
    await pub.allocated(NS.id, refs[:1])
    pub.seq += 5  # five events lost on the way
    await pub.allocated(NS.id, refs[1:])
    assert wire.decode((await ask.next_msg(timeout=5)).data, wire.Reannounce)


async def test_malformed_events_are_dead_lettered_and_the_service_goes_on(env: tuple) -> None:
    svc, bus, js = env
    dead = await bus.nc.subscribe(subjects.KV_DEADLETTER)
    hb = Heartbeats(bus, "w3", epoch=1)
    await js.publish(subjects.kv_events("w3"), b"\xc1not msgpack")
    await js.publish(subjects.kv_events("w3"), msgspec.msgpack.encode({"kind": "nope", "v": 1}))
    got = await dead.next_msg(timeout=5)
    assert got.data == b"\xc1not msgpack" and got.headers["Cpd-Error"] == "malformed"
    assert (await dead.next_msg(timeout=5)).headers["Cpd-Error"] == "unknown_kind"
    pub = kvevents.KvEventPublisher(js, "w3", epoch=1)
    hs, refs = _chain(3, seed=3)
    await _write(pub, refs)

    async def hit() -> bool:
        return (await _lookup(bus, hs)).num_blocks == 3
    await _until(hit)
    assert svc.dead_letters == 2
    await hb.stop()


async def test_two_replicas_agree(fresh_nats: NatsServer, tmp_path: Path) -> None:
    a = KvIndexService(_settings(fresh_nats, tmp_path, "kvi-a"))
    b = KvIndexService(_settings(fresh_nats, tmp_path, "kvi-b"))
    await a.start()
    await b.start()
    bus = await Bus.open(a.settings, "replica-test")
    try:
        js = bus.nc.jetstream()
        hb = Heartbeats(bus, "w4", epoch=1)
        pub = kvevents.KvEventPublisher(js, "w4", epoch=1)
        chains = [_chain(8, seed=s) for s in range(5)]
        for _, refs in chains:
            await _write(pub, refs)
        await pub.evicted(NS.id, [chains[0][1][5].hash])

        async def same() -> bool:
            return (a.applied_seq == b.applied_seq == pub.seq
                    and a.index.fingerprint() == b.index.fingerprint())
        await _until(same)
        for hs, _ in chains:  # whichever replica answers, the answer is the same
            answers = {(await _lookup(bus, hs)).num_blocks for _ in range(6)}
            assert len(answers) == 1
        assert (await _lookup(bus, chains[0][0])).num_blocks == 5
        await hb.stop()
    finally:
        await bus.close()
        await a.stop()
        await b.stop()


async def test_recovering_until_the_stream_is_replayed(fresh_nats: NatsServer,
                                                      tmp_path: Path) -> None:
    s = _settings(fresh_nats, tmp_path, "kvi-r")
    bus = await Bus.open(s, "recovery-test")
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    pub = kvevents.KvEventPublisher(js, "w5", epoch=1)
    # Big events (2,048 blocks each) make the replay take long enough to be observed.
    chains = [_chain(2048, seed=s) for s in range(60)]
    for _, refs in chains:
        await _write(pub, refs)
    hb = Heartbeats(bus, "w5", epoch=1)
    svc = KvIndexService(s)
    await svc.start()
    try:
        first = await _lookup(bus, chains[0][0])
        assert first.status == "recovering" and first.num_blocks == 0
        await asyncio.wait_for(svc.ready.wait(), 30)
        assert (await _lookup(bus, chains[-1][0])).num_blocks == 2048
    finally:
        await hb.stop()
        await bus.close()
        await svc.stop()


async def test_a_snapshot_of_another_version_is_rebuilt_from_the_stream(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    """A version-1 snapshot ("node/tier" keys) claiming the whole stream is refused: the
    replica replays the stream from its start instead."""
    s = _settings(fresh_nats, tmp_path, "kvi-v")
    bus = await Bus.open(s, "snapshot-version-test")
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    pub = kvevents.KvEventPublisher(js, "w6", epoch=1)
    hs, refs = _chain(8, seed=6)
    await _write(pub, refs)
    hb = Heartbeats(bus, "w6", epoch=1)
    svc = KvIndexService(s)
    svc.snapshot_path.parent.mkdir(parents=True)
    svc.snapshot_path.write_bytes(msgspec.msgpack.encode({
        "v": 1, "stream_seq": pub.seq,
        "blocks": {NS.id: {refs[0].hash: [b"", NS.block_size, {"w6/dram": [4, 1, 64, 7]},
                                          None]}},
        "by_node": {"w6": [[NS.id, refs[0].hash, "dram"]]},
        "nodes": [["w6", 1, pub.seq, -1, False, [], {}]], "namespaces": []}))
    await svc.start()
    try:
        await asyncio.wait_for(svc.ready.wait(), 30)
        assert svc.applied_seq == pub.seq

        async def whole_chain() -> bool:
            return (await _lookup(bus, hs)).num_blocks == 8
        await _until(whole_chain)
    finally:
        await hb.stop()
        await bus.close()
        await svc.stop()


def _spawn(s: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CPD_NATS__SERVERS": ",".join(s.nats.servers),
           "CPD_NODE__NODE_ID": s.node.node_id,
           "CPD_KVINDEX__SNAPSHOT_DIR": s.kvindex.snapshot_dir,
           "CPD_KVINDEX__SNAPSHOT_INTERVAL_S": "0.3"}
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "services.kvindex"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def _reference(js, upto: int) -> Index:
    """The state rebuilt from scratch from the stream, as kvindex should hold it."""
    idx = Index()
    sub = await js.subscribe(subjects.KV_EVENTS_ALL, ordered_consumer=True,
                             deliver_policy=api.DeliverPolicy.ALL)
    seq = 0
    while seq < upto:
        msg = await sub.next_msg(timeout=5)
        seq = msg.metadata.sequence.stream
        idx.apply(wire.decode(msg.data, wire.KvEvent))
    await sub.unsubscribe()
    return idx


@pytest.mark.timeout(120)
async def test_kill_9_mid_stream_then_restart_gives_the_same_answers(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    s = _settings(fresh_nats, tmp_path, "kvi-k")
    bus = await Bus.open(s, "kill-test")
    js = bus.nc.jetstream()
    await kvevents.ensure_stream(js)
    hb = Heartbeats(bus, "w6", epoch=1)
    pub = kvevents.KvEventPublisher(js, "w6", epoch=1)
    chains = [_chain(6, seed=s) for s in range(300)]
    proc = _spawn(s, tmp_path / "kvindex.log")
    try:
        async def up() -> bool:
            try:
                return (await _lookup(bus, chains[0][0])).status == "unknown_namespace"
            except Exception:
                return False
        await _until(up, timeout=30)
        for i, (_, refs) in enumerate(chains):
            await _write(pub, refs)
            if i % 20 == 0:
                await pub.evicted(NS.id, [refs[-1].hash])
            if i == 150:
                await asyncio.sleep(0.5)  # let a snapshot land mid-stream
                proc.send_signal(signal.SIGKILL)
                proc.wait(5)
        proc = _spawn(s, tmp_path / "kvindex.log")  # snapshot + stream tail

        async def caught_up() -> bool:
            try:
                r = await _lookup(bus, chains[-1][0])
            except Exception:
                return False
            return r.status == "ok" and r.num_blocks == 6
        await _until(caught_up, timeout=60)
        assert (tmp_path / "snap" / "kvindex-kvi-k.snap").exists()
        ref = await _reference(js, (await js.stream_info(subjects.KV_STREAM)).state.last_seq)
        ref.heartbeat(wire.Heartbeat(node="w6", role="prefill", started_unix_ms=1,
                                     lease_ttl_ms=60_000), time.monotonic())
        for hs, _ in chains:
            got, want = await _lookup(bus, hs), ref.lookup(NS.id, hs, time.monotonic())
            assert (got.num_blocks, got.matches) == (want.num_blocks, want.matches)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        await hb.stop()
        await bus.close()
    assert proc.returncode == 0, (tmp_path / "kvindex.log").read_text()[-3000:]


@pytest.mark.timeout(60)
async def test_sigterm_with_nats_gone_still_exits(fresh_nats: NatsServer, tmp_path: Path) -> None:
    """A service whose NATS server vanished must still stop on SIGTERM (a client left
    reconnecting forever would keep the process alive)."""
    s = _settings(fresh_nats, tmp_path, "kvi-t")
    proc = _spawn(s, tmp_path / "kvindex.log")
    bus = await Bus.open(s, "sigterm-test")
    try:
        async def up() -> bool:
            try:
                return (await _lookup(bus, b"\x00" * 16)).status == "unknown_namespace"
            except Exception:
                return False
        await _until(up, timeout=30)
    finally:
        await bus.close()
    fresh_nats.kill()
    await asyncio.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(25)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("kvindex did not exit after SIGTERM with NATS gone")


async def test_events_and_heartbeats_naming_another_node_are_refused(env: tuple) -> None:
    """A node may only speak for itself: a block event or heartbeat naming another node
    than the one whose subject it came on (each node's credentials cover only its own
    subjects) is refused and counted, and changes nothing the index shows."""
    svc, bus, js = env
    hb = Heartbeats(bus, "w5", epoch=5)
    # Other epochs than w5's own below: JetStream drops a repeated message id.
    forger = kvevents.KvEventPublisher(js, "w5", epoch=50)
    forger.subject = subjects.kv_events("w6")  # w6's credentials, w5's name
    hs, refs = _chain(4, seed=5)
    before = svc.rejected
    await _write(forger, refs)
    # A heartbeat for w7 on w6's subject: no lease for w7.
    await bus.publish(subjects.heartbeat("w6"), wire.Heartbeat(
        node="w7", role="prefill", started_unix_ms=1, lease_ttl_ms=2000, namespace=NS.id,
        namespace_spec=NS.to_spec()))

    async def rejected(n: int) -> bool:
        return svc.rejected >= before + n
    await _until(lambda: rejected(3))  # allocated, sealed, heartbeat
    assert (await _lookup(bus, hs)).num_blocks == 0
    assert "w7" not in svc.index.nodes
    # Only kvindex's own lease expiries may come on its pseudo node's subject.
    kvi = kvevents.KvEventPublisher(js, "w5", epoch=60)
    kvi.subject = subjects.kv_events(subjects.KVINDEX_EVENTS_NODE)
    await _write(kvi, refs)
    await _until(lambda: rejected(5))
    assert (await _lookup(bus, hs)).num_blocks == 0
    # The same events on w5's own subject are taken.
    await _write(kvevents.KvEventPublisher(js, "w5", epoch=5), refs)

    async def taken() -> bool:
        return (await _lookup(bus, hs)).num_blocks == 4
    await _until(taken)
    await hb.stop()


async def test_each_node_hears_which_of_its_blocks_have_copies_elsewhere(env: tuple) -> None:
    """A second node's copy makes both copies shared; when it leaves, the first node
    hears its copy is the last one (``cpd.v1.kv.copies.<node>``). When the first evicts
    its copies too they are lost, and a lookup that asks for them counts in the next
    notices (``misses``, from this replica)."""
    _, bus, js = env
    hs, refs = _chain(3, seed=7)
    subs = {n: await bus.nc.subscribe(subjects.kv_copies(n)) for n in ("c0", "c1")}
    beats = [Heartbeats(bus, n, epoch=3) for n in ("c0", "c1")]
    pubs = {n: kvevents.KvEventPublisher(js, n, epoch=3) for n in ("c0", "c1")}
    await _write(pubs["c0"], refs)
    await _write(pubs["c1"], refs)
    for n in ("c0", "c1"):
        note = wire.decode((await subs[n].next_msg(timeout=5)).data, wire.BlockCopies)
        assert (note.namespace, note.shared, note.last) == (NS.id, hs, b"")
    await pubs["c1"].evicted(NS.id, [r.hash for r in reversed(refs)])
    note = wire.decode((await subs["c0"].next_msg(timeout=5)).data, wire.BlockCopies)
    assert (note.shared, set(wire.split_hashes(note.last))) == (b"", set(wire.split_hashes(hs)))
    before = note.misses
    await pubs["c0"].evicted(NS.id, [r.hash for r in reversed(refs)])

    async def asked() -> bool:  # the first lookup after kvindex applied the eviction
        return (await _lookup(bus, hs)).num_blocks == 0
    await _until(asked)
    hs2, refs2 = _chain(2, seed=8)
    await _write(pubs["c0"], refs2)
    await _write(pubs["c1"], refs2)
    note = wire.decode((await subs["c0"].next_msg(timeout=5)).data, wire.BlockCopies)
    assert note.shared == hs2 and note.kvindex
    assert note.misses == before + len(refs)
    for b in beats:
        await b.stop()
