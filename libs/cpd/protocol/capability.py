"""Read capabilities of the KV data plane (docs/architecture.md, "Block identity", "KV tiers and
the data plane"; tenant isolation).

A block hash is not a secret: it is a deterministic function of the namespace and the
prompt's tokens, so anyone who knows (or guesses) a prompt can compute it. Serving a block
to whoever names its hash would let a client probe and read another tenant's KV. So a
worker's :class:`~cpd.transfer.TransferServer` serves a block only against a
*capability*: a keyed BLAKE3 MAC of (operation, namespace id, node, epoch) under a random
secret that lives only in that worker process (one per incarnation).

The capability reaches legitimate readers only through trusted channels:

* the worker attaches it to its ``BlocksSealed`` events (``CPD_KV``), kvindex keeps it
  per (node, namespace) and returns it with each location in ``LookupReply``; the router
  copies it into the ``LoadSource`` of the prefill request;
* on the hand-off the prefill node puts its own capability into the ``DecodeRequest``.

One capability per (node, namespace) is enough (blocks are namespace-scoped), so lookups
and requests carry a few bytes per location, never per block. A node restart draws a new
secret and epoch, which invalidates every capability of the old incarnation by itself.

Verification is constant-time (:func:`hmac.compare_digest`) and happens before the server
looks at any block, so a denied client learns nothing, not even whether a block exists.
"""

from __future__ import annotations

import hmac
import os
from typing import Literal

import blake3

CAPABILITY_BYTES = 16
"""Width of a capability (128-bit MAC: unguessable, and small on the wire)."""

_SECRET_BYTES = 32
_KEY_CONTEXT = "cpd.v1 2026-11 kv data-plane capability key"

Operation = Literal["get", "put"]


class Keyring:
    """The capability secret of one worker incarnation: issues and verifies.

    ``get`` capabilities are handed out (events, hand-offs) so peers can read; ``put``
    capabilities (pushing blocks into this node's store) are never published by the
    worker: only the node itself, or whoever it gives one to, can write into its arena.
    """

    def __init__(self, node: str, epoch: int, secret: bytes | None = None) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("a capability secret needs at least 16 bytes")
        self.node = node
        self.epoch = epoch
        self._mac = blake3.blake3(key=_derive_key(secret or os.urandom(_SECRET_BYTES)))
        self._cache: dict[tuple[str, str], bytes] = {}

    def issue(self, namespace: str, op: Operation = "get") -> bytes:
        """The capability to ``op`` blocks of ``namespace`` at this node and epoch."""
        key = (op, namespace)
        cap = self._cache.get(key)
        if cap is None:
            mac = self._mac.copy()
            mac.update(_message(op, namespace, self.node, self.epoch))
            cap = self._cache[key] = mac.digest(CAPABILITY_BYTES)
        return cap

    def verify(self, namespace: str, capability: bytes, op: Operation = "get") -> bool:
        """Whether ``capability`` allows ``op`` on ``namespace`` here (constant time).

        An empty namespace never verifies: a capability names exactly one namespace.
        """
        if not namespace or len(capability) != CAPABILITY_BYTES:
            return False
        return hmac.compare_digest(self.issue(namespace, op), capability)


def _derive_key(secret: bytes) -> bytes:
    # A fixed-width key whatever the secret's length, bound to this purpose.
    return blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()


def _message(op: str, namespace: str, node: str, epoch: int) -> bytes:
    # Length-prefixed fields: no two different tuples share an encoding.
    parts = [op.encode(), namespace.encode(), node.encode(), str(epoch).encode()]
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)
