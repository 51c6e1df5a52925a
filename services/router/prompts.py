"""A request's prompt as token ids, checked against the served model before any work is
done (an unknown model, text and ids both or neither, a prompt too long, token ids
outside the vocabulary: typed refusals)."""

from __future__ import annotations

import asyncio

import numpy as np

from cpd.engines.servedmodel import ServedModel
from cpd.protocol import wire
from cpd.protocol.errors import InvalidRequest, UnknownNamespace


async def prompt_tokens(model: ServedModel, req: wire.GenerateRequest) -> np.ndarray:
    """The prompt of ``req`` as token ids (text is tokenized off the event loop)."""
    if req.model and req.model != model.name:
        raise UnknownNamespace(f"model {req.model!r} is not served here "
                               f"(this cluster serves {model.name!r})")
    if (req.prompt is None) == (req.tokens is None):
        raise InvalidRequest("give exactly one of prompt (text) and tokens (ids)")
    if req.prompt is not None:
        ids = await asyncio.to_thread(model.encode, req.prompt)
        tokens = np.asarray(ids, dtype=wire.TOKEN_DTYPE)
    else:
        # Kept packed: a 100K-token prompt is hashed and forwarded without a list.
        tokens = wire.unpack_tokens(req.tokens or b"")
    model.check_prompt(tokens, req.sampling)
    return tokens
