"""The one worker base behind ``services/{preprefill,prefill,decode}`` (docs/architecture.md,
"Services").

The role is configuration: prefill-side roles (``preprefill``, ``prefill``) serve
``PrefillRequest``s, the ``decode`` role serves ``DecodeRequest``s. Both own:

* a block arena in shared memory, managed by :class:`cpd.kvstore.KvStore` (lifecycle
  events into ``CPD_KV``) and mapped by the engine's KV connector;
* a UCX :class:`~cpd.transfer.TransferServer` (its address goes in the heartbeat) and a
  :class:`~cpd.transfer.TransferClient` for pulls from peers;
* heartbeats (the lease) and load reports.

Apart from this module: ``arena`` (the arena's shared-memory files), ``peers`` (peer
addresses from heartbeats, connect-ahead), ``loader`` (pulls from peers and their
fallback accounting) and ``load`` (held work, the load report).

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
import os
import time
import uuid

import msgspec
import numpy as np
from nats.aio.msg import Msg
from opentelemetry.metrics import Observation

from cpd.bus import BAD_INPUT, ReplyStream, Request, Service
from cpd.engines import Engine, EngineRequest, EngineStep
from cpd.engines.profile import CacheEventBridge, engine_profile
from cpd.kvstore import BlockStore, KvStore
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
from services.worker.arena import Arena
from services.worker.load import WorkerLoad
from services.worker.loader import PrefixLoader
from services.worker.peers import Peers


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
        self.peers = Peers(self.node_id, role,
                           heartbeat_interval_s=settings.node.heartbeat_interval_s,
                           connect_ahead_delay_s=settings.dataplane.connect_ahead_delay_s,
                           log=self.log)
        self.load = WorkerLoad(initial_ms_per_token=settings.worker.initial_ms_per_token,
                               on_change=self._load_changed)
        self.arena: Arena | None = None
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
        self.arena = arena = Arena.create(s.worker.arena_dir, self.node_id, self.epoch,
                                          arena_bytes=s.dataplane.arena_bytes,
                                          slot_bytes=self.profile.slot_bytes)
        if s.worker.prefault_arena:
            await asyncio.to_thread(arena.prefault)
        # The engine's KV events go to arena.kv_events_endpoint (vLLM; the sim engine's
        # stay in process).
        self.engine = self.profile.build_engine(
            self.role, model, arena.spec, kv_events_endpoint=arena.kv_events_endpoint)
        await self.engine.start()

    async def setup(self) -> None:
        s = self.settings
        assert self.arena is not None
        arena = self.arena.slots
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
        self.loader = PrefixLoader(self.role, self.kv, self.client, self.peers,
                                   audit=self.audit, log=self.log)
        assert self.kv.publisher is not None
        self._bridge = self.profile.cache_event_bridge(
            self.engine, self.kv.publisher, self.namespace,
            kv_events_endpoint=self.arena.kv_events_endpoint)
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
            self.spawn(self.peers.connect_ahead(self.client, lambda: self.stopping),
                       "connect-ahead")
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
        if self.arena is not None:
            self.arena.remove()

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
        return self.load.report(
            self.node_id, self.role, self.kv.store, kv_bandwidth_gbps=self.client.meter.gbps,
            prefill_token_cap=self.settings.worker.long_prefill_token_threshold)

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
        self.peers.heard(hb)

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
        with self.load.holding(pending, len(tokens) - pending) as held:
            loaded, remote, load_error = await self._gather_prefix(req, hashes)
            t_load = held.engine_start = time.perf_counter()
            step, saved = await self._run_prefill(req, tokens, hashes, loaded)
        t_done = time.perf_counter()
        attrs = {"role": self.role}
        self._m_phase.record(t_load - t0, {**attrs, "phase": "load"})
        self._m_phase.record(t_done - t_load, {**attrs, "phase": "prefill"})
        slot = self.kv.store.slot_bytes
        self._m_kv_bytes.add(len(saved) * slot, {**attrs, "direction": "write"})
        self._m_kv_bytes.add(step.loaded_blocks * slot, {**attrs, "direction": "load"})
        computed = len(tokens) - step.cached_tokens
        self.load.prefill_took(computed, t_done - t_load)
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
        failure: wire.LoadError | None = None
        if any(src.node != self.node_id and src.num_blocks for src in req.sources):
            self.loader.planned("prefix")
        for src in sorted(req.sources, key=lambda x: x.first_block):
            want = hashes[src.first_block:src.first_block + src.num_blocks]
            if src.node == self.node_id or not want:
                continue
            got, failure = await self.loader.pull("prefix", src.node, want,
                                                  namespace=req.namespace,
                                                  capability=src.capability)
            remote += got
            if failure is not None:  # recompute from here
                break
        have = [e.hash for e in self.loader.sealed_prefix(hashes)]
        return have, min(remote, len(have)), failure

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
        if loaded:
            self.loader.audit_load(req.namespace, [e for e in entries_loaded if e is not None])
        ereq = EngineRequest(
            request_id=req.request_id, tokens=tokens,
            sampling=_with_max_tokens(req.sampling, 1),
            load_slots=[e.slot for e in entries_loaded if e is not None],
            load_checksums=[e.checksum for e in entries_loaded if e is not None],
            save_slots=save, cache_salt=self._salt(req.namespace))
        try:
            with self.load.running():
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
        held = [e.hash for e in self.loader.sealed_prefix(hashes)]
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
        try:
            pulled_ok = True
            if hashes:  # what cannot be pulled is recomputed: a fallback like any other
                self.loader.planned("handoff")
                _, failure = await self.loader.pull("handoff", req.source_node, hashes,
                                                    namespace=req.namespace,
                                                    capability=req.capability)
                pulled_ok = failure is None
            with contextlib.suppress(CpdError):
                await self.bus.publish(subjects.pull_ack(req.source_node), wire.PullAck(
                    request_id=req.request_id, lease_id=req.lease_id, ok=pulled_ok))
            t_pull = time.perf_counter()
            full = np.append(tokens, np.asarray(req.first_token, dtype=wire.TOKEN_DTYPE))
            usable = (len(full) - 1) // self.block_size
            have = self.loader.sealed_prefix(hashes[:usable])
            self.loader.audit_load(req.namespace, have)
            lease = f"decode-{req.request_id}-{uuid.uuid4().hex[:6]}"
            if have:
                self.kv.pin(lease, [e.hash for e in have], self.settings.dataplane.pin_ttl_s)
            assert self.engine is not None
            ereq = EngineRequest(request_id=req.request_id, tokens=full,
                                 sampling=_with_max_tokens(req.sampling, remaining),
                                 load_slots=[e.slot for e in have],
                                 load_checksums=[e.checksum for e in have],
                                 cache_salt=self._salt(req.namespace))
            generated = 1
            last = EngineStep()
            interval = self.settings.worker.stream_interval
            pending: list[int] = []
            try:
                # Reported at once: decode is chosen by load, the next router must see it.
                with self.load.running(report=True):
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
