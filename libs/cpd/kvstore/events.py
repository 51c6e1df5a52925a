"""Publishing block lifecycle events into the JetStream stream ``CPD_KV`` (docs/architecture.md,
"Lifecycle and visibility").

The contract between writers (workers' block stores, vLLM KV events) and kvindex:

* one subject per node, ``cpd.v1.kv.events.<node>``;
* every event carries the node's ``epoch`` (its start time in ms, and always past the
  last epoch the stream holds for the node: :func:`next_epoch`; a new epoch means empty
  caches) and a ``seq`` counting from 1 within the epoch, so kvindex detects gaps;
* ``Nats-Msg-Id = <node>:<epoch>:<seq>``: a retried publish is stored once
  (JetStream de-duplication), and kvindex applies events idempotently anyway;
* publishing is serialized per node so stream order equals ``seq`` order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from cpd.ops import telemetry
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode

_log = telemetry.get_logger("cpd.kvstore.events")

MAX_BLOCKS_PER_EVENT = 4096
"""Large batches are split so one event stays far below the bus's message limit."""


async def ensure_stream(js: JetStreamContext, *, max_age_s: float = 24 * 3600,
                        max_bytes: int = 8 << 30, replicas: int = 1,
                        update: bool = True, wait_s: float = 60.0) -> api.StreamInfo:
    """Create (or update to) the ``CPD_KV`` stream; safe to call from every process.

    ``update=False`` (writers): an existing stream is left as its owner, kvindex,
    configured it - a writer neither resets its limits to these defaults nor needs the
    right to (with least-privilege NATS it only may read the stream's info).

    A NATS cluster answers JetStream requests only once its members have elected a
    leader (seconds after they start, or after one is lost): unavailable or unanswered
    requests are retried for up to ``wait_s``, as is a 500 ("error creating store for
    stream"): a stream deleted and created again under the same name races the server's
    asynchronous teardown of the old one's store."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await _ensure_stream(js, max_age_s=max_age_s, max_bytes=max_bytes,
                                        replicas=replicas, update=update)
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError,
                nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            if time.monotonic() >= deadline:
                raise CpdError(f"JetStream did not accept the {subjects.KV_STREAM} stream "
                               f"within {wait_s:.0f} s: {e!r}", code=ErrorCode.UNAVAILABLE,
                               retryable=True) from e
            _log.info("kv_stream.waiting_for_jetstream", error=type(e).__name__)
            await asyncio.sleep(0.5)


async def _ensure_stream(js: JetStreamContext, *, max_age_s: float, max_bytes: int,
                         replicas: int, update: bool) -> api.StreamInfo:
    if not update:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            return await js.stream_info(subjects.KV_STREAM)
    config = api.StreamConfig(
        name=subjects.KV_STREAM,
        subjects=[subjects.KV_EVENTS_ALL],
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        max_age=max_age_s,
        max_bytes=max_bytes,
        duplicate_window=120.0,
        num_replicas=replicas,
        # A starting worker reads its own subject's last event (its last epoch) with a
        # direct get, which its permissions confine to that subject.
        allow_direct=True,
    )
    try:
        return await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        return await js.update_stream(config)


def next_epoch(now_ms: int, last: int | None) -> int:
    """The epoch of a node's new incarnation: its start time in ms, but always past
    ``last``, the node's last epoch in ``CPD_KV``. kvindex takes events of an epoch below
    the node's current one for stale, so a clock set back (an NTP step, a restored VM)
    must not hand a restarted node a smaller epoch."""
    return now_ms if last is None else max(now_ms, last + 1)


async def last_epoch(js: JetStreamContext, node: str) -> int | None:
    """The epoch of ``node``'s last event in ``CPD_KV`` (a direct get of its subject's
    last message); ``None`` when it has none, or when the stream cannot say (logged: the
    wall clock alone then decides)."""
    try:
        msg = await js.get_last_msg(subjects.KV_STREAM, subjects.kv_events(node), direct=True)
    except nats.js.errors.NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as e:
        _log.warning("kv_stream.last_epoch_unknown", node=node, error=repr(e))
        return None
    try:
        return wire.decode(msg.data, wire.KvEvent).epoch
    except CpdError as e:
        _log.warning("kv_stream.last_event_unreadable", node=node, error=repr(e))
        return None


def msg_id(node: str, epoch: int, seq: int) -> str:
    """The JetStream de-duplication id of one event."""
    return f"{node}:{epoch}:{seq}"


class KvEventPublisher:
    """Numbers and publishes one node's lifecycle events."""

    def __init__(self, js: JetStreamContext, node: str, *, epoch: int | None = None,
                 tier: wire.Tier = wire.Tier.DRAM, ack_timeout_s: float = 5.0,
                 retry_window_s: float = 20.0) -> None:
        self.js = js
        self.node = subjects.check_token(node, "node id")
        self.epoch = epoch if epoch is not None else int(time.time() * 1000)
        self.tier = tier
        self.seq = 0
        self.subject = subjects.kv_events(node)
        self._lock = asyncio.Lock()
        self._ack_timeout = ack_timeout_s
        # Covers a stream leader's re-election after a NATS cluster member is lost
        # (JetStream answers "no responders" meanwhile).
        self._retry_window_s = retry_window_s

    async def publish(self, event: wire.KvEvent) -> api.PubAck:
        """Stamp ``event`` with node, epoch, seq and trace, and store it in ``CPD_KV``.
        An event published again after a failure keeps its seq (and so its message id):
        stored twice, it is kept once, and the stream has no gap."""
        async with self._lock:
            if not (event.seq and event.node == self.node and event.epoch == self.epoch):
                self.seq += 1
                event.node, event.epoch, event.seq = self.node, self.epoch, self.seq
            if not event.trace:
                event.trace = telemetry.current_traceparent()
            payload = wire.encode(event)
            headers = {"Nats-Msg-Id": msg_id(self.node, self.epoch, self.seq)}
            last: Exception | None = None
            deadline = time.monotonic() + self._retry_window_s
            pause = 0.1
            while True:
                try:
                    return await self.js.publish(self.subject, payload, headers=headers,
                                                 timeout=self._ack_timeout)
                except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError,
                        nats.js.errors.ServiceUnavailableError) as e:
                    last = e  # same Msg-Id: a retry after a lost ack is stored once
                if time.monotonic() + pause >= deadline:
                    break
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
            raise CpdError(f"cannot store kv event {self.seq} of {self.node}: {last!r}",
                           code=ErrorCode.UNAVAILABLE, retryable=True)

    async def allocated(self, namespace: str, blocks: Sequence[wire.BlockRef]) -> None:
        for part in _chunks(blocks):
            await self.publish(wire.BlocksAllocated(node=self.node, seq=0, namespace=namespace,
                                                    tier=self.tier, blocks=list(part)))

    async def writing(self, namespace: str, hashes: Sequence[bytes]) -> None:
        for part in _chunks(hashes):
            await self.publish(wire.BlocksWriting(node=self.node, seq=0, namespace=namespace,
                                                  tier=self.tier, hashes=list(part)))

    async def sealed(self, namespace: str, seals: Sequence[wire.BlockSeal]) -> None:
        for part in _chunks(seals):
            await self.publish(wire.BlocksSealed(node=self.node, seq=0, namespace=namespace,
                                                 tier=self.tier, seals=list(part)))

    async def evicted(self, namespace: str, hashes: Sequence[bytes]) -> None:
        for part in _chunks(hashes):
            await self.publish(wire.BlocksEvicted(node=self.node, seq=0, namespace=namespace,
                                                  tier=self.tier, hashes=list(part)))

    async def failed(self, namespace: str, hashes: Sequence[bytes], reason: str) -> None:
        for part in _chunks(hashes):
            await self.publish(wire.BlocksFailed(node=self.node, seq=0, namespace=namespace,
                                                 tier=self.tier, hashes=list(part),
                                                 reason=reason))

    async def cleared(self) -> None:
        """Everything this node held in its tier is gone (start of a re-announce)."""
        await self.publish(wire.NodeCleared(node=self.node, seq=0, tier=self.tier))


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i:i + MAX_BLOCKS_PER_EVENT]
            for i in range(0, len(items), MAX_BLOCKS_PER_EVENT)] or []
