"""The kvindex service: consumes ``CPD_KV``, tracks leases, answers lookups (docs/architecture.md,
"Lifecycle and visibility").

I/O only; every decision is in :mod:`services.kvindex.index`.

* Events: an ordered JetStream consumer over ``CPD_KV`` from the last snapshot's stream
  sequence. Undecodable events go to ``cpd.v1.kv.deadletter`` with a log line.
* Recovery: load the newest snapshot, replay the stream tail; until the tail is applied
  lookups answer ``recovering`` (the router treats that as a miss).
* Leases: heartbeats renew them; on expiry a ``LeaseExpired`` event goes into the stream
  (so replicas and replays forget the node alike) and an invalidation is published.
* Replicas: each consumes the whole stream and serves lookups in queue group ``kvindex``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections import defaultdict
from pathlib import Path

from nats.aio.msg import Msg
from nats.js import api
from opentelemetry.metrics import CallbackOptions, Observation

from cpd.bus import LocalHub, Request, Service, run_service
from cpd.kvstore import events as kvevents
from cpd.ops import metrics, telemetry
from cpd.ops.config import Settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ForgedSender, InvalidRequest
from services.kvindex.checks import check_event_sender, check_query
from services.kvindex.index import Changes, Index


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: a crash leaves the old or the new snapshot


class KvIndexService(Service):
    """One kvindex replica."""

    name = "kvindex"

    def __init__(self, settings: Settings, *, nats_url: str | None = None,
                 hub: LocalHub | None = None) -> None:
        super().__init__(settings, nats_url=nats_url, hub=hub)
        self.cfg = settings.kvindex
        self.index = Index()
        self.applied_seq = 0
        self.target_seq = 0
        self.recovering = True
        self.ready = asyncio.Event()
        self.dead_letters = 0
        self._snapshot_seq = 0
        self._reannounce_all = False
        self._asked: set[str] = set()
        self._sub = None
        self._stream_created: object = None  # CPD_KV's creation time: its identity
        self.stream_resets = 0  # times CPD_KV was found recreated under the index
        m = telemetry.meter()
        self._m_events = metrics.counter(m, metrics.KVINDEX_EVENTS)
        # Counted in an int and observed at export: an SDK counter's add() on every
        # lookup cost ~2 µs of the hottest path.
        self.lookups = 0
        metrics.observed_counter(m, metrics.KVINDEX_LOOKUPS,
                                 lambda _: [Observation(self.lookups)])
        self._m_illegal = metrics.counter(m, metrics.KVINDEX_ILLEGAL)
        self._m_evictions = metrics.counter(m, metrics.KVINDEX_INVALIDATED)
        metrics.observed_counter(m, metrics.KVINDEX_LAST_EVICTED,
                                 lambda _: [Observation(self.index.last_evicted)])
        metrics.observed_counter(m, metrics.KVINDEX_LOST_MISSES,
                                 lambda _: [Observation(self.index.misses)])
        self._m_expirations = metrics.counter(m, metrics.KVINDEX_LEASE_EXPIRATIONS)
        # The stream's pending count as of the last event applied (see lag_events).
        self.pending_events = 0
        metrics.gauge(m, metrics.KVINDEX_PENDING_EVENTS,
                      lambda _: [Observation(self.lag_events)])
        # Replicas (the seed's "number of copies"): locations per block, cluster-wide.
        metrics.gauge(m, metrics.KVINDEX_BLOCKS, self._observe_blocks)
        metrics.gauge(m, metrics.KVINDEX_LOCATIONS, self._observe_locations)

    def _observe_blocks(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(self.index.num_blocks, {"node": self.node_id})]

    def _observe_locations(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(self.index.num_locations, {"node": self.node_id})]

    @property
    def lag_events(self) -> int:
        """CPD_KV events not applied yet: the stream's tail past the last one applied (as
        the server counted it when it sent that one) and those delivered, still waiting
        in this process's buffer."""
        buffered = self._sub.pending_msgs if self._sub is not None else 0
        return self.pending_events + buffered

    @property
    def snapshot_path(self) -> Path:
        return Path(self.cfg.snapshot_dir).expanduser() / f"kvindex-{self.node_id}.snap"

    # -------------------------------------------------------------- lifecycle

    async def setup(self) -> None:
        self.js = self.bus.nc.jetstream()
        await kvevents.ensure_stream(self.js, max_age_s=self.cfg.stream_max_age_s,
                                     max_bytes=self.cfg.stream_max_bytes,
                                     replicas=self.cfg.stream_replicas)
        t0 = time.perf_counter()
        # Loading creates millions of long-lived objects; collecting while they pile up
        # costs seconds of repeated full scans. Collect once when ready (_mark_ready).
        gc.disable()
        self._load_snapshot()
        info = await self.js.stream_info(subjects.KV_STREAM)
        self.target_seq = info.state.last_seq
        self._stream_created = info.created
        if info.state.last_seq < self.applied_seq:
            # The stream is younger than the snapshot (recreated, its events lost).
            self._forget("stream_reset", info)
        elif info.state.first_seq > self.applied_seq + 1 and info.state.messages:
            # Events between our snapshot and the stream's oldest one aged out: what
            # nodes hold may be unknown to us, so every node is asked to re-announce.
            self._reannounce_all = True
            self.log.warning("kvindex.stream_truncated", snapshot_seq=self.applied_seq,
                             first_seq=info.state.first_seq)
        self.recovering = self.applied_seq < self.target_seq
        await self._subscribe()
        await self.bus.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        await self.add_endpoint("lookup", subjects.KVINDEX_LOOKUP, self._lookup,
                                expect=wire.LookupRequest, queue=subjects.QUEUE_KVINDEX,
                                inline=True)
        await self.add_endpoint("checksums", subjects.KVINDEX_CHECKSUMS, self._checksums,
                                expect=wire.ChecksumsRequest, queue=subjects.QUEUE_KVINDEX,
                                inline=True)
        self.spawn(self._sweep_leases(), "lease-sweeper")
        self.spawn(self._watch_stream(), "stream-watcher")
        self.spawn(self._snapshots(), "snapshots")
        if not self.recovering:
            self._mark_ready(t0)
        else:
            self._t_recovery = t0
        self.log.info("kvindex.started", snapshot_seq=self.applied_seq,
                      target_seq=self.target_seq, blocks=self.index.num_blocks)

    async def on_stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        self._write_snapshot()

    async def _subscribe(self) -> None:
        self._sub = await self.js.subscribe(
            subjects.KV_EVENTS_ALL, cb=self._on_event, ordered_consumer=True,
            idle_heartbeat=self.cfg.consumer_heartbeat_s,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            config=api.ConsumerConfig(opt_start_seq=self.applied_seq + 1))

    def _forget(self, why: str, info: api.StreamInfo) -> None:
        """Drop the index: the events it was built from are gone from the stream. It
        is rebuilt from what the stream holds and from every node's re-announcement."""
        self.log.warning(f"kvindex.{why}", applied_seq=self.applied_seq,
                         stream_last_seq=info.state.last_seq, blocks=self.index.num_blocks)
        self.index, self.applied_seq, self._snapshot_seq = Index(), 0, -1
        self._reannounce_all, self._asked = True, set()

    async def _watch_stream(self) -> None:
        """Notice ``CPD_KV`` recreated under a running index (a NATS server that lost
        its store, an operator's delete): the ordered consumer would wait past the old
        sequence for events that start again at 1. Replay the new stream instead."""
        while not self.stopping:
            await asyncio.sleep(self.cfg.stream_check_interval_s)
            applied = self.applied_seq  # events go on arriving while the answer does
            try:
                info = await self.js.stream_info(subjects.KV_STREAM)
            except Exception:  # NATS down or the stream not there yet: look again later
                continue
            if info.created == self._stream_created and info.state.last_seq >= applied:
                continue
            self.stream_resets += 1
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
            self._forget("stream_reset", info)
            self._stream_created, self.target_seq = info.created, info.state.last_seq
            self._t_recovery = time.perf_counter()
            self.recovering = self.applied_seq < self.target_seq
            await self._subscribe()
            if not self.recovering:
                self._mark_ready(self._t_recovery)

    def _mark_ready(self, t0: float) -> None:
        # The recovered index is long-lived: keep the collector from re-scanning its
        # million objects on every full collection (those scans are p99 latency spikes).
        gc.collect()
        gc.freeze()
        gc.enable()
        self.recovering = False
        self.ready.set()
        self.recovery_s = time.perf_counter() - t0
        self.log.info("kvindex.ready", applied_seq=self.applied_seq,
                      blocks=self.index.num_blocks, recovery_s=round(self.recovery_s, 3))

    # -------------------------------------------------------------- snapshots

    def _load_snapshot(self) -> None:
        path = self.snapshot_path
        if not path.exists():
            return
        try:
            self.index, self.applied_seq = Index.restore(path.read_bytes())
            self._snapshot_seq = self.applied_seq
        except Exception as e:  # a torn or foreign file: rebuild from the stream instead
            self.log.error("kvindex.snapshot_unreadable", path=str(path), error=repr(e))
            self.index, self.applied_seq = Index(), 0

    def _write_snapshot(self) -> None:
        """Write the snapshot now, in this process (used at stop)."""
        if self.applied_seq == self._snapshot_seq or self.recovering:
            return
        _write_atomically(self.snapshot_path, self.index.snapshot(self.applied_seq))
        self._snapshot_seq = self.applied_seq

    def _fork_snapshot(self) -> tuple[int, int] | None:
        """Write the snapshot from a forked child (copy-on-write, as Redis' BGSAVE
        does): serializing a million blocks takes seconds that lookups must not wait."""
        if self.applied_seq == self._snapshot_seq or self.recovering:
            return None
        seq = self.applied_seq
        pid = os.fork()
        if pid == 0:  # child: serialize, write, leave without running any cleanup
            code = 1
            try:
                _write_atomically(self.snapshot_path, self.index.snapshot(seq))
                code = 0
            finally:
                os._exit(code)
        return pid, seq

    async def _snapshots(self) -> None:
        child: tuple[int, int] | None = None
        while not self.stopping:
            await asyncio.sleep(min(1.0, self.cfg.snapshot_interval_s) if child
                                else self.cfg.snapshot_interval_s)
            if child is not None:
                pid, seq = child
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                child = None
                if os.waitstatus_to_exitcode(status) == 0:
                    self._snapshot_seq = max(self._snapshot_seq, seq)
                else:
                    self.log.error("kvindex.snapshot_failed", status=status)
                continue
            try:
                child = self._fork_snapshot() if hasattr(os, "fork") else None
                if not hasattr(os, "fork"):
                    self._write_snapshot()
            except OSError as e:
                self.log.error("kvindex.snapshot_failed", error=repr(e))

    # ----------------------------------------------------------------- events

    async def _on_event(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        try:
            ev = wire.decode(msg.data, wire.KvEvent)
            check_event_sender(msg.subject, ev)
        except ForgedSender as e:  # durable, so refused again on every replay
            self.reject(msg.subject, e)
            ch = Changes()
        except CpdError as e:
            self.dead_letters += 1
            self.reject(msg.subject, e)
            self.log.error("kvindex.dead_letter", stream_seq=seq, subject=msg.subject,
                           error=e.code.value, detail=e.message)
            with contextlib.suppress(Exception):
                await self.bus.nc.publish(subjects.KV_DEADLETTER, msg.data,
                                          headers={"Cpd-Error": e.code.value,
                                                   "Cpd-Subject": msg.subject})
            ch = Changes()
        else:
            ch = self.index.apply(ev)
        self.applied_seq = seq
        self.pending_events = msg.metadata.num_pending
        self._m_events.add(1)
        if self.recovering:
            if seq >= self.target_seq:
                self._mark_ready(self._t_recovery)
            return  # replaying: the world already heard these changes
        await self._publish(ch)

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self.decode_from_sender(msg, wire.Heartbeat)
        if hb is None:
            return
        ch = self.index.heartbeat(hb, time.monotonic())
        if self._reannounce_all and hb.node not in self._asked:
            self._asked.add(hb.node)
            ch.reannounce.add(hb.node)
        await self._publish(ch)

    async def _publish(self, ch: Changes) -> None:
        for line in ch.illegal:
            self._m_illegal.add(1)
            self.log.warning("kvindex.illegal", detail=line)
        groups: dict[tuple[str, str, wire.Tier], list[bytes]] = defaultdict(list)
        for ns, node, tier, h in ch.visible:
            groups[(ns, node, tier)].append(h)
        for (ns, node, tier), hs in groups.items():
            await self._send(subjects.KV_VISIBLE, wire.BlocksVisible(
                namespace=ns, node=node, tier=tier, block_hashes=b"".join(hs)))
        groups.clear()
        for ns, node, tier, h in ch.invalidated:
            groups[(ns, node, tier)].append(h)
        for (ns, node, tier), hs in groups.items():
            self._m_evictions.add(len(hs))
            await self._send(subjects.KV_INVALIDATE, wire.BlocksInvalidated(
                namespace=ns, node=node, tier=tier, block_hashes=b"".join(hs)))
        await self._publish_copies(ch)
        for node in ch.reannounce:
            self.log.info("kvindex.reannounce_requested", target=node)
            await self._send(subjects.kv_reannounce(node),
                             wire.Reannounce(reason="kvindex needs the node's blocks"))

    async def _publish_copies(self, ch: Changes) -> None:
        """Tell each node which of its DRAM blocks gained or lost their other copies (the
        last word on a block wins), with this replica's count of lost blocks asked for."""
        state: dict[tuple[str, str], dict[bytes, bool]] = defaultdict(dict)
        for ns, node, h, shared in ch.copies:
            state[(node, ns)][h] = shared
        for (node, ns), blocks in state.items():
            await self._send(subjects.kv_copies(node), wire.BlockCopies(
                namespace=ns, shared=b"".join(h for h, s in blocks.items() if s),
                last=b"".join(h for h, s in blocks.items() if not s),
                kvindex=self.node_id, misses=self.index.misses))

    async def _send(self, subject: str, msg: wire.Message) -> None:
        try:
            await self.bus.publish(subject, msg)
        except CpdError as e:  # e.g. an enormous invalidation: routers fall back to lookups
            self.log.error("kvindex.publish_failed", subject=subject, error=e.message)

    # ----------------------------------------------------------------- leases

    async def _sweep_leases(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.cfg.lease_sweep_interval_s)
            if self.recovering:
                continue
            for node, epoch in self.index.expired_leases(time.monotonic()):
                await self._expire(node, epoch)

    async def _expire(self, node: str, epoch: int) -> None:
        info = self.index.nodes[node]
        ev = wire.LeaseExpired(node=node, seq=0, epoch=epoch, reason="no heartbeat")
        # Every replica publishes the same id: the stream stores the expiry once.
        headers = {"Nats-Msg-Id": f"expire:{node}:{epoch}:{info.last_seq}"}
        try:
            await self.js.publish(subjects.kv_events(subjects.KVINDEX_EVENTS_NODE),
                                  wire.encode(ev), headers=headers)
        except Exception as e:
            self.log.error("kvindex.expiry_not_stored", target=node, error=repr(e))
            return  # retried at the next sweep
        self.index.mark_expiry_published(node, epoch)
        self._m_expirations.add(1)
        self.log.warning("kvindex.lease_expired", target=node, epoch=epoch)
        await self._send(subjects.KV_INVALIDATE,
                         wire.BlocksInvalidated(node=node, reason="lease expired"))
        if self.index.nodes[node].alive(time.monotonic()):
            # It heartbeated while the expiry was being stored: ask for its blocks now.
            await self._send(subjects.kv_reannounce(node),
                             wire.Reannounce(reason="lease expired; heartbeat resumed"))

    # ----------------------------------------------------------------- lookups

    async def _lookup(self, req: wire.LookupRequest, _: Request) -> wire.LookupReply:
        self.lookups += 1
        if self.recovering:
            return wire.LookupReply(request_id=req.request_id, status="recovering")
        check_query(req.namespace, req.block_hashes, self.cfg.max_lookup_blocks)
        reply = self.index.lookup(req.namespace, req.block_hashes, time.monotonic(),
                                  req.include_pending, req.checksums)
        reply.request_id = req.request_id
        reply.lag_events = self.lag_events
        return reply

    async def _checksums(self, req: wire.ChecksumsRequest, _: Request) -> wire.ChecksumsReply:
        check_query(req.namespace, req.block_hashes, self.cfg.max_lookup_blocks)
        try:
            subjects.check_token(req.node, "node")
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return wire.ChecksumsReply(request_id=req.request_id, checksums=b"" if self.recovering
                                   else self.index.checksums(req.namespace, req.node,
                                                             req.block_hashes, time.monotonic()))


def serve(settings: Settings) -> None:
    """Run one kvindex process until SIGTERM/SIGINT (``python -m services.kvindex``,
    ``cpd serve kvindex``)."""
    telemetry.setup("kvindex", settings.telemetry)
    run_service(KvIndexService(settings))

