"""Small checks and conversions on the requests a worker's handlers take."""

from __future__ import annotations

import msgspec

from cpd.protocol import subjects, wire
from cpd.protocol.errors import InvalidRequest


def check_ids(*, reply_to: str = "", **nodes: str) -> None:
    """Refuse a request whose stream inbox or peer node ids could not be published to
    (checked before acceptance: later they would fail as internal errors)."""
    try:
        if reply_to:
            subjects.check_reply_subject(reply_to)
        for what, node in nodes.items():
            subjects.check_token(node, what)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def with_max_tokens(s: wire.SamplingParams, n: int) -> wire.SamplingParams:
    """``s`` generating at most ``n`` tokens."""
    return msgspec.structs.replace(s, max_tokens=n)
