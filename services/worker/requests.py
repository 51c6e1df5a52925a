"""Small checks and conversions on the requests a worker's handlers take."""

from __future__ import annotations

import msgspec
import numpy as np

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


def first_token(s: wire.SamplingParams) -> wire.SamplingParams:
    """``s`` for a prefill's engine run: its first token only."""
    return msgspec.structs.replace(s, max_tokens=1, min_tokens=min(s.min_tokens, 1))


def continuation(s: wire.SamplingParams, prompt: np.ndarray, first: int
                 ) -> tuple[np.ndarray, wire.SamplingParams, tuple[int, ...]]:
    """A decode node's engine run after a prefill's ``first`` token: its prompt, its
    sampling and the output it must start with.

    The first token joins the prompt, and the run generates the rest, unless sampling
    depends on the output so far (:attr:`~cpd.protocol.wire.SamplingParams.needs_output_history`):
    then it is forced output of a run from the prompt, one engine step more for the
    same tokens a single engine would sample."""
    if s.needs_output_history:
        return prompt, s, (first,)
    return (np.append(prompt, np.asarray(first, dtype=wire.TOKEN_DTYPE)),
            msgspec.structs.replace(s, max_tokens=s.max_tokens - 1,
                                    min_tokens=max(0, s.min_tokens - 1)), ())


def choice_id(request_id: str, index: int) -> str:
    """The engine's id for choice ``index`` of a request of several choices."""
    return f"{request_id}#{index}"


def choice_runs(s: wire.SamplingParams, prompt: np.ndarray
                ) -> list[tuple[np.ndarray, wire.SamplingParams, tuple[int, ...]]]:
    """A decode node's engine runs for a request of several choices: each from the
    prompt (the prefill computed its KV, the decode node loads it once for all), with
    its own seed (:meth:`~cpd.protocol.wire.SamplingParams.choice`)."""
    return [(prompt, s.choice(i), ()) for i in range(s.n)]
