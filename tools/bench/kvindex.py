"""``cpd bench kvindex``: lookup throughput and latency, ingest rate, recovery time.

Index: ``blocks`` blocks (1M; 100K with ``--quick``) as chains of 391 blocks (a
100K-token prompt at 256 tokens per block) spread over 4 nodes. Measured in one run:

* in-process: event apply rate (one lifecycle transition of one block = one event) and
  lookup cost;
* end to end on an embedded NATS: a kvindex process recovering the whole index from a
  snapshot plus a stream tail, then lookups from this process over NATS loopback:
  closed-loop throughput and open-loop latency at a fixed offered rate.

Open-loop latency is reported twice. ``lookup_p50_ms``/``lookup_p99_ms`` run from the
moment a lookup is handed to NATS to its reply: what kvindex and NATS cost a caller.
``lookup_p99_from_schedule_ms`` runs from the moment the schedule said to send it, so it
adds the generator's own lag (``send_lag_p99_ms``, about 1.3 ms at p99 at any rate from
500/s up: the event loop's timers have millisecond granularity). A thread keeping the
schedule instead cut that lag to 0.1 ms but, waking the loop once per lookup, raised the
CPU per lookup of all three processes by a third and the p99 with it.
``cpu_us_per_lookup`` is each process's CPU time over the open-loop run divided by the
lookups sent.

The open loop alternates 1 s rounds between kvindex and ``bench.echo``, a bare nats-py
responder that sends kvindex's own reply bytes back without decoding anything. Its
``floor_p50_ms``/``floor_p99_ms`` are what NATS, nats-py and this host cost a lookup
with no service behind the subject; ``lookup_p99_over_floor`` is kvindex's share.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from cpd.bus import Bus
from cpd.kvstore import events as kvevents
from cpd.ops.config import load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import Namespace
from services.kvindex.index import Index
from tools.bench.proccpu import cpu_seconds_all, cpu_used_since
from tools.bench.registry import SettingsFactory
from tools.cluster import Cluster, ClusterSpec, NodeSpec, stop_tree

CHAIN = 391
NODES = ("w0", "w1", "w2", "w3")
INGEST_NODES = ("i0", "i1", "i2", "i3")  # fresh writers for the end-to-end ingest run
KVINDEX_NODE = "bench-kvi"
# Generous: a 1M-block recovery on a busy two-core host takes well under a minute.
RECOVERY_TIMEOUT_S = 300.0
RECOVERY_POLL_S = 0.02
STOP_TIMEOUT_S = 30.0
NS = Namespace(model_id="bench", model_revision="r1", tokenizer_hash="t", kv_dtype="float32",
               block_size=256)


def _chains(n_blocks: int) -> list[list[bytes]]:
    rng = np.random.default_rng(7)
    raw = rng.bytes(n_blocks * 16)
    return [[raw[(c * CHAIN + i) * 16:(c * CHAIN + i + 1) * 16] for i in range(CHAIN)]
            for c in range(n_blocks // CHAIN)]


def _events(chains: list[list[bytes]], nodes: tuple[str, ...] = NODES) -> list[wire.KvEvent]:
    out: list[wire.KvEvent] = []
    seqs = dict.fromkeys(nodes, 0)
    for c, chain in enumerate(chains):
        node = nodes[c % len(nodes)]
        refs = [wire.BlockRef(h, chain[i - 1] if i else b"", 256) for i, h in enumerate(chain)]
        for ev in (wire.BlocksAllocated(node=node, seq=0, namespace=NS.id, blocks=refs),
                   wire.BlocksSealed(node=node, seq=0, namespace=NS.id,
                                     seals=[wire.BlockSeal(h, 1 << 20, 1) for h in chain])):
            seqs[node] += 1
            ev.seq, ev.epoch = seqs[node], 1
            out.append(ev)
    return out


def _heartbeat(node: str) -> wire.Heartbeat:
    return wire.Heartbeat(node=node, role="prefill", started_unix_ms=1, lease_ttl_ms=600_000)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(quick: bool = False, blocks: int | None = None, offered_rate: int = 5000,
        seconds: float | None = None) -> dict:
    """Run the benchmark; returns the JSON-able result."""
    n_blocks = blocks or (100_000 if quick else 1_000_000)
    seconds = seconds or (2.0 if quick else 5.0)
    chains = _chains(n_blocks)
    events = _events(chains)
    # -- in-process ingest and lookup
    idx = Index()
    t0 = time.perf_counter()
    for ev in events:
        idx.apply(ev)
    apply_s = time.perf_counter() - t0
    transitions = 2 * len(chains) * CHAIN
    now = time.monotonic()
    for node in NODES:
        idx.heartbeat(_heartbeat(node), now)
    queries = [b"".join(ch) for ch in chains[: min(200, len(chains))]]
    misses = [b"".join(ch[:100]) + os.urandom(16 * (CHAIN - 100)) for ch in chains[:50]]
    t0 = time.perf_counter()
    reps = 0
    while time.perf_counter() - t0 < 1.0:
        for q in queries:
            idx.lookup(NS.id, q, now)
        reps += len(queries)
    inproc_us = (time.perf_counter() - t0) / reps * 1e6
    assert all(idx.lookup(NS.id, q, now).num_blocks == CHAIN for q in queries[:5])
    assert all(idx.lookup(NS.id, q, now).num_blocks == 100 for q in misses[:5])
    t0 = time.perf_counter()
    snap = idx.snapshot(stream_seq=0)
    snapshot_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    Index.restore(snap)
    restore_s = time.perf_counter() - t0
    result = {
        "blocks": idx.num_blocks,
        "chain_blocks": CHAIN,
        "ingest_events_per_s": round(transitions / apply_s),
        "ingest_messages_per_s": round(len(events) / apply_s),
        "inproc_lookup_us": round(inproc_us, 1),
        "snapshot_write_s": round(snapshot_s, 2),
        "snapshot_bytes": len(snap),
        "snapshot_restore_s": round(restore_s, 2),
    }
    del idx
    # This process is the load generator: freeze its big fixtures out of the collector
    # so its own GC pauses do not show up as lookup latency.
    gc.collect()
    gc.freeze()
    result.update(_run_loop(_over_nats(snap, events, queries, misses, offered_rate, seconds)))
    result["targets"] = {"lookups_per_s": 10_000, "lookup_p99_ms_at_5000": 2.0,
                         "ingest_events_per_s": 50_000, "recovery_s_1m_blocks": 10.0}
    return result


async def _over_nats(snap: bytes, events: list[wire.KvEvent], queries: list[bytes],
                     misses: list[bytes], rate: int, seconds: float) -> dict:
    # NATS alone first: the snapshot and the stream tail exist before kvindex starts.
    async with Cluster(ClusterSpec(nodes=(), label="bench-kvindex",
                                   stop_timeout_s=STOP_TIMEOUT_S)) as cluster:
        s = load_settings(environ={}, overrides=[f"nats.servers={cluster.url}"])
        bus = await Bus.open(s, "bench-kvindex")
        hb_task: asyncio.Task[None] | None = None
        echo: subprocess.Popen[bytes] | None = None
        try:
            js = bus.nc.jetstream()
            await kvevents.ensure_stream(js)
            # The snapshot covers everything but a tail of events still in the stream.
            tail = events[-200:]
            snap_dir = cluster.workdir / "snap"
            snap_dir.mkdir()
            (snap_dir / f"kvindex-{KVINDEX_NODE}.snap").write_bytes(_rebase(snap, 0))
            t_tail = time.perf_counter()
            for ev in tail:
                await js.publish(subjects.kv_events(ev.node), wire.encode(ev))
            tail_publish_s = time.perf_counter() - t_tail
            hb_task = asyncio.create_task(_heartbeats(bus))
            probe = wire.LookupRequest(namespace=NS.id, block_hashes=queries[0])
            t0 = time.perf_counter()
            # Not waiting for readiness: how long recovery takes is the measurement.
            await cluster.add(NodeSpec(KVINDEX_NODE, "kvindex"), wait=False)
            await _recovered(cluster, bus, probe)
            out = {"recovery_s_1m_blocks": round(time.perf_counter() - t0, 2),
                   "recovery_tail_events": len(tail),
                   "tail_publish_s": round(tail_publish_s, 3)}
            out.update(await _stream_ingest(bus, js))
            out.update(await _closed_loop(bus, queries + misses, seconds))
            echo = await _start_echo(cluster, bus, probe)
            out.update(await _open_loop(bus, queries + misses, rate, seconds,
                                        _pids(cluster), echo.pid))
        finally:
            if hb_task is not None:
                hb_task.cancel()
            if echo is not None:
                await asyncio.to_thread(stop_tree, echo, STOP_TIMEOUT_S)
            await bus.close()
    return out


async def _recovered(cluster: Cluster, bus: Bus, probe: wire.LookupRequest) -> None:
    """Until kvindex answers ``probe`` with the whole chain: its snapshot loaded and the
    stream's tail replayed. Fails with its log if it exits or takes too long."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        if not cluster.alive(KVINDEX_NODE):
            raise CpdError(f"kvindex exited during recovery:\n"
                           f"{cluster.log_tail(KVINDEX_NODE)}")
        if time.monotonic() > deadline:
            raise CpdError(f"kvindex did not recover within {RECOVERY_TIMEOUT_S:.0f} s:\n"
                           f"{cluster.log_tail(KVINDEX_NODE)}")
        try:
            r = await bus.request(subjects.KVINDEX_LOOKUP, probe,
                                  expect=wire.LookupReply, timeout=1)
            if r.status == "ok" and r.num_blocks == CHAIN:
                return
        except CpdError:
            pass
        await asyncio.sleep(RECOVERY_POLL_S)


async def _start_echo(cluster: Cluster, bus: Bus,
                      probe: wire.LookupRequest) -> subprocess.Popen[bytes]:
    """``tools.bench.echo`` answering with kvindex's own reply to a hit (the same bytes
    back: the floor), in a session of its own so that it is stopped by group."""
    hit = await bus.nc.request(subjects.KVINDEX_LOOKUP, wire.encode(probe), timeout=5)
    echo = subprocess.Popen([sys.executable, "-m", "tools.bench.echo", cluster.url,
                             hit.data.hex()], start_new_session=True)
    try:
        await _wait_for_echo(bus, probe)
    except BaseException:
        await asyncio.to_thread(stop_tree, echo, STOP_TIMEOUT_S)
        raise
    return echo


def _pids(cluster: Cluster) -> dict[str, int]:
    """The processes whose CPU time the open loop counts."""
    nats = cluster.nats
    assert nats is not None and nats.proc is not None
    return {"client": os.getpid(), "nats_server": nats.proc.pid,
            "kvindex": cluster.pid(KVINDEX_NODE)}


def _run_loop(coro: Coroutine[Any, Any, dict]) -> dict:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _rebase(snap: bytes, seq: int) -> bytes:
    import msgspec

    raw = msgspec.msgpack.decode(snap)
    raw["stream_seq"] = seq
    return msgspec.msgpack.encode(raw)


async def _stream_ingest(bus: Bus, js: Any, n_chains: int = 200) -> dict:
    """End-to-end ingest: events stored in JetStream until kvindex shows them visible."""
    rng = np.random.default_rng(11)
    raw = rng.bytes(n_chains * CHAIN * 16)
    chains = [[raw[(c * CHAIN + i) * 16:(c * CHAIN + i + 1) * 16] for i in range(CHAIN)]
              for c in range(n_chains)]
    events = _events(chains, INGEST_NODES)
    last = wire.LookupRequest(namespace=NS.id, block_hashes=b"".join(chains[-1]))
    t0 = time.perf_counter()
    acks = [await js.publish_async(subjects.kv_events(ev.node), wire.encode(ev))
            for ev in events]
    await asyncio.gather(*acks)
    while (await bus.request(subjects.KVINDEX_LOOKUP, last, expect=wire.LookupReply)
           ).num_blocks != CHAIN:
        await asyncio.sleep(0.005)
    dt = time.perf_counter() - t0
    return {"stream_ingest_events_per_s": round(2 * n_chains * CHAIN / dt),
            "stream_ingest_messages_per_s": round(len(events) / dt)}


async def _wait_for_echo(bus: Bus, probe: wire.LookupRequest) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await bus.request(subjects.BENCH_ECHO, probe, expect=wire.LookupReply, timeout=1)
            return
        except CpdError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _heartbeats(bus: Bus) -> None:
    while True:
        for node in NODES + INGEST_NODES:
            await bus.publish(subjects.heartbeat(node), _heartbeat(node))
        await asyncio.sleep(0.5)


async def _closed_loop(bus: Bus, qs: list[bytes], seconds: float, workers: int = 32) -> dict:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            q = qs[(i + done) % len(qs)]
            await bus.request(subjects.KVINDEX_LOOKUP,
                              wire.LookupRequest(namespace=NS.id, block_hashes=q),
                              expect=wire.LookupReply, timeout=5)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    return {"lookups_per_s": round(done / (time.perf_counter() - t0))}


async def _open_loop(bus: Bus, qs: list[bytes], rate: int, seconds: float,
                     pids: dict[str, int], echo_pid: int) -> dict:
    """Open loop at ``rate``, alternating 1 s rounds between kvindex and the echo
    responder (the floor) so both see the same moments of a noisy host."""
    rounds = max(1, round(seconds))
    per_round = max(1, int(rate * seconds / rounds))
    runs = {"kvindex": _Run(subjects.KVINDEX_LOOKUP, pids),
            "floor": _Run(subjects.BENCH_ECHO,
                          {**{k: v for k, v in pids.items() if k != "kvindex"},
                           "echo": echo_pid})}
    for _ in range(rounds):
        for run in runs.values():
            await run.round(bus, qs, rate, per_round)
    kvi, floor = runs["kvindex"], runs["floor"]
    total = [a + b for a, b in zip(kvi.lat, kvi.lag, strict=True)]
    out = {"offered_per_s": rate, "achieved_per_s": round(kvi.achieved()),
           "lookup_p50_ms": _ms(statistics.median(kvi.lat)) if kvi.lat else None,
           "lookup_p99_ms": _ms(_pct(kvi.lat, 0.99)) if kvi.lat else None,
           "lookup_p99_from_schedule_ms": _ms(_pct(total, 0.99)) if kvi.lat else None,
           "send_lag_p99_ms": _ms(_pct(kvi.lag, 0.99)) if kvi.lag else None,
           "cpu_us_per_lookup": kvi.cpu_us(),
           "lookup_errors": kvi.errors,
           "floor_p50_ms": _ms(statistics.median(floor.lat)) if floor.lat else None,
           "floor_p99_ms": _ms(_pct(floor.lat, 0.99)) if floor.lat else None,
           "floor_cpu_us_per_lookup": floor.cpu_us(),
           "floor_errors": floor.errors}
    if kvi.lat and floor.lat:
        out["lookup_p99_over_floor"] = round(_pct(kvi.lat, 0.99) / _pct(floor.lat, 0.99), 2)
    return out


def _ms(x: float) -> float:
    return round(x, 3)


class _Run:
    """One target of the open loop: its latencies and its processes' CPU, summed over
    the rounds it was driven in."""

    def __init__(self, subject: str, pids: dict[str, int]) -> None:
        self.subject = subject
        self.pids = pids
        self.lat: list[float] = []  # send -> reply, ms
        self.lag: list[float] = []  # schedule -> send, ms
        self.errors = 0
        self.sent = 0
        self.seconds = 0.0
        self.cpu: dict[str, float] = {}

    async def round(self, bus: Bus, qs: list[bytes], rate: int, n: int) -> None:
        tasks: set[asyncio.Task[None]] = set()

        async def one(q: bytes, t_sched: float) -> None:
            t_send = time.perf_counter()
            try:
                await bus.request(self.subject,
                                  wire.LookupRequest(namespace=NS.id, block_hashes=q),
                                  expect=wire.LookupReply, timeout=5)
                self.lat.append((time.perf_counter() - t_send) * 1e3)
                # The event loop's timer may fire a few µs early: on schedule, then.
                self.lag.append(max(0.0, t_send - t_sched) * 1e3)
            except Exception:
                self.errors += 1

        cpu0 = cpu_seconds_all(self.pids)
        t0 = time.perf_counter()
        for i in range(n):
            t_sched = t0 + i / rate
            delay = t_sched - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(qs[(self.sent + i) % len(qs)], t_sched))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        self.seconds += time.perf_counter() - t0
        self.sent += n
        for name, used in cpu_used_since(cpu0, self.pids).items():
            if used is not None:
                self.cpu[name] = self.cpu.get(name, 0.0) + used

    def achieved(self) -> float:
        return len(self.lat) / self.seconds if self.seconds else 0.0

    def cpu_us(self) -> dict[str, float]:
        """Each process's CPU time per lookup sent, µs."""
        return {name: round(used / self.sent * 1e6, 1) for name, used in self.cpu.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench kvindex``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 100K blocks, shorter rounds (tests, CI)")
    parser.add_argument("--blocks", type=int,
                        help="index size in blocks (default 1M; --quick 100K)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench kvindex``'s flags; the bench sets up its own NATS."""
    return run(quick=args.quick, blocks=args.blocks)
