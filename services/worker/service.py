"""The worker process behind ``services/{preprefill,prefill,decode}`` (docs/architecture.md,
"Services"): node presence (heartbeats carrying its lease and data-plane address, load
reports, peers' addresses, connect-ahead) and the request handlers its role serves over
one :class:`~services.worker.core.WorkerCore`.

The role is configuration: prefill-side roles (``preprefill``, ``prefill``) serve
``PrefillRequest``s (:mod:`services.worker.prefill`), ``decode`` serves
``DecodeRequest``s (:mod:`services.worker.decode`); one process can host both handlers
(``handlers``), and a hand-off between them stays in its own store.

Apart from this module: ``core`` (what the handlers share), ``arena`` (the arena's
shared-memory files), ``peers`` (peer addresses from heartbeats, connect-ahead),
``loader`` (pulls from peers and their fallback accounting), ``load`` (held work, the
load report) and ``requests`` (per-request checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Protocol

from nats.aio.msg import Msg

from cpd.bus import Request, Service
from cpd.engines.profile import CacheEventBridge, engine_profile
from cpd.kvstore import events as kvevents
from cpd.ops import telemetry
from cpd.ops.config import Settings
from cpd.ops.cpuset import lower_descendants
from cpd.protocol import subjects, wire
from cpd.protocol.capability import Keyring
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.roles import PREFILL_ROLES, WORKER_ROLES, Role
from cpd.transfer import decode_address
from services.worker.arena import Arena
from services.worker.core import EngineParts, WorkerCore
from services.worker.decode import DecodeHandler
from services.worker.load import WorkerLoad
from services.worker.peers import Peers
from services.worker.prefill import PrefillHandler


class Handler(Protocol):
    """A request handler hosted by a worker process."""

    async def attach(self, service: Service) -> None:
        """Register its endpoints and subscriptions on ``service``."""


class WorkerService(Service):
    """A pre-prefill, prefill or decode worker. ``handlers``: the kinds of request it
    serves (its role's by default; a prefill-side role may add ``Role.DECODE``)."""

    def __init__(self, settings: Settings, role: str, *, nats_url: str | None = None,
                 handlers: Sequence[Role] = ()) -> None:
        if role not in WORKER_ROLES:
            raise ValueError(f"unknown worker role {role!r}")
        self.name = role
        super().__init__(settings, nats_url=nats_url)
        self.role = Role(role)
        # worker.serve_decode: a prefill-side node takes decode hand-offs too.
        both = (self.role, Role.DECODE) if (settings.worker.serve_decode
                                            and self.role in PREFILL_ROLES) else ()
        self.handler_kinds = tuple(dict.fromkeys(handlers or both or (self.role,)))
        if not set(self.handler_kinds) <= {self.role, Role.DECODE}:
            raise ValueError(f"a {role} worker hosts its own role's handler and decode's, "
                             f"not {', '.join(self.handler_kinds)}")
        self.profile = engine_profile(settings)
        # This incarnation: its start time in ms until NATS is up, then past the last
        # epoch CPD_KV holds for this node (setup: kvstore.events.next_epoch), so a clock
        # set back never makes kvindex take the new incarnation's events for stale ones.
        self.epoch = int(time.time() * 1000)
        # This incarnation's data-plane secret: peers read our blocks only with a
        # capability issued from it (sealed events → kvindex → router, or our hand-off);
        # a restart draws a new one, which voids every capability of the old epoch.
        self.keyring = Keyring(self.node_id, self.epoch)
        self.peers = Peers(self.node_id, role,
                           heartbeat_interval_s=settings.node.heartbeat_interval_s,
                           connect_ahead_delay_s=settings.dataplane.connect_ahead_delay_s,
                           log=self.log)
        self.load = WorkerLoad(on_change=self._load_changed)
        self._parts: EngineParts | None = None
        self._arena: Arena | None = None
        self._bridge: CacheEventBridge | None = None
        self._load_queued = False
        self.core: WorkerCore | None = None

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """The model, the block arena and the engine, before NATS: an engine takes from
        seconds to minutes to start and blocks the event loop meanwhile, which a live
        NATS connection would not survive (the server drops it as stale)."""
        s = self.settings
        model = await asyncio.to_thread(self.profile.served_model)
        self._arena = arena = Arena.create(s.worker.arena_dir, self.node_id, self.epoch,
                                           arena_bytes=s.dataplane.arena_bytes,
                                           slot_bytes=self.profile.slot_bytes)
        if s.worker.prefault_arena:
            await asyncio.to_thread(arena.prefault)
        # The engine's KV events go to arena.kv_events_endpoint (vLLM; the sim engine's
        # stay in process).
        engine = self.profile.build_engine(
            self.role, model, arena.spec, kv_events_endpoint=arena.kv_events_endpoint)
        self._parts = EngineParts(model=model, arena=arena, engine=engine)
        await engine.start()
        if s.worker.engine_nice:
            lowered = lower_descendants(s.worker.engine_nice)
            self.log.info("worker.engine_niceness", nice=s.worker.engine_nice,
                          threads=lowered)

    async def setup(self) -> None:
        assert self._parts is not None
        s = self.settings
        js = self.bus.nc.jetstream()
        await kvevents.ensure_stream(js, update=False)  # kvindex owns its limits
        last = await kvevents.last_epoch(js, self.node_id)
        epoch = kvevents.next_epoch(self.epoch, last)
        if epoch != self.epoch:
            self.log.warning("worker.epoch_past_clock", clock_ms=self.epoch, last_epoch=last,
                             epoch=epoch)
            self.epoch, self.keyring = epoch, Keyring(self.node_id, epoch)
        self.core = core = await WorkerCore.build(
            s, self.role, parts=self._parts, bus=self.bus, epoch=self.epoch,
            keyring=self.keyring, peers=self.peers, load=self.load, log=self.log,
            spawn=self.spawn, reject=self.reject)
        assert core.kv.publisher is not None
        self._bridge = self.profile.cache_event_bridge(
            core.engine, core.kv.publisher, core.namespace,
            kv_events_endpoint=self._parts.arena.kv_events_endpoint)
        await self._bridge.start()
        await self.bus.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        handlers: list[Handler] = [
            PrefillHandler(core, self.role) if kind in PREFILL_ROLES else DecodeHandler(core)
            for kind in self.handler_kinds]
        for handler in handlers:
            await handler.attach(self)
        await self.add_endpoint("admin", subjects.admin(self.role, self.node_id),
                                self._on_reset, expect=wire.ResetCache)
        await self.bus.nc.subscribe(subjects.cancel(self.node_id), cb=self._on_cancel)
        await self._heartbeat()
        self.spawn(self._heartbeats(), "heartbeats")
        if s.dataplane.connect_ahead:
            self.spawn(self.peers.connect_ahead(core.client, lambda: self.stopping),
                       "connect-ahead")
        self.spawn(self._load_reports(), "load-reports")
        self.spawn(core.keepalives.run(lambda: self.stopping), "keepalives")

    async def on_stop(self) -> None:
        # Also runs after a start that failed part-way: release whatever exists.
        if self._bridge is not None:
            await self._bridge.close()
        if self._parts is not None:
            await self._parts.engine.stop()
        if self.core is not None:
            await self.core.close()
        if self._arena is not None:
            self._arena.remove()

    async def _on_reset(self, req: wire.ResetCache, _: Request) -> wire.Accepted:
        assert self.core is not None
        if not await self.core.engine.reset_prefix_cache():
            raise CpdError("engine prefix cache busy (requests running)",
                           code=ErrorCode.UNAVAILABLE, retryable=True)
        self.log.info("worker.prefix_cache_reset", reason=req.reason)
        return wire.Accepted(request_id="", node=self.node_id)

    async def _on_cancel(self, msg: Msg) -> None:
        assert self.core is not None
        req = self.decode_or_reject(msg, wire.Cancel)
        if req is not None:
            await self.core.cancel(req.request_id, req.choice)

    # ------------------------------------------------------------- liveness, load

    def heartbeat_message(self) -> wire.Heartbeat:
        """This node's heartbeat: its lease, data-plane address and namespace."""
        assert self.core is not None
        core = self.core
        return wire.Heartbeat(
            node=self.node_id, role=self.role, started_unix_ms=self.epoch,
            lease_ttl_ms=int(self.settings.node.lease_ttl_s * 1000),
            ucx_address=core.server.address, capacity_blocks=core.kv.store.num_slots,
            namespace=core.namespace.id, namespace_spec=core.namespace.to_spec(),
            version=self.version,
            decodes=self.role in PREFILL_ROLES and Role.DECODE in self.handler_kinds)

    async def _heartbeat(self) -> None:
        with contextlib.suppress(CpdError):
            await self.bus.publish(subjects.heartbeat(self.node_id), self.heartbeat_message())

    async def _heartbeats(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.node.heartbeat_interval_s)
            await self._heartbeat()

    def load_report(self) -> wire.LoadReport:
        """This node's load as routers read it."""
        assert self.core is not None
        return self.load.report(
            self.node_id, self.role, self.core.kv,
            kv_bandwidth_gbps=self.core.client.meter.gbps,
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
        if not self._load_queued and self.core is not None:
            self._load_queued = True
            self.spawn(self._publish_load(), "load-report")

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self.decode_from_sender(msg, wire.Heartbeat)
        if hb is None or not hb.ucx_address:
            return
        try:  # an address no pull could use must not replace a peer's good one
            decode_address(hb.ucx_address)
        except CpdError as e:
            self.reject(msg.subject, e)
            return
        self.peers.heard(hb)


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
