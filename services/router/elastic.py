"""The elastic prefill/decode boundary: a prefill-side node that also decodes
(``worker.serve_decode``) keeps a request's decode when the decode pool is saturated.

A dedicated decode pool is right only for one traffic mix; on agent-style traffic with
long outputs it saturates while the prefill side idles. A request whose prefill node
decodes too can then stay there: no hand-off transfer (the node's engine holds the
prompt's KV), and the decode pool grows by what the prefill side has spare. The move is
per request, so it reverses itself as the decode pool drains, and a request in flight
never moves.

Pure: a decision and the nodes in, the decision out (the router service and the planner
both run it, :meth:`services.router.policy.Router.decide`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from services.router.plans import NodeLoad

if TYPE_CHECKING:
    from services.router.policy import Decision


def lend_decode(d: Decision, nodes: Sequence[NodeLoad], lend_at: int) -> Decision:
    """``d`` with its decode on its own prefill node when that node decodes too, the
    decode node ``d`` chose (the least loaded) holds ``lend_at`` requests or more, and
    the prefill node holds fewer than it; else ``d``. ``lend_at`` 0: never."""
    if lend_at <= 0 or d.plan.node == d.decode_node:
        return d
    prefill = decode = None
    for x in nodes:
        if x.node == d.plan.node:
            prefill = x
        elif x.node == d.decode_node:
            decode = x
    if (prefill is None or not prefill.decodes or decode is None
            or decode.in_flight < lend_at or prefill.in_flight >= decode.in_flight):
        return d
    return replace(d, decode_node=prefill.node, decode_lent=True)
