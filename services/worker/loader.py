"""Pulling planned KV blocks from peers into this worker's store: prefill's prefix loads
and decode's hand-off pulls in one place, with their fallback accounting (metrics,
audit trail, logs). A pull that fails is not an error of the request: what could not be
pulled is recomputed, and the route says so (``wire.LoadError``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from cpd.kvstore import BlockEntry, KvStore
from cpd.ops import metrics, telemetry
from cpd.ops.audit import AuditLog
from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.lifecycle import BlockState
from cpd.protocol.roles import PREFILL_ROLES
from cpd.transfer import Expected, TransferClient
from services.worker.peers import Peers

Stage = Literal["prefix", "handoff"]
"""``prefix``: a prefill loads a cached prefix; ``handoff``: decode pulls a prefill's
blocks (metrics.FALLBACK_STAGES)."""

_EVENT = {"prefix": "prefill", "handoff": "decode"}  # log event prefix per stage


class PrefixLoader:
    """The pulls of one worker (``role``)."""

    def __init__(self, role: str, kv: KvStore, client: TransferClient, peers: Peers, *,
                 audit: AuditLog | None, log: Any = None) -> None:
        self.role = role
        self.kv = kv
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
                   capability: bytes, expected: Expected | None = None
                   ) -> tuple[int, wire.LoadError | None]:
        """Pull ``hashes`` from ``peer`` into the store: how many arrived, and why the
        rest did not (``None``: all did). With ``expected`` (kvindex's record of what the
        writer sealed, by hash, or a function finding it), the bytes must match it,
        whatever the peer says. The failure is counted, logged and audited."""
        t_recv = time.time()
        address = await self.peers.address(peer)
        if address is None:
            self._log.warning(f"{_EVENT[stage]}.peer_unknown", peer=peer)
            return 0, self._fallback(stage, wire.LoadError(
                peer=peer, code=ErrorCode.UNAVAILABLE.value, detail="no heartbeat seen"))
        error = ""
        try:
            got = await self.client.pull(address, hashes, self.kv, namespace=namespace,
                                         capability=capability, expected=expected)
        except CpdError as e:  # peer gone, evicted, corrupt: the caller recomputes
            error = e.code.value
            self._log.warning(f"{_EVENT[stage]}.pull_failed", peer=peer, error=error,
                              detail=e.message)
            return 0, self._fallback(stage, wire.LoadError(peer=peer, code=error))
        finally:
            if self.audit is not None:
                self.audit.pulled(stage, peer, namespace, hashes, t_recv, error)
        return len(got), None

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
