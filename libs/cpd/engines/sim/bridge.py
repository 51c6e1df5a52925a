"""The sim engine's prefix-cache changes, forwarded into ``CPD_KV`` as GPU-tier events:
what :mod:`cpd.engines.vllm.gpu_events` does for vLLM."""

from __future__ import annotations

import asyncio
import contextlib

from cpd.kvstore import KvEventPublisher
from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import CpdError

from .cacheevents import CacheCleared, CacheEvent, CacheRemoved, CacheStored
from .engine import SimEngine

# Blocks per forwarded event: keeps each JetStream message far below the payload limit
# (a 200K-token prompt stored at once would be ~800 KB of token ids).
_EVENT_BLOCKS = 64

log = telemetry.get_logger("cpd.engines.sim")


class SimCacheEventBridge:
    """Forwards a :class:`SimEngine`'s prefix-cache changes to kvindex as GPU-tier events,
    in order, off the engine's step loop (which must not wait on JetStream)."""

    def __init__(self, engine: SimEngine, publisher: KvEventPublisher, namespace: str,
                 namespace_spec: bytes = b"") -> None:
        self.engine = engine
        self.publisher = publisher
        self.namespace = namespace
        self.namespace_spec = namespace_spec
        self.forwarded = 0
        self._queue: asyncio.Queue[CacheEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.engine.cache_listener = self._queue.put_nowait
        self._task = asyncio.create_task(self._run(), name="sim-cache-events")

    async def close(self) -> None:
        self.engine.cache_listener = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            event = await self._queue.get()
            for ev in self._convert(event):
                try:
                    await self.publisher.publish(ev)
                    self.forwarded += 1
                except CpdError as e:  # kvindex learns it later (re-announce, reset)
                    log.warning("sim_cache_events.publish_failed", error=e.message)

    def _convert(self, event: CacheEvent) -> list[wire.KvEvent]:
        node, ns, gpu = self.publisher.node, self.namespace, wire.Tier.GPU
        if isinstance(event, CacheCleared):
            return [wire.NodeCleared(node=node, seq=0, tier=gpu)]
        if isinstance(event, CacheRemoved):
            return [wire.GpuBlocksRemoved(node=node, seq=0, namespace=ns, tier=gpu,
                                          engine_hashes=list(event.hashes[i:i + _EVENT_BLOCKS]))
                    for i in range(0, len(event.hashes), _EVENT_BLOCKS)]
        assert isinstance(event, CacheStored)
        bs = len(event.tokens) // len(event.hashes)
        out: list[wire.KvEvent] = []
        for i in range(0, len(event.hashes), _EVENT_BLOCKS):
            part = event.hashes[i:i + _EVENT_BLOCKS]
            out.append(wire.GpuBlocksStored(
                node=node, seq=0, namespace=ns, tier=gpu, engine_hashes=list(part),
                parent_engine_hash=event.hashes[i - 1] if i else event.parent,
                tokens=wire.pack_tokens(event.tokens[i * bs:(i + len(part)) * bs]),
                engine_block_size=bs, namespace_spec=self.namespace_spec))
        return out
