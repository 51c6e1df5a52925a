"""The elastic prefill/decode boundary (services.router.elastic): when a request's
decode stays on its prefill node, table-driven, and through the router's decision."""

from __future__ import annotations

import pytest

from cpd.protocol.roles import Role
from cpd.protocol.wire import RouteReason
from services.router.cost import LoadCost, PrefillCost
from services.router.elastic import lend_decode
from services.router.hits import Hits
from services.router.policy import Decision, NodeLoad, Plan, PolicyConfig, Router


def _nodes(p_in_flight: int, d_in_flight: int, *, decodes: bool = True,
           d2_in_flight: int | None = None) -> list[NodeLoad]:
    out = [NodeLoad(node="pp0", role=Role.PREPREFILL, decodes=decodes),
           NodeLoad(node="p0", role=Role.PREFILL, in_flight=p_in_flight, decodes=decodes),
           NodeLoad(node="d0", role=Role.DECODE, in_flight=d_in_flight)]
    if d2_in_flight is not None:
        out.append(NodeLoad(node="d1", role=Role.DECODE, in_flight=d2_in_flight))
    return out


def _decision(prefill: str = "p0", decode: str = "d0") -> Decision:
    return Decision("cpd", "warm", Plan(node=prefill, role=Role.PREFILL), decode,
                    RouteReason.WARM)


@pytest.mark.parametrize(("lend_at", "nodes", "prefill", "decode", "want"), [
    # Off: never.
    (0, _nodes(0, 50), "p0", "d0", "d0"),
    # The decode node holds fewer than lend_at: it decodes.
    (8, _nodes(0, 7), "p0", "d0", "d0"),
    # Saturated, and the prefill node decodes and holds fewer: it keeps the decode.
    (8, _nodes(0, 8), "p0", "d0", "p0"),
    (8, _nodes(3, 20), "p0", "d0", "p0"),
    # The prefill node is as busy as the decode node: no gain in moving.
    (8, _nodes(8, 8), "p0", "d0", "d0"),
    # The prefill node does not decode (worker.serve_decode off).
    (8, _nodes(0, 20, decodes=False), "p0", "d0", "d0"),
    # A cold request on a pre-prefill node that decodes stays there too.
    (8, _nodes(0, 20), "pp0", "d0", "pp0"),
    # The chosen decode node is gone from the table (raced): keep the decision.
    (8, _nodes(0, 20), "p0", "d9", "d9"),
])
def test_when_the_decode_stays_on_the_prefill_node(lend_at: int, nodes: list[NodeLoad],
                                                   prefill: str, decode: str,
                                                   want: str) -> None:
    d = lend_decode(_decision(prefill, decode), nodes, lend_at)
    assert d.decode_node == want
    assert d.decode_lent == (want != decode)
    assert d.route().decode_lent == d.decode_lent and d.route().decode_node == want


def _router(lend_at: int) -> Router:
    return Router(PolicyConfig(name="cpd", decode_lend_at=lend_at), PrefillCost(),
                  LoadCost(kv_bytes_per_token=4096, per_transfer_ms=0.5))


def test_the_router_lends_only_once_every_decode_node_is_saturated() -> None:
    """The router's decode node is the least loaded one: with one of two decode nodes
    still below the threshold, nothing is lent; with both at it, the warm request's
    prefill node keeps its decode."""
    hits = Hits(gpu={"p0": 4})
    d = _router(8).decide(4 * 256 + 10, 256, hits, _nodes(0, 8, d2_in_flight=3))
    assert (d.plan.node, d.decode_node, d.decode_lent) == ("p0", "d1", False)
    d = _router(8).decide(4 * 256 + 10, 256, hits, _nodes(0, 8, d2_in_flight=9))
    assert (d.plan.node, d.decode_node, d.decode_lent) == ("p0", "p0", True)
    d = _router(0).decide(4 * 256 + 10, 256, hits, _nodes(0, 8, d2_in_flight=9))
    assert (d.decode_node, d.decode_lent) == ("d0", False)
