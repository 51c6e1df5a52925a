"""The one worker base behind ``services/{preprefill,prefill,decode}`` (docs/architecture.md,
"Services").

The role is configuration: prefill-side roles (``preprefill``, ``prefill``) serve
``PrefillRequest``s, the ``decode`` role serves ``DecodeRequest``s. Both own:

* a block arena in shared memory, managed by :class:`cpd.kvstore.KvStore` (lifecycle
  events into ``CPD_KV``) and mapped by the engine's KV connector;
* a UCX :class:`~cpd.transfer.TransferServer` (its address goes in the heartbeat) and a
  :class:`~cpd.transfer.TransferClient` for pulls from peers;
* heartbeats (the lease) and load reports.

Prefill side: pull the planned prefix blocks from peers, pin what will be loaded, give
every new full block an arena slot (write-through), run the engine for the first token,
seal the new blocks, send the first token to the client, then hand the request to its
decode node with the blocks pinned under a lease until decode acks the pull.

Decode side: accept, pull the request's blocks from the prefill node (recompute whatever
cannot be pulled), ack, and stream the rest of the tokens from prompt + first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from nats.aio.msg import Msg
from opentelemetry.metrics import Observation

from cpd.bus import BAD_INPUT, ReplyStream, Request, Service
from cpd.engines import ArenaSpec, Engine, EngineRequest, EngineStep
from cpd.engines.profile import CacheEventBridge, engine_profile
from cpd.kvstore import BlockEntry, BlockStore, KvStore
from cpd.kvstore import events as kvevents
from cpd.ops import metrics, telemetry
from cpd.ops.audit import AuditLog
from cpd.ops.config import Settings
from cpd.protocol import subjects, wire
from cpd.protocol.capability import Keyring
from cpd.protocol.errors import CpdError, ErrorCode, InvalidRequest, Overloaded, PromptTooLong
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.roles import PREFILL_ROLES, WORKER_ROLES
from cpd.transfer import TransferClient, TransferServer, decode_address, init_ucx


@dataclass
class _HeldPrefill:
    """A prefill this worker holds, as its load report lists it."""

    new_tokens: int
    context_tokens: int
    engine_start: float = 0.0  # perf_counter when it entered the engine; 0 while loading


class DecodeUnavailable(CpdError):
    """No decode node accepted the hand-off."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class WorkerService(Service):
    """A pre-prefill, prefill or decode worker."""

    def __init__(self, settings: Settings, role: str, *, nats_url: str | None = None) -> None:
        if role not in WORKER_ROLES:
            raise ValueError(f"unknown worker role {role!r}")
        self.name = role
        super().__init__(settings, nats_url=nats_url)
        self.role = role
        self.profile = engine_profile(settings)
        self.engine: Engine | None = None
        self.epoch = int(time.time() * 1000)
        # This incarnation's data-plane secret: peers read our blocks only with a
        # capability issued from it (sealed events → kvindex → router, or our hand-off);
        # a restart draws a new one, which voids every capability of the old epoch.
        self.keyring = Keyring(self.node_id, self.epoch)
        self.block_size = settings.cache.block_size
        self.peers: dict[str, bytes] = {}
        self._peer_waits: dict[str, asyncio.Event] = {}
        # Peers to dial ahead of need: (node, address, when its heartbeat was first seen).
        self._ahead: asyncio.Queue[tuple[str, bytes, float]] = asyncio.Queue()
        self._prefills: dict[int, _HeldPrefill] = {}
        self._prefill_ids = itertools.count()
        self.in_flight = 0
        self.ms_per_token = settings.worker.initial_ms_per_token
        self._arena_path: Path | None = None
        self._bridge: CacheEventBridge | None = None
        self._leases: dict[str, asyncio.TimerHandle] = {}
        # Request ids running here: engines refuse a duplicate id with an untyped error.
        self._running: set[str] = set()
        self.audit: AuditLog | None = None  # worker.audit_dir: the block audit trail
        self._instruments()

    def _instruments(self) -> None:
        m = telemetry.meter()
        attrs = {"role": self.role, "node": self.node_id}
        role = {"role": self.role}
        self._m_kv_bytes = metrics.counter(m, metrics.WORKER_KV, [
            {**role, "direction": d} for d in ("write", "load")])
        stages = [st for st in metrics.FALLBACK_STAGES
                  if st == "handoff" or self.role in PREFILL_ROLES]
        self._m_loads_planned = metrics.counter(m, metrics.WORKER_KV_LOADS_PLANNED, [
            {**role, "stage": st} for st in stages])
        self._m_fallbacks = metrics.counter(m, metrics.WORKER_KV_LOAD_FALLBACKS, [
            {**role, "stage": st, "reason": r}
            for st in stages for r in metrics.FALLBACK_REASONS])
        self._m_phase = metrics.histogram(m, metrics.WORKER_PHASE)
        metrics.gauge(m, metrics.WORKER_DRAM_USED,
                      lambda _: [Observation(self.kv.store.used_bytes, attrs)]
                      if hasattr(self, "kv") else [])
        metrics.gauge(m, metrics.WORKER_DRAM_CAPACITY,
                      lambda _: [Observation(self.kv.store.total_bytes, attrs)]
                      if hasattr(self, "kv") else [])
        metrics.observed_counter(m, metrics.WORKER_EVICTIONS,
                                 lambda _: [Observation(self.kv.store.evictions, attrs)]
                                 if hasattr(self, "kv") else [])

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """The model, the block arena and the engine, before NATS: an engine takes from
        seconds to minutes to start and blocks the event loop meanwhile, which a live
        NATS connection would not survive (the server drops it as stale)."""
        s = self.settings
        model = await asyncio.to_thread(self.profile.served_model)
        self.namespace = model.namespace
        self.vocab_size = model.vocab_size  # token ids past it are refused, not run
        nbytes = self.profile.slot_bytes
        num_slots = max(1, s.dataplane.arena_bytes // nbytes)
        arena_dir = Path(s.worker.arena_dir)
        _remove_stale_files(arena_dir, self.node_id)
        self._arena_path = arena_dir / _shm_name("arena", self.node_id, self.epoch)
        self._arena = np.memmap(self._arena_path, dtype=np.uint8, mode="w+",
                                shape=(num_slots, nbytes))
        if s.worker.prefault_arena:
            await asyncio.to_thread(_prefault, self._arena)
        # Where vLLM publishes its KV events (the sim engine's go in process).
        self._kv_events_endpoint = (
            f"ipc://{arena_dir / _shm_name('kvevents', self.node_id, self.epoch)}")
        arena_spec = ArenaSpec(str(self._arena_path), num_slots, nbytes)
        self.engine = self.profile.build_engine(
            self.role, model, arena_spec, kv_events_endpoint=self._kv_events_endpoint)
        await self.engine.start()

    async def setup(self) -> None:
        s = self.settings
        arena = self._arena
        js = self.bus.nc.jetstream()
        await kvevents.ensure_stream(js, update=False)  # kvindex owns its limits
        self.kv = KvStore(BlockStore(arena.shape[1], arena.shape[0], node=self.node_id,
                                     arena=arena, capability=self.keyring.issue),
                          kvevents.KvEventPublisher(js, self.node_id, epoch=self.epoch))
        await self.kv.start(self.bus.nc, sweep_interval_s=s.dataplane.lease_sweep_interval_s,
                            on_reject=self.reject)
        init_ucx(s.dataplane)
        self.server = await TransferServer(self.kv, s.dataplane, keyring=self.keyring).start()
        if s.worker.audit_dir:  # the fault harness's evidence (cpd.ops.audit)
            self.audit = self.server.audit = AuditLog(s.worker.audit_dir, self.node_id)
        self.client = TransferClient(s.dataplane)
        assert self.kv.publisher is not None
        self._bridge = self.profile.cache_event_bridge(
            self.engine, self.kv.publisher, self.namespace,
            kv_events_endpoint=self._kv_events_endpoint)
        await self._bridge.start()
        await self.bus.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        if self.role in PREFILL_ROLES:
            await self.bus.nc.subscribe(subjects.pull_ack(self.node_id), cb=self._on_pull_ack)
            await self.add_endpoint("run", subjects.run(self.role, self.node_id),
                                    self._on_prefill, expect=wire.PrefillRequest)
        else:
            await self.add_endpoint("run", subjects.run(self.role, self.node_id),
                                    self._on_decode, expect=wire.DecodeRequest)
        await self.add_endpoint("admin", subjects.admin(self.role, self.node_id),
                                self._on_reset, expect=wire.ResetCache)
        await self._heartbeat()
        self.spawn(self._heartbeats(), "heartbeats")
        if s.dataplane.connect_ahead:
            self.spawn(self._connect_ahead(), "connect-ahead")
        self.spawn(self._load_reports(), "load-reports")

    async def on_stop(self) -> None:
        # Also runs after a start that failed part-way: release whatever exists.
        for handle in self._leases.values():
            handle.cancel()
        if self._bridge is not None:
            await self._bridge.close()
        if self.engine is not None:
            await self.engine.stop()
        for part in ("client", "server", "kv"):
            if hasattr(self, part):
                with contextlib.suppress(Exception):
                    await getattr(self, part).close()
        if self._arena_path is not None:
            self._arena_path.unlink(missing_ok=True)
            (self._arena_path.parent / _shm_name("kvevents", self.node_id, self.epoch)).unlink(
                missing_ok=True)

    async def _on_reset(self, req: wire.ResetCache, _: Request) -> wire.Accepted:
        assert self.engine is not None
        if not await self.engine.reset_prefix_cache():
            raise CpdError("engine prefix cache busy (requests running)",
                           code=ErrorCode.UNAVAILABLE, retryable=True)
        self.log.info("worker.prefix_cache_reset", reason=req.reason)
        return wire.Accepted(request_id="", node=self.node_id)

    # ------------------------------------------------------------- liveness, load

    def heartbeat_message(self) -> wire.Heartbeat:
        return wire.Heartbeat(
            node=self.node_id, role=self.role, started_unix_ms=self.epoch,
            lease_ttl_ms=int(self.settings.node.lease_ttl_s * 1000),
            ucx_address=self.server.address, capacity_blocks=self.kv.store.num_slots,
            namespace=self.namespace.id, namespace_spec=self.namespace.to_spec(),
            version=self.version)

    async def _heartbeat(self) -> None:
        with contextlib.suppress(CpdError):
            await self.bus.publish(subjects.heartbeat(self.node_id), self.heartbeat_message())

    async def _heartbeats(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.node.heartbeat_interval_s)
            await self._heartbeat()

    def load_report(self) -> wire.LoadReport:
        st = self.kv.store
        return wire.LoadReport(
            node=self.node_id, role=self.role, queue_depth=self.waiting,
            queued_new_tokens=self.queued_tokens,
            est_queue_ms=self.queued_tokens * self.ms_per_token, in_flight=self.in_flight,
            dram_used_bytes=st.used_bytes, dram_total_bytes=st.total_bytes,
            kv_bandwidth_gbps=self.client.meter.gbps, prefills=self._prefill_work(),
            prefill_token_cap=self.settings.worker.long_prefill_token_threshold)

    @property
    def waiting(self) -> int:
        """Prefills held here (loading their prefix or in the engine)."""
        return len(self._prefills)

    @property
    def queued_tokens(self) -> int:
        """New tokens of the held prefills, as the router planned them."""
        return sum(p.new_tokens for p in self._prefills.values())

    def _prefill_work(self) -> list[wire.PrefillWork]:
        now = time.perf_counter()
        return [wire.PrefillWork(new_tokens=p.new_tokens, context_tokens=p.context_tokens,
                                 elapsed_ms=(now - p.engine_start) * 1e3
                                 if p.engine_start else 0.0)
                for p in list(self._prefills.values())[:wire.MAX_REPORTED_PREFILLS]]

    async def _load_reports(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.worker.load_report_interval_s)
            await self._publish_load()

    async def _publish_load(self) -> None:
        self._load_queued = False
        with contextlib.suppress(CpdError):
            await self.bus.publish(subjects.load(self.role, self.node_id), self.load_report())

    def _load_changed(self) -> None:
        """Report the load now, not at the next tick: a router reading a report from the
        middle of a prefill that just ended would steer work away from an idle node.
        Changes within one event-loop turn share one report."""
        if not getattr(self, "_load_queued", False) and hasattr(self, "kv"):
            self._load_queued = True
            self.spawn(self._publish_load(), "load-report")

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self.decode_or_reject(msg, wire.Heartbeat)
        if hb is None or not hb.ucx_address:
            return
        try:  # an address no pull could use must not replace a peer's good one
            decode_address(hb.ucx_address)
        except CpdError as e:
            self.reject(msg.subject, e)
            return
        if (self.peers.get(hb.node) != hb.ucx_address and hb.node != self.node_id
                and self._may_pull_from(hb.role)):
            self._ahead.put_nowait((hb.node, hb.ucx_address, time.monotonic()))
        self.peers[hb.node] = hb.ucx_address
        if (waiting := self._peer_waits.pop(hb.node, None)) is not None:
            waiting.set()

    async def _peer_address(self, node: str) -> bytes | None:
        """The UCX address of ``node``. A plan may name a peer this worker has not heard
        yet (the router heard its heartbeat first): wait up to two heartbeat intervals
        for it rather than recompute what the peer holds."""
        if (address := self.peers.get(node)) is not None:
            return address
        seen = self._peer_waits.setdefault(node, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.wait(), 2 * self.settings.node.heartbeat_interval_s)
        return self.peers.get(node)

    def _may_pull_from(self, role: str) -> bool:
        """Prefill roles pull prefixes from any worker; decode pulls only hand-offs."""
        return role in WORKER_ROLES and (self.role in PREFILL_ROLES or role in PREFILL_ROLES)

    async def _connect_ahead(self) -> None:
        """Dial each new peer once its listener had a moment to settle, one at a time (a
        burst of concurrent handshakes with a just-restarted peer is what UCX handles
        worst), so the first warm request does not pay the connection set-up."""
        delay = self.settings.dataplane.connect_ahead_delay_s
        while not self.stopping:
            node, address, seen = await self._ahead.get()
            await asyncio.sleep(max(0.0, seen + delay - time.monotonic()))
            if self.peers.get(node) == address and await self.client.connect_ahead(address):
                self.log.info("worker.peer_connected", peer=node)

    def _salt(self, namespace: str) -> str:
        """vLLM cache salt of a request: tenants' namespaces never share engine blocks."""
        return "" if namespace == self.namespace.id else namespace

    # ----------------------------------------------------------------- prefill

    async def _on_prefill(self, req: wire.PrefillRequest,
                          r: Request) -> wire.Accepted | None:
        """A dispatcher that names a stream inbox (the router) gets ``Accepted`` at once,
        or a typed refusal it can route around; the stream follows on that inbox. A
        direct caller without one gets the stream on its own request's inbox."""
        _check_ids(reply_to=req.reply_to or r.reply_to, decode_node=req.decode_node)
        if not (req.reply_to or r.reply_to):
            raise InvalidRequest("prefill request without a reply inbox")
        self._admit(len(req.tokens) // wire.TOKEN_DTYPE.itemsize, req.sampling.max_tokens,
                    req.deadline_unix_ms)
        self._claim(req.request_id)
        if not req.reply_to:
            req.reply_to = r.reply_to
            await self._prefill_stream(req)
            return None
        self.spawn(self._prefill_stream(req), f"prefill-{req.request_id}", background=False)
        return wire.Accepted(request_id=req.request_id, node=self.node_id)

    async def _prefill_stream(self, req: wire.PrefillRequest) -> None:
        out = ReplyStream(self.bus, req.reply_to, req.request_id)
        try:
            await self._prefill(req, out)
        except BaseException as e:
            self._count_stream_rejection(e)
            await out.error(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._running.discard(req.request_id)

    def _claim(self, request_id: str) -> None:
        """Mark ``request_id`` running here, refusing one that already is."""
        if request_id in self._running:
            raise InvalidRequest(f"request {request_id[:80]!r} is already running here")
        self._running.add(request_id)

    def _count_stream_rejection(self, e: BaseException) -> None:
        """Bad input found after the request was accepted (its error goes on the stream)
        is a rejection all the same."""
        if isinstance(e, CpdError) and e.code in BAD_INPUT:
            self.reject(subjects.run(self.role, self.node_id), e)

    def _check_vocab(self, tokens: np.ndarray) -> None:
        """Token ids an engine would index its embedding with: past the vocabulary they
        crash a real engine, so they are refused here."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise InvalidRequest(f"token id {int(tokens.max())} is outside the vocabulary "
                                 f"of {self.vocab_size}")

    def _admit(self, prompt_tokens: int, max_tokens: int, deadline_ms: int) -> None:
        """Refuse, with a typed error, what this worker cannot or should not take."""
        assert self.engine is not None
        if prompt_tokens < 1:
            raise InvalidRequest("empty prompt")
        if prompt_tokens + max_tokens > self.engine.max_model_len:
            raise PromptTooLong(f"{prompt_tokens} prompt + {max_tokens} new tokens exceed "
                                f"the model's {self.engine.max_model_len}")
        if deadline_ms and time.time() * 1000 > deadline_ms:
            raise CpdError("deadline passed before the work started",
                           code=ErrorCode.DEADLINE_EXCEEDED)
        # Every accepted request counts from its acceptance (claimed), not only once its
        # task has started: a burst of dispatches cannot overshoot the bound.
        if len(self._running) >= self.settings.worker.max_queued_requests:
            raise Overloaded(f"{self.node_id} holds {len(self._running)} requests")

    async def _prefill(self, req: wire.PrefillRequest, out: ReplyStream) -> None:
        t0 = time.perf_counter()
        tokens = wire.unpack_tokens(req.tokens)  # a numpy view: no per-token objects
        self._check_vocab(tokens)
        hashes = wire.split_hashes(req.block_hashes)
        if len(hashes) != len(tokens) // self.block_size:
            raise InvalidRequest(f"{len(hashes)} block hashes for {len(tokens)} tokens")
        # New tokens as the router planned them (cached ones cost next to nothing); the
        # EWMA below is per computed token too, so the queue estimate stays consistent.
        pending = req.route.tokens_computed or len(tokens)
        key = next(self._prefill_ids)
        held = self._prefills[key] = _HeldPrefill(pending, len(tokens) - pending)
        self._load_changed()
        try:
            loaded, remote, load_error = await self._gather_prefix(req, hashes)
            t_load = held.engine_start = time.perf_counter()
            step, saved = await self._run_prefill(req, tokens, hashes, loaded)
        finally:
            del self._prefills[key]
            self._load_changed()
        t_done = time.perf_counter()
        attrs = {"role": self.role}
        self._m_phase.record(t_load - t0, {**attrs, "phase": "load"})
        self._m_phase.record(t_done - t_load, {**attrs, "phase": "prefill"})
        slot = self.kv.store.slot_bytes
        self._m_kv_bytes.add(len(saved) * slot, {**attrs, "direction": "write"})
        self._m_kv_bytes.add(step.loaded_blocks * slot, {**attrs, "direction": "load"})
        computed = len(tokens) - step.cached_tokens
        if computed > 0:  # EWMA of this node's prefill speed: the router's queue estimate
            self.ms_per_token = 0.8 * self.ms_per_token + 0.2 * (
                (t_done - t_load) * 1e3 / computed)
        first = step.token_ids[0]
        await out.tokens([first])
        bs = self.block_size
        # Pulled blocks the engine already held in its own cache were not loaded: the
        # remote share is at most what was loaded (never a negative DRAM count).
        remote = min(remote, step.loaded_blocks)
        route = wire.Route(**{**_route_fields(req.route), "prefill_node": self.node_id,
                              "tokens_gpu": step.gpu_blocks * bs,
                              "tokens_dram": (step.loaded_blocks - remote) * bs,
                              "tokens_remote": remote * bs,
                              "tokens_computed": computed, "load_error": load_error})
        timings = wire.Timings(load_ms=(t_load - t0) * 1e3, prefill_ms=(t_done - t_load) * 1e3,
                               ttft_ms=(t_done - t0) * 1e3)
        if step.finished and (req.sampling.max_tokens <= 1 or step.finish_reason == "stop"):
            await out.final(finish_reason=step.finish_reason or "length",
                            usage=wire.Usage(prompt_tokens=len(tokens), completion_tokens=1,
                                             cached_tokens=step.cached_tokens),
                            timings=timings, route=route)
            return
        await self._handoff(req, hashes, first, route, timings, out, saved)

    async def _gather_prefix(self, req: wire.PrefillRequest, hashes: list[bytes]
                             ) -> tuple[list[bytes], int, wire.LoadError | None]:
        """The sealed local blocks the engine will load, in chain order from block 0,
        after pulling the planned remote runs; how many of them came from peers; and,
        when a planned pull failed, which and why (the rest is recomputed, and the
        final's route says so)."""
        remote = 0
        t_recv = time.time()
        failure: wire.LoadError | None = None
        if any(src.node != self.node_id and src.num_blocks for src in req.sources):
            self._m_loads_planned.add(1, {"role": self.role, "stage": "prefix"})
        for src in sorted(req.sources, key=lambda x: x.first_block):
            want = hashes[src.first_block:src.first_block + src.num_blocks]
            if src.node == self.node_id or not want:
                continue
            address = await self._peer_address(src.node)
            if address is None:
                self.log.warning("prefill.peer_unknown", peer=src.node)
                error = ErrorCode.UNAVAILABLE.value
                failure = wire.LoadError(peer=src.node, code=error,
                                         detail="no heartbeat seen")
                break
            error = ""
            try:
                remote += len(await self.client.pull(address, want, self.kv,
                                                     namespace=req.namespace,
                                                     capability=src.capability))
            except CpdError as e:  # peer gone, evicted, corrupt: recompute from here
                error = e.code.value
                failure = wire.LoadError(peer=src.node, code=error)
                self.log.warning("prefill.pull_failed", peer=src.node, error=error,
                                 detail=e.message)
                break
            finally:
                if self.audit is not None:
                    self.audit.pulled("prefix", src.node, req.namespace, want, t_recv, error)
        if failure is not None:
            self._m_fallbacks.add(1, {"role": self.role, "stage": "prefix",
                                      "reason": failure.code})
        have = [e.hash for e in self._sealed_prefix(hashes)]
        return have, min(remote, len(have)), failure

    def _audit_load(self, namespace: str, entries: list[BlockEntry]) -> None:
        """Record blocks handed to the engine: they must be sealed and intact."""
        assert self.audit is not None
        store = self.kv.store
        sealed = [e for e in entries if e.state is BlockState.SEALED]
        self.audit.loaded(namespace, [e.hash for e in entries],
                          unsealed=len(entries) - len(sealed),
                          corrupt=sum(not store.intact(e.hash) for e in sealed))

    def _sealed_prefix(self, hashes: list[bytes]) -> list[BlockEntry]:
        """The longest run of ``hashes`` from the first that this store holds sealed."""
        out: list[BlockEntry] = []
        for h in hashes:
            entry = self.kv.store.get(h)
            if entry is None or entry.state is not BlockState.SEALED:
                break
            out.append(entry)
        return out

    async def _run_prefill(self, req: wire.PrefillRequest, tokens: np.ndarray,
                           hashes: list[bytes], loaded: list[bytes]
                           ) -> tuple[EngineStep, list[bytes]]:
        assert self.engine is not None
        store = self.kv.store
        lease = f"load-{req.request_id}-{uuid.uuid4().hex[:6]}"
        if loaded:
            self.kv.pin(lease, loaded, self.settings.dataplane.pin_ttl_s)
        new_refs = [wire.BlockRef(h, hashes[i - 1] if i else b"", self.block_size)
                    for i, h in enumerate(hashes) if h not in store]
        entries = await self.kv.allocate(req.namespace, new_refs) if new_refs else []
        fresh = [e for e in entries if e is not None]
        if fresh:
            await self.kv.begin_write([e.hash for e in fresh])
        slot_of = {e.hash: e.slot for e in fresh}
        save = [slot_of.get(h, -1) for h in hashes]
        entries_loaded = [store.get(h) for h in loaded]
        if self.audit is not None and loaded:
            self._audit_load(req.namespace, [e for e in entries_loaded if e is not None])
        ereq = EngineRequest(
            request_id=req.request_id, tokens=tokens,
            sampling=_with_max_tokens(req.sampling, 1),
            load_slots=[e.slot for e in entries_loaded if e is not None],
            load_checksums=[e.checksum for e in entries_loaded if e is not None],
            save_slots=save, cache_salt=self._salt(req.namespace))
        self.in_flight += 1
        try:
            step = EngineStep()
            async for part in self.engine.generate(ereq):
                step = part if part.finished else step
                if part.token_ids and not step.token_ids:
                    step.token_ids = part.token_ids
            if not step.token_ids:
                raise CpdError("engine produced no token", code=ErrorCode.INTERNAL)
        except BaseException:
            if fresh:
                await self.kv.fail([e.hash for e in fresh], "prefill failed")
            raise
        finally:
            self.in_flight -= 1
            if loaded:
                self.kv.unpin(lease)
        if step.failed_blocks:
            await self._drop_corrupt(loaded)
        saved = [e.hash for e in fresh]
        if saved:
            await self.kv.seal([(h, store.slot_bytes) for h in saved])
        return step, saved

    async def _handoff(self, req: wire.PrefillRequest, hashes: list[bytes], first: int,
                       route: wire.Route, timings: wire.Timings, out: ReplyStream,
                       saved: list[bytes]) -> None:
        """Pin the request's blocks and give it to its decode node."""
        held = [e.hash for e in self._sealed_prefix(hashes)]
        lease = f"handoff-{req.request_id}-{uuid.uuid4().hex[:6]}"
        ttl = self.settings.dataplane.pin_ttl_s
        if held:
            self.kv.pin(lease, held, ttl)
            self._leases[lease] = asyncio.get_running_loop().call_later(
                ttl, self._leases.pop, lease, None)
        dreq = wire.DecodeRequest(
            request_id=req.request_id, reply_to=req.reply_to, tokens=req.tokens,
            first_token=first, sampling=req.sampling, namespace=req.namespace,
            block_hashes=b"".join(held), source_node=self.node_id, lease_id=lease,
            deadline_unix_ms=req.deadline_unix_ms, seq_start=out.seq,
            route=route, timings=timings, trace=req.trace,
            capability=self.keyring.issue(req.namespace))
        try:
            await self.bus.request(subjects.run("decode", req.decode_node), dreq,
                                   expect=wire.Accepted,
                                   timeout=self.settings.worker.handoff_timeout_s)
        except CpdError as e:
            self._release(lease)
            raise DecodeUnavailable(f"decode node {req.decode_node} did not take the "
                                    f"request: {e.message}") from e
        out.closed = True  # decode owns the rest of the stream

    async def _drop_corrupt(self, loaded: list[bytes]) -> None:
        """The engine refused some loaded blocks (checksum): they were recomputed, and
        whichever no longer match their seal leave the store and kvindex for good."""
        store = self.kv.store
        bad = [h for h in loaded if h in store
               and store.get(h).state is BlockState.SEALED  # type: ignore[union-attr]
               and not store.intact(h)]
        if bad:
            await self.kv.discard(bad, "checksum mismatch on load")

    def _release(self, lease: str) -> None:
        handle = self._leases.pop(lease, None)
        if handle is not None:
            handle.cancel()
        self.kv.unpin(lease)

    async def _on_pull_ack(self, msg: Msg) -> None:
        ack = self.decode_or_reject(msg, wire.PullAck)
        if ack is not None:
            self._release(ack.lease_id)

    # ------------------------------------------------------------------ decode

    async def _on_decode(self, req: wire.DecodeRequest, _: Request) -> wire.Accepted:
        _check_ids(reply_to=req.reply_to, source_node=req.source_node)
        tokens = wire.unpack_tokens(req.tokens)
        self._check_vocab(tokens)
        if not 0 <= req.first_token < self.vocab_size:
            raise InvalidRequest(f"first token {req.first_token} is outside the vocabulary "
                                 f"of {self.vocab_size}")
        hashes = wire.split_hashes(req.block_hashes)
        remaining = req.sampling.max_tokens - 1
        if remaining < 1:
            raise InvalidRequest("a hand-off needs at least one more token to generate")
        self._admit(len(tokens) + 1, remaining, req.deadline_unix_ms)
        self._claim(req.request_id)
        self.spawn(self._decode(req, tokens, hashes, remaining), f"decode-{req.request_id}",
                   background=False)
        return wire.Accepted(request_id=req.request_id, node=self.node_id)

    async def _decode(self, req: wire.DecodeRequest, tokens: np.ndarray, hashes: list[bytes],
                      remaining: int) -> None:
        out = ReplyStream(self.bus, req.reply_to, req.request_id, seq_start=req.seq_start)
        t0 = time.perf_counter()
        t_recv = time.time()
        try:
            pulled_ok = True
            address = await self._peer_address(req.source_node) if hashes else None
            if hashes:
                self._m_loads_planned.add(1, {"role": self.role, "stage": "handoff"})
            if hashes and address is None:  # recomputed: a fallback like any other
                pulled_ok = False
                self._m_fallbacks.add(1, {"role": self.role, "stage": "handoff",
                                          "reason": ErrorCode.UNAVAILABLE.value})
                self.log.warning("decode.peer_unknown", peer=req.source_node)
            if hashes and address is not None:
                error = ""
                try:
                    await self.client.pull(address, hashes, self.kv, namespace=req.namespace,
                                           capability=req.capability)
                except CpdError as e:  # recompute what could not be pulled
                    pulled_ok = False
                    error = e.code.value
                    self._m_fallbacks.add(1, {"role": self.role, "stage": "handoff",
                                              "reason": error})
                    self.log.warning("decode.pull_failed", peer=req.source_node,
                                     error=e.code.value, detail=e.message)
                if self.audit is not None:
                    self.audit.pulled("handoff", req.source_node, req.namespace, hashes,
                                      t_recv, error)
            with contextlib.suppress(CpdError):
                await self.bus.publish(subjects.pull_ack(req.source_node), wire.PullAck(
                    request_id=req.request_id, lease_id=req.lease_id, ok=pulled_ok))
            t_pull = time.perf_counter()
            full = np.append(tokens, np.asarray(req.first_token, dtype=wire.TOKEN_DTYPE))
            usable = (len(full) - 1) // self.block_size
            have = self._sealed_prefix(hashes[:usable])
            if self.audit is not None and have:
                self._audit_load(req.namespace, have)
            lease = f"decode-{req.request_id}-{uuid.uuid4().hex[:6]}"
            if have:
                self.kv.pin(lease, [e.hash for e in have], self.settings.dataplane.pin_ttl_s)
            assert self.engine is not None
            ereq = EngineRequest(request_id=req.request_id, tokens=full,
                                 sampling=_with_max_tokens(req.sampling, remaining),
                                 load_slots=[e.slot for e in have],
                                 load_checksums=[e.checksum for e in have],
                                 cache_salt=self._salt(req.namespace))
            self.in_flight += 1
            self._load_changed()  # decode is chosen by load: the next router must see it
            generated = 1
            last = EngineStep()
            interval = self.settings.worker.stream_interval
            pending: list[int] = []
            try:
                async for step in self.engine.generate(ereq):
                    if step.token_ids:
                        generated += len(step.token_ids)
                        pending += step.token_ids
                        if len(pending) >= interval:
                            await out.tokens(pending)
                            pending = []
                    last = step
                if pending:
                    await out.tokens(pending)
            finally:
                self.in_flight -= 1
                self._load_changed()
                if have:
                    self.kv.unpin(lease)
            if last.failed_blocks:
                await self._drop_corrupt([e.hash for e in have])
            t_end = time.perf_counter()
            self._m_phase.record(t_pull - t0, {"role": self.role, "phase": "pull"})
            self._m_phase.record(t_end - t_pull, {"role": self.role, "phase": "decode"})
            self._m_kv_bytes.add(last.loaded_blocks * self.kv.store.slot_bytes,
                                 {"role": self.role, "direction": "load"})
            route = wire.Route(**{**_route_fields(req.route), "decode_node": self.node_id,
                                  "decode_tokens_pulled": last.loaded_blocks * self.block_size,
                                  "decode_tokens_computed": len(full) - last.cached_tokens})
            timings = wire.Timings(**{**_timing_fields(req.timings),
                                      "handoff_ms": (t_pull - t0) * 1e3,
                                      "decode_ms": (t_end - t_pull) * 1e3})
            await out.final(finish_reason=last.finish_reason or "length",
                            usage=wire.Usage(prompt_tokens=len(tokens),
                                             completion_tokens=generated,
                                             cached_tokens=req.route.tokens_gpu
                                             + req.route.tokens_dram + req.route.tokens_remote),
                            timings=timings, route=route)
        except Exception as e:
            self.log.warning("decode.failed", error=repr(e))
            self._count_stream_rejection(e)
            await out.error(e)
        finally:
            self._running.discard(req.request_id)


def _check_ids(*, reply_to: str = "", **nodes: str) -> None:
    """Refuse a request whose stream inbox or peer node ids could not be published to
    (checked before acceptance: later they would fail as internal errors)."""
    try:
        if reply_to:
            subjects.check_reply_subject(reply_to)
        for what, node in nodes.items():
            subjects.check_token(node, what)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _shm_name(kind: str, node: str, epoch: int) -> str:
    # The owner's pid in the name tells a crashed predecessor's leftovers from a live
    # process's files (two clusters on one host may reuse node ids).
    return f"cpd-{kind}-{node}-{epoch}-{os.getpid()}"


def _remove_stale_files(folder: Path, node: str) -> None:
    """Shared memory is only freed when its file goes: remove what dead incarnations of
    ``node`` left behind, never a live process's."""
    for kind in ("arena", "kvevents"):
        for path in folder.glob(f"cpd-{kind}-{node}-*-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prefault(arena: np.ndarray) -> None:
    """Back every page of ``arena`` with memory now, one write per page: a first write
    to a page costs a fault (in a virtual machine also the host's), which on the transfer
    path made a pull into fresh 1 MiB slots cost ~4 ms a block instead of ~0.5 ms
    (docs/architecture.md, "KV tiers and the data plane")."""
    flat = arena.reshape(-1)
    flat[::mmap.PAGESIZE] = 0


def _with_max_tokens(s: wire.SamplingParams, n: int) -> wire.SamplingParams:
    return msgspec.structs.replace(s, max_tokens=n)


def _route_fields(r: wire.Route) -> dict:
    return msgspec.structs.asdict(r)


def _timing_fields(t: wire.Timings) -> dict:
    return msgspec.structs.asdict(t)


def run_worker(role: str = "", settings: Settings | None = None) -> None:
    """Run one worker until SIGTERM/SIGINT: the entry point of ``python -m
    services.<role>``, of ``python -m services.worker`` and of ``cpd serve``, in ``role``
    or else ``worker.role``; ``settings`` default to the environment's."""
    from cpd.bus import run_service
    from cpd.ops.config import load_settings

    settings = settings or load_settings()
    role = role or settings.worker.role
    if not role:
        raise SystemExit("services.worker: set worker.role (CPD_WORKER__ROLE) to one of "
                         f"{', '.join(WORKER_ROLES)}, or run python -m services.<role>")
    telemetry.setup(role, settings.telemetry)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.worker.engine_kv_cache_gib))
    run_service(WorkerService(settings, role))
