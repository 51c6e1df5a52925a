"""What a worker's request handlers share, built in full before the first request: the
engine, the block store and its data plane (UCX server and client), the prefix loader,
the peers, the held load, the capability keyring, and the checks every request passes.

A handler gets a :class:`WorkerCore` and nothing that may still be missing: the service
builds the core with :meth:`WorkerCore.build` once NATS is up (the engine and the arena
come before, from :class:`EngineParts`)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from opentelemetry.metrics import Observation

from cpd.bus import BAD_INPUT, Bus, KeepAlives
from cpd.engines import Engine, EngineStep
from cpd.engines.servedmodel import ServedModel
from cpd.kvstore import (
    BlockEntry,
    BlockStore,
    CopiesFirstGate,
    DiskTier,
    KvStore,
    evicts_copies_first,
)
from cpd.kvstore import events as kvevents
from cpd.ops import metrics, telemetry
from cpd.ops.audit import AuditLog
from cpd.ops.config import Settings
from cpd.protocol.capability import Keyring
from cpd.protocol.errors import (
    Cancelled,
    CpdError,
    ErrorCode,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
)
from cpd.protocol.hashing import Namespace
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.roles import Role
from cpd.transfer import TransferClient, TransferServer, init_ucx
from services.worker.arena import Arena
from services.worker.load import WorkerLoad
from services.worker.loader import PrefixLoader
from services.worker.peers import Peers
from services.worker.requests import choice_id

Spawn = Callable[..., Any]
"""``Service.spawn``: run a task the service owns (drained or cancelled at stop)."""

_CANCELLED_KEPT = 4096


@dataclass
class EngineParts:
    """What a worker starts before it connects to NATS (an engine can block the event
    loop for minutes, which a live connection would not survive)."""

    model: ServedModel
    arena: Arena
    engine: Engine


@dataclass
class _Instruments:
    kv_bytes: Any
    phase: Any
    queue: Any


@dataclass
class WorkerCore:
    """The shared state and checks of one worker process's handlers."""

    settings: Settings
    node_id: str
    bus: Bus
    log: Any
    spawn: Spawn
    reject: Callable[[str, CpdError], None]
    parts: EngineParts
    kv: KvStore
    server: TransferServer
    client: TransferClient
    loader: PrefixLoader
    load: WorkerLoad
    keyring: Keyring
    metrics: _Instruments
    keepalives: KeepAlives
    """This node's streams to the router, kept from going silent once a message went
    out: the router then notices a stream whose later messages were lost."""
    running: set[tuple[str, str]] = field(default_factory=set)
    """(handler, request id) of the requests held here: an engine refuses a duplicate
    id with an untyped error. A prefill's hand-off to this same process's decode
    handler holds one of each for a moment (the prefill's engine run is over by then)."""
    cancelled: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Request ids a router cancelled, the latest :data:`_CANCELLED_KEPT`: one may be
    cancelled before it reaches this node (a hand-off still on its way)."""
    choices: dict[str, int] = field(default_factory=dict)
    """Requests of several choices generating here, with their number: the engine runs
    them under their choices' ids (:func:`~services.worker.requests.choice_id`)."""

    @classmethod
    async def build(cls, settings: Settings, role: str, *, parts: EngineParts, bus: Bus,
                    epoch: int, keyring: Keyring, peers: Peers, load: WorkerLoad,
                    log: Any, spawn: Spawn,
                    reject: Callable[[str, CpdError], None]) -> WorkerCore:
        """The block store on the arena (its lifecycle events into ``CPD_KV``), the UCX
        server and client, and the prefix loader; on failure, whatever was opened is
        closed again."""
        node = settings.node.node_id
        slots = parts.arena.slots
        js = bus.nc.jetstream()  # CPD_KV exists: the service ensured it for its epoch
        mode = settings.dataplane.decode_copies_first
        kv = KvStore(BlockStore(slots.shape[1], slots.shape[0], node=node, arena=slots,
                                capability=keyring.issue,
                                eviction=settings.dataplane.eviction,
                                copies_first=evicts_copies_first(role, mode)),
                     kvevents.KvEventPublisher(js, node, epoch=epoch),
                     disk=_disk_tier(settings, node, slots.shape[1], keyring),
                     gate=CopiesFirstGate(mode) if role == Role.DECODE else None)
        opened: list[Any] = [kv]
        try:
            await kv.start(bus.nc, sweep_interval_s=settings.dataplane.lease_sweep_interval_s,
                           on_reject=reject)
            init_ucx(settings.dataplane)
            server = await TransferServer(kv, settings.dataplane, keyring=keyring).start()
            opened.append(server)
            audit = None
            if settings.worker.audit_dir:  # the fault harness's evidence (cpd.ops.audit)
                audit = server.audit = AuditLog(settings.worker.audit_dir, node)
            client = TransferClient(settings.dataplane)
            opened.append(client)
        except BaseException:
            for part in reversed(opened):
                with contextlib.suppress(Exception):
                    await part.close()
            raise
        loader = PrefixLoader(role, kv, client, peers, bus=bus, audit=audit, log=log)
        return cls(settings=settings, node_id=node, bus=bus, log=log, spawn=spawn,
                   reject=reject, parts=parts, kv=kv, server=server, client=client,
                   loader=loader, load=load, keyring=keyring,
                   metrics=_instruments(role, node, kv),
                   keepalives=KeepAlives(settings.router.keepalive_interval_s, log=log,
                                         before_first=False))

    @property
    def engine(self) -> Engine:
        return self.parts.engine

    @property
    def namespace(self) -> Namespace:
        """The served model's base namespace."""
        return self.parts.model.namespace

    @property
    def vocab_size(self) -> int:
        return self.parts.model.vocab_size

    @property
    def block_size(self) -> int:
        return self.settings.cache.block_size

    async def close(self) -> None:
        """Close the data plane and the store (the engine and arena are the service's)."""
        for part in (self.client, self.server, self.kv):
            with contextlib.suppress(Exception):
                await part.close()

    # ------------------------------------------------------------- admission

    def admit(self, prompt_tokens: int, max_tokens: int, deadline_ms: int) -> None:
        """Refuse, with a typed error, what this worker cannot or should not take."""
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
        if len(self.running) >= self.settings.worker.max_queued_requests:
            raise Overloaded(f"{self.node_id} holds {len(self.running)} requests")

    def claim(self, handler: str, request_id: str) -> None:
        """Mark ``request_id`` running in ``handler`` (until it is discarded from
        :attr:`running`), refusing one that already is."""
        key = (handler, request_id)
        if key in self.running:
            raise InvalidRequest(f"request {request_id[:80]!r} is already running here")
        self.running.add(key)

    async def cancel(self, request_id: str, choice: int | None = None) -> None:
        """Stop generating ``request_id`` (or only its ``choice``): aborted in the engine
        if it runs here; a whole request is remembered, so a hand-off of it that comes
        later is refused."""
        n = self.choices.get(request_id, 0)
        if choice is None:
            self.cancelled[request_id] = None
            while len(self.cancelled) > _CANCELLED_KEPT:
                self.cancelled.popitem(last=False)
            runs = ([choice_id(request_id, i) for i in range(n)] if n else
                    [request_id] if any(rid == request_id for _, rid in self.running) else [])
        else:
            runs = [choice_id(request_id, choice)] if choice < n else []
        for run in runs:
            self.log.info("worker.cancel", cancelled_request=run)
            await self.engine.abort(run)

    def check_not_cancelled(self, request_id: str) -> None:
        """Raise :class:`~cpd.protocol.errors.Cancelled` if a router cancelled it."""
        if request_id in self.cancelled:
            raise Cancelled(f"request {request_id[:80]!r} was cancelled")

    @staticmethod
    def queued(submitted: float, step: EngineStep) -> float:
        """Seconds the request of ``step`` (its last) waited in the engine since it was
        ``submitted`` (``time.monotonic()``); 0 when the engine does not say."""
        return max(0.0, step.scheduled_at - submitted) if step.scheduled_at else 0.0

    def check_vocab(self, tokens: np.ndarray) -> None:
        """Token ids an engine would index its embedding with: past the vocabulary they
        crash a real engine, so they are refused here."""
        self.parts.model.check_vocab(tokens)

    def count_stream_rejection(self, subject: str, e: BaseException) -> None:
        """Bad input found after the request was accepted (its error goes on the stream)
        is a rejection all the same."""
        if isinstance(e, CpdError) and e.code in BAD_INPUT:
            self.reject(subject, e)

    def salt(self, namespace: str) -> str:
        """vLLM cache salt of a request: tenants' namespaces never share engine blocks."""
        return "" if namespace == self.namespace.id else namespace

    # ------------------------------------------------------------- blocks

    @contextlib.asynccontextmanager
    async def pinned(self, kind: str, request_id: str,
                     entries: list[BlockEntry]) -> AsyncIterator[None]:
        """``entries`` pinned for an engine run (eviction cannot take a block the engine
        is loading) and unpinned after it."""
        lease = self._pin(kind, request_id, [e.hash for e in entries])
        try:
            yield
        finally:
            if entries:
                self.kv.unpin(lease)

    def pin_for_handoff(self, request_id: str, hashes: list[bytes]) -> str:
        """Pin a request's blocks until its decode node acks the pull (or the lease's
        time runs out: the store's sweep expires it); the lease id."""
        return self._pin("handoff", request_id, hashes)

    def _pin(self, kind: str, request_id: str, hashes: list[bytes]) -> str:
        lease = f"{kind}-{request_id}-{uuid.uuid4().hex[:6]}"
        if hashes:
            self.kv.pin(lease, hashes, self.settings.dataplane.pin_ttl_s)
        return lease

    async def drop_corrupt(self, loaded: list[bytes]) -> None:
        """The engine refused some loaded blocks (checksum): they were recomputed, and
        whichever no longer match their seal leave the store and kvindex for good."""
        store = self.kv.store
        bad = [h for h in loaded if h in store
               and store.get(h).state is BlockState.SEALED  # type: ignore[union-attr]
               and not store.intact(h)]
        if bad:
            await self.kv.discard(bad, "checksum mismatch on load")

    def record(self, role: str, phases: dict[str, float], *, queued: float = 0.0,
               written: int = 0, loaded: int = 0) -> None:
        """Phase durations and engine queue time (seconds), and KV bytes written and
        loaded (blocks)."""
        for phase, seconds in phases.items():
            self.metrics.phase.record(seconds, {"role": role, "phase": phase})
        self.metrics.queue.record(queued, {"role": role})
        slot = self.kv.store.slot_bytes
        if written:
            self.metrics.kv_bytes.add(written * slot, {"role": role, "direction": "write"})
        if loaded:
            self.metrics.kv_bytes.add(loaded * slot, {"role": role, "direction": "load"})


def _disk_tier(settings: Settings, node: str, slot_bytes: int,
               keyring: Keyring) -> DiskTier | None:
    """The node's disk tier (``dataplane.disk_dir``), in a folder of its own."""
    dp = settings.dataplane
    if not dp.disk_dir:
        return None
    return DiskTier(Path(dp.disk_dir) / node, dp.disk_bytes, slot_bytes, node=node,
                    capability=keyring.issue, eviction=dp.eviction, fsync=dp.disk_fsync)


def _instruments(role: str, node: str, kv: KvStore) -> _Instruments:
    m = telemetry.meter()
    attrs = {"role": role, "node": node}
    store = kv.store
    if kv.disk is not None:
        _disk_instruments(m, attrs, kv.disk)
    kv_bytes = metrics.counter(m, metrics.WORKER_KV, [
        {"role": role, "direction": d} for d in ("write", "load")])
    metrics.gauge(m, metrics.WORKER_DRAM_USED,
                  lambda _: [Observation(store.used_bytes, attrs)])
    metrics.gauge(m, metrics.WORKER_DRAM_CAPACITY,
                  lambda _: [Observation(store.total_bytes, attrs)])
    metrics.observed_counter(m, metrics.WORKER_EVICTIONS,
                             lambda _: [Observation(store.evictions, attrs)])
    metrics.gauge(m, metrics.WORKER_COPIES_FIRST,
                  lambda _: [Observation(int(store.copies_first), attrs)])
    return _Instruments(kv_bytes=kv_bytes, phase=metrics.histogram(m, metrics.WORKER_PHASE),
                        queue=metrics.histogram(m, metrics.WORKER_QUEUE))


def _disk_instruments(m: Any, attrs: dict[str, str], disk: DiskTier) -> None:
    metrics.gauge(m, metrics.WORKER_DISK_USED,
                  lambda _: [Observation(disk.used_bytes, attrs)])
    metrics.gauge(m, metrics.WORKER_DISK_CAPACITY,
                  lambda _: [Observation(disk.total_bytes, attrs)])
    metrics.observed_counter(m, metrics.WORKER_DISK_BLOCKS, lambda _: [
        Observation(n, {**attrs, "op": op}) for op, n in (
            ("written", disk.written), ("read", disk.read), ("dropped", disk.dropped),
            ("evicted", disk.index.evictions))])
