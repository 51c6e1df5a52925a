"""Single-flight waiters (``services.router.waiters``): which visibility and
invalidation events wake which waiter. Pure bookkeeping, table-driven; the router's
use of it against a real kvindex is in ``cpd bench router`` and tests/test_router_e2e.py."""

from __future__ import annotations

import msgspec
import pytest

from cpd.protocol import wire
from cpd.protocol.errors import MalformedMessage
from services.router.waiters import PrefixWaiters

A, B, C = (bytes([i]) * wire.HASH_BYTES for i in (1, 2, 3))


def _visible(node: str, *hashes: bytes, ns: str = "ns",
             tier: wire.Tier = wire.Tier.DRAM) -> wire.BlocksVisible:
    return wire.BlocksVisible(namespace=ns, node=node, tier=tier,
                              block_hashes=b"".join(hashes))


@pytest.mark.parametrize(("event", "woken"), [
    (_visible("pp0", A, B), True),                       # the awaited block, among others
    (_visible("pp0", A), False),                         # an earlier block only
    (_visible("pp1", B), False),                         # another node
    (_visible("pp0", B, ns="other"), False),             # another namespace
    (_visible("pp0", B, tier=wire.Tier.GPU), False),     # not the arena
    (wire.BlocksInvalidated(namespace="ns", node="pp0", block_hashes=A), True),
    (wire.BlocksInvalidated(node="pp0"), True),          # every block of the node
    (wire.BlocksInvalidated(namespace="other", node="pp0"), False),
    (wire.BlocksInvalidated(namespace="ns", node="pp1"), False),
])
async def test_which_events_wake_a_waiter(event: wire.Message, woken: bool) -> None:
    w = PrefixWaiters()
    ev = w.add("ns", "pp0", B)
    n = w.visible(event) if isinstance(event, wire.BlocksVisible) else w.invalidated(event)
    assert ev.is_set() is woken and n == int(woken)


async def test_every_waiter_of_a_block_wakes_and_discard_forgets_them() -> None:
    w = PrefixWaiters()
    evs = [w.add("ns", "pp0", B) for _ in range(3)]
    other = w.add("ns", "pp0", C)
    assert len(w) == 4
    assert w.visible(_visible("pp0", B)) == 3
    assert all(e.is_set() for e in evs) and not other.is_set()
    for e in evs:
        w.discard("ns", "pp0", B, e)
    w.discard("ns", "pp0", C, other)
    w.discard("ns", "pp0", C, other)   # twice is harmless
    assert len(w) == 0 and w.visible(_visible("pp0", B, C)) == 0


@pytest.mark.parametrize("kind", ["kv_visible", "kv_invalidated"])
def test_a_hash_array_of_the_wrong_width_never_decodes(kind: str) -> None:
    """A visibility event whose hashes are not whole fails decoding (the router counts
    it as rejected) before the waiters see it."""
    raw = msgspec.msgpack.encode({"kind": kind, "v": 1, "namespace": "ns", "node": "pp0",
                                  "tier": "dram", "block_hashes": b"x" * 17})
    with pytest.raises(MalformedMessage):
        wire.decode(raw)
