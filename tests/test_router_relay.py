"""Which node owns a request's stream, as the router's relay tracks it: the prefill node
a try was dispatched to, until a decode node says on the stream that it accepted the
hand-off (never guessed from the tokens seen)."""

from __future__ import annotations

import pytest

from cpd.protocol import wire
from services.router.relay import Relay


def _relay() -> Relay:
    return Relay(out=None, detok=None)  # type: ignore[arg-type]  # no tokens forwarded


@pytest.mark.parametrize("events, owner, decode_node", [
    ([("restart", "p0")], "p0", ""),
    ([("restart", "p0"), ("accepted", "d1")], "d1", "d1"),
    # A retry goes back to its new prefill node, whatever accepted the last try.
    ([("restart", "p0"), ("accepted", "d1"), ("restart", "p1")], "p1", ""),
    ([("restart", "p0"), ("accepted", "d1"), ("restart", "p1"), ("accepted", "d0")],
     "d0", "d0"),
])
def test_the_stream_owner_follows_restarts_and_acceptances(
        events: list[tuple[str, str]], owner: str, decode_node: str) -> None:
    relay = _relay()
    for kind, node in events:
        if kind == "restart":
            relay.restart(node)
        else:
            relay.accepted(wire.HandoffAccepted(request_id="r", seq=1, node=node))
    assert (relay.owner, relay.decode_node) == (owner, decode_node)
