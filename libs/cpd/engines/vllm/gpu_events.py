"""vLLM's KV cache events (its GPU prefix cache) forwarded into ``CPD_KV`` as GPU-tier
events, so kvindex knows which prefixes each engine holds (docs/architecture.md, "KV tiers
and the data plane", tier 1).

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` batches on a
ZMQ PUB socket (its public ``kv_events_config``); this bridge subscribes and republishes
them with the node's event numbering. kvindex maps them to CPD block hashes through
their token ids. Blocks whose vLLM hash carries extra keys (a tenant's cache salt, LoRA,
multimodal inputs) are not forwarded: kvindex could not hash them in the right namespace,
and a GPU-tier miss only costs a DRAM load, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cpd.kvstore.events import KvEventPublisher
from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import CpdError

log = telemetry.get_logger("cpd.gpu_events")


class GpuEventBridge:
    """Subscribes to one engine's KV events and republishes them for kvindex."""

    def __init__(self, endpoint: str, publisher: KvEventPublisher, namespace: str,
                 namespace_spec: bytes = b"") -> None:
        self.endpoint = endpoint
        self.publisher = publisher
        self.namespace = namespace
        self.namespace_spec = namespace_spec
        self.forwarded = 0
        self.skipped = 0
        self._task: asyncio.Task[None] | None = None
        self._sock: Any = None
        self._last_seq: int | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(self.endpoint)
        self._task = asyncio.create_task(self._run(), name="gpu-event-bridge")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)

    async def _run(self) -> None:
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        decoder = Decoder(KVEventBatch)
        while True:
            _topic, seq_bytes, payload = await self._sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            events: list[wire.KvEvent] = []
            if self._last_seq is not None and seq != self._last_seq + 1:
                # Missed batches: what we told kvindex about this GPU cache may be stale.
                log.warning("gpu_events.gap", expected=self._last_seq + 1, got=seq)
                events.append(wire.NodeCleared(node=self.publisher.node, seq=0,
                                               tier=wire.Tier.GPU))
            self._last_seq = seq
            try:
                batch = decoder.decode(payload)
            except Exception as e:  # a foreign payload: skip it, never crash the worker
                log.warning("gpu_events.undecodable", error=repr(e))
                continue
            events += [x for ev in batch.events if (x := self._convert(ev)) is not None]
            for ev in events:
                try:
                    await self.publisher.publish(ev)
                    self.forwarded += 1
                except CpdError as e:
                    log.warning("gpu_events.publish_failed", error=e.message)

    def _convert(self, ev: Any) -> wire.KvEvent | None:
        node = self.publisher.node
        kind = type(ev).__name__
        if kind == "BlockStored":
            if (ev.extra_keys and any(ev.extra_keys)) or ev.lora_name or ev.lora_id:
                self.skipped += len(ev.block_hashes)
                return None
            return wire.GpuBlocksStored(
                node=node, seq=0, namespace=self.namespace, tier=wire.Tier.GPU,
                engine_hashes=list(ev.block_hashes), parent_engine_hash=ev.parent_block_hash,
                tokens=wire.pack_tokens(ev.token_ids), engine_block_size=ev.block_size,
                namespace_spec=self.namespace_spec)
        if kind == "BlockRemoved":
            return wire.GpuBlocksRemoved(node=node, seq=0, namespace=self.namespace,
                                         tier=wire.Tier.GPU,
                                         engine_hashes=list(ev.block_hashes))
        if kind == "AllBlocksCleared":
            return wire.NodeCleared(node=node, seq=0, tier=wire.Tier.GPU)
        return None
