"""The simulated engine in a deployment (``worker.engine = "sim"``, DESIGN.md §9): what
workers and the router derive from the ``[sim]`` settings so that they agree.

* the cache namespace (no model files: the preset and the vocabulary stand for them);
* the arena slot size: the preset's KV bytes of one block divided by
  ``sim.kv_scale_down``, so real (scaled-down) bytes cross the real data plane;
* the router's prefill cost seeds: the preset's coefficients in wall milliseconds;
* the engine itself, per role (decode nodes may use their own preset);
* the bridge of its GPU prefix-cache events into ``CPD_KV`` (what
  :mod:`cpd.engine.gpu_events` does for vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib

from cpd import telemetry, wire
from cpd.config import Settings
from cpd.engine.protocol import ArenaSpec
from cpd.errors import CpdError
from cpd.hashing import Namespace
from cpd.kvevents import KvEventPublisher

from .costmodel import CostModel, preset
from .engine import CacheCleared, CacheEvent, CacheRemoved, CacheStored, SimEngine
from .scheduler import SchedulerConfig

# Bump when the sim's token or KV-byte derivation changes: old blocks must not match.
SIM_REVISION = "sim1"
# KV "dtype" of the namespace: simulated bytes are interchangeable only with each other.
SIM_KV_DTYPE = "sim"


def cost_model(settings: Settings, role: str = "prefill") -> CostModel:
    """The cost preset of a worker of ``role``."""
    s = settings.sim
    return preset(s.decode_preset if role == "decode" and s.decode_preset else s.preset)


def model_name(settings: Settings) -> str:
    """The served model's name in a sim deployment (clients may pass it as ``model``)."""
    return f"sim-{settings.sim.preset}"


def namespace(settings: Settings) -> Namespace:
    """The cache namespace of a sim deployment."""
    s = settings.sim
    return Namespace(model_id=model_name(settings), model_revision=SIM_REVISION,
                     tokenizer_hash=f"vocab-{s.vocab_size}", kv_dtype=SIM_KV_DTYPE,
                     block_size=settings.cache.block_size,
                     adapter_id=settings.cache.adapter_id,
                     tenant_salt=settings.cache.tenant_salt)


def slot_bytes(settings: Settings) -> int:
    """Bytes of one arena slot: the modelled KV of a block, scaled down (at least 1)."""
    block = cost_model(settings).kv_bytes_per_token * settings.cache.block_size
    return max(1, -(-block // settings.sim.kv_scale_down))


def prefill_cost_ms(settings: Settings) -> tuple[float, float, float]:
    """(fixed, per token, per token × context) in wall ms: the preset's simulated
    coefficients divided by the time scale, as the router's queue estimates are wall."""
    scale = settings.sim.time_scale
    fixed, per_token, per_ctx = cost_model(settings).prefill_coefficients_ms()
    return fixed / scale, per_token / scale, per_ctx / scale


def build_engine(settings: Settings, role: str, arena: ArenaSpec | None) -> SimEngine:
    """The sim engine of a worker of ``role`` over its block ``arena``."""
    s = settings.sim
    bs = settings.cache.block_size
    return SimEngine(
        cost_model(settings, role), block_size=bs, arena=arena, time_scale=s.time_scale,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            block_size=bs,
            long_prefill_token_threshold=settings.worker.long_prefill_token_threshold,
            async_kv_load=settings.worker.loads_async(role)),
        max_model_len=s.max_model_len, vocab_size=s.vocab_size,
        gpu_cache_blocks=s.gpu_cache_blocks or None)


# Blocks per forwarded event: keeps each JetStream message far below the payload limit
# (a 200K-token prompt stored at once would be ~800 KB of token ids).
_EVENT_BLOCKS = 64

log = telemetry.get_logger("cpd.sim.serving")


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
