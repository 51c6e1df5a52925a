"""Whether a request may resume a stream its client already has part of
(``GenerateRequest.resume_tokens``): checked by the gateway before it tells routers to
end the request's earlier streams, and by the router before it regenerates."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cpd.protocol import wire
from cpd.protocol.errors import InvalidRequest


def resumed_tokens(req: wire.GenerateRequest,
                   check_vocab: Callable[[np.ndarray], None]) -> list[int]:
    """The tokens a resuming client already has (``req.resume_tokens``), checked: only a
    deterministic request can be regenerated exactly, and some tokens must be left."""
    if not req.resume_tokens:
        return []
    ids = wire.unpack_tokens(req.resume_tokens)
    s = req.sampling
    if s.n > 1:
        raise InvalidRequest("a request of several choices cannot resume")
    if s.temperature != 0 and s.seed is None:
        raise InvalidRequest("only a deterministic request (temperature 0, or a seed) "
                             "can resume")
    if len(ids) > s.max_tokens:
        raise InvalidRequest(f"resuming after {len(ids)} tokens of max_tokens "
                             f"{s.max_tokens}")
    check_vocab(ids)
    return [int(i) for i in ids]
