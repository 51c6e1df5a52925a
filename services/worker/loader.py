"""Pulling planned KV blocks from peers into this worker's store: prefill's prefix loads
and decode's hand-off pulls in one place, with their fallback accounting (metrics,
audit trail, logs). A pull that fails is not an error of the request: what could not be
pulled is recomputed, and the route says so (``wire.LoadError``).

Pulled bytes must match what their writer sealed as kvindex recorded it, never the
serving peer's own word: the puller asks kvindex (``cpd.v1.kvindex.checksums``) while
the bytes travel, so the check adds no round trip to the pull and none to the router's
lookup."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

from cpd.bus import Bus
from cpd.kvstore import BlockEntry, KvStore
from cpd.ops import metrics, telemetry
from cpd.ops.audit import AuditLog
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.roles import PREFILL_ROLES
from cpd.transfer import TransferClient
from services.worker.peers import Peers

Stage = Literal["prefix", "handoff"]
"""``prefix``: a prefill loads a cached prefix; ``handoff``: decode pulls a prefill's
blocks (metrics.FALLBACK_STAGES)."""

_EVENT = {"prefix": "prefill", "handoff": "decode"}  # log event prefix per stage

# How long a puller waits for kvindex to record what the writer sealed (a hand-off's
# seal events are acked before the hand-off, and kvindex applies them within
# milliseconds; a prefix's blocks were visible when the router planned the load),
# asking again this often. A block still not recorded is recomputed.
_RECORD_WAIT_S = 0.5
_RECORD_POLL_S = 0.005


class PrefixLoader:
    """The pulls of one worker (``role``)."""

    def __init__(self, role: str, kv: KvStore, client: TransferClient, peers: Peers, *,
                 bus: Bus, audit: AuditLog | None, log: Any = None) -> None:
        self.role = role
        self.kv = kv
        self.bus = bus
        self.client = client
        self.peers = peers
        self.audit = audit
        m = telemetry.meter()
        stages = [st for st in metrics.FALLBACK_STAGES
                  if st == "handoff" or role in PREFILL_ROLES]
        self._m_planned = metrics.counter(m, metrics.WORKER_KV_LOADS_PLANNED, [
            {"role": role, "stage": st} for st in stages])
        self._m_fallbacks = metrics.counter(m, metrics.WORKER_KV_LOAD_FALLBACKS, [
            {"role": role, "stage": st, "reason": r}
            for st in stages for r in metrics.FALLBACK_REASONS])
        self._log = log or telemetry.get_logger("cpd.worker", role=role)

    def planned(self, stage: Stage) -> None:
        """Count a request that plans to load from peers (the fallbacks' denominator)."""
        self._m_planned.add(1, {"role": self.role, "stage": stage})

    async def pull(self, stage: Stage, peer: str, hashes: list[bytes], *, namespace: str,
                   capability: bytes, request_id: str = ""
                   ) -> tuple[int, wire.LoadError | None]:
        """Pull ``hashes`` from ``peer`` into the store: how many arrived, and why the
        rest did not (``None``: all did). The bytes must match what ``peer`` sealed as
        kvindex recorded it (:meth:`recorded`, asked while they travel), whatever the
        peer says. The failure is counted, logged and audited."""
        t_recv = time.time()
        address = await self.peers.address(peer)
        if address is None:
            self._log.warning(f"{_EVENT[stage]}.peer_unknown", peer=peer)
            return 0, self._fallback(stage, wire.LoadError(
                peer=peer, code=ErrorCode.UNAVAILABLE.value, detail="no heartbeat seen"))
        recorded = asyncio.ensure_future(self.recorded(request_id, namespace, peer, hashes))
        error = ""
        try:
            got = await self.client.pull(address, hashes, self.kv, namespace=namespace,
                                         capability=capability, expected=lambda: recorded)
        except CpdError as e:  # peer gone, evicted, corrupt: the caller recomputes
            error = e.code.value
            self._log.warning(f"{_EVENT[stage]}.pull_failed", peer=peer, error=error,
                              detail=e.message)
            return 0, self._fallback(stage, wire.LoadError(peer=peer, code=error))
        finally:
            if not recorded.done():  # the pull failed before it needed the record
                recorded.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await recorded
            if self.audit is not None:
                self.audit.pulled(stage, peer, namespace, hashes, t_recv, error)
        return len(got), None

    async def recorded(self, request_id: str, namespace: str, node: str,
                       hashes: list[bytes]) -> dict[bytes, int]:
        """What ``node`` sealed for ``hashes``, as kvindex recorded it, waiting up to
        :data:`_RECORD_WAIT_S` for seal events still on their way; a block not recorded
        by then (or with kvindex unreachable) gets -1, which no bytes match, so it is
        recomputed: a pull is never verified against the peer's own word."""
        ask = wire.ChecksumsRequest(request_id=request_id, namespace=namespace, node=node,
                                    block_hashes=b"".join(hashes))
        end = time.monotonic() + _RECORD_WAIT_S
        got: list[int] = []
        while True:
            with contextlib.suppress(CpdError, ValueError):
                reply = await self.bus.request(
                    subjects.KVINDEX_CHECKSUMS, ask, expect=wire.ChecksumsReply,
                    timeout=max(0.01, end - time.monotonic()))
                got = wire.unpack_checksums(reply.checksums)
            if len(got) >= len(hashes) or time.monotonic() >= end:
                return {h: got[i] if i < len(got) else -1 for i, h in enumerate(hashes)}
            await asyncio.sleep(_RECORD_POLL_S)

    def _fallback(self, stage: Stage, failure: wire.LoadError) -> wire.LoadError:
        self._m_fallbacks.add(1, {"role": self.role, "stage": stage, "reason": failure.code})
        return failure

    def sealed_prefix(self, hashes: list[bytes]) -> list[BlockEntry]:
        """The longest run of ``hashes`` from the first that this store holds sealed."""
        out: list[BlockEntry] = []
        for h in hashes:
            entry = self.kv.store.get(h)
            if entry is None or entry.state is not BlockState.SEALED:
                break
            out.append(entry)
        return out

    def audit_load(self, namespace: str, entries: list[BlockEntry]) -> None:
        """Record blocks handed to the engine (they must be sealed and intact), when an
        audit trail is kept."""
        if self.audit is None or not entries:
            return
        store = self.kv.store
        sealed = [e for e in entries if e.state is BlockState.SEALED]
        self.audit.loaded(namespace, [e.hash for e in entries],
                          unsealed=len(entries) - len(sealed),
                          corrupt=sum(not store.intact(e.hash) for e in sealed))
