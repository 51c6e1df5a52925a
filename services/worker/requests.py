"""Small checks and conversions on the requests a worker's handlers take."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from cpd.engines import EngineStep
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


def ended_on_stop(step: EngineStep) -> bool:
    """Whether an engine run ended on a stop token (EOS, ``stop_token_ids``) at ``step``."""
    return step.finished and step.finish_reason == "stop"


def first_token(s: wire.SamplingParams) -> wire.SamplingParams:
    """``s`` for a prefill's engine run: its first token only."""
    return msgspec.structs.replace(s, max_tokens=1, min_tokens=min(s.min_tokens, 1))


def first_text(s: wire.SamplingParams, limit: int) -> wire.SamplingParams:
    """``s`` for a prefill's engine run that goes on while its text is incomplete (a run
    with ``until_whole_text``): at most ``limit`` (``worker.first_text_tokens``) and
    ``max_tokens`` tokens, the end-of-sequence token held back for as many of them as
    ``s`` holds it back (its ``min_tokens``)."""
    n = max(1, min(limit, s.max_tokens))
    return msgspec.structs.replace(s, max_tokens=n, min_tokens=min(s.min_tokens, n))


def continuation(s: wire.SamplingParams, prompt: np.ndarray, generated: Sequence[int]
                 ) -> tuple[np.ndarray, wire.SamplingParams, tuple[int, ...]]:
    """An engine run after the tokens ``generated`` elsewhere (a prefill's first ones):
    its prompt, its sampling and the output it must start with.

    The generated tokens join the prompt, and the run generates the rest, unless sampling
    depends on the output so far (:attr:`~cpd.protocol.wire.SamplingParams.needs_output_history`):
    then they are forced output of a run from the prompt, one engine step more for the
    same tokens a single engine would sample."""
    if s.needs_output_history:
        return prompt, s, tuple(generated)
    n = len(generated)
    return (np.append(prompt, np.asarray(generated, dtype=wire.TOKEN_DTYPE)),
            msgspec.structs.replace(s, max_tokens=s.max_tokens - n,
                                    min_tokens=max(0, s.min_tokens - n)), ())


def next_token(s: wire.SamplingParams, prompt: np.ndarray, generated: Sequence[int]
               ) -> tuple[np.ndarray, wire.SamplingParams, tuple[int, ...]]:
    """The engine run that samples the one token after ``generated`` (as
    :func:`continuation`, stopped after that token)."""
    run_prompt, run, forced = continuation(s, prompt, generated)
    if forced:
        last = len(forced) + 1
        return run_prompt, msgspec.structs.replace(
            run, max_tokens=last, min_tokens=min(run.min_tokens, last)), forced
    return run_prompt, first_token(run), ()


def wants_text(incomplete: bool, generated: int, stopped: bool, limit: int,
               s: wire.SamplingParams) -> bool:
    """Whether a prefill node samples one more token before the hand-off: its tokens so
    far end inside a character (their text is held back, so the client would see none
    until the decode node's first token), the request goes on, and fewer than ``limit``
    (``worker.first_text_tokens``) and ``max_tokens`` were generated."""
    return incomplete and not stopped and generated < min(limit, s.max_tokens)


def choice_id(request_id: str, index: int) -> str:
    """The engine's id for choice ``index`` of a request of several choices."""
    return f"{request_id}#{index}"


def choice_runs(s: wire.SamplingParams, prompt: np.ndarray
                ) -> list[tuple[np.ndarray, wire.SamplingParams, tuple[int, ...]]]:
    """A decode node's engine runs for a request of several choices: each from the
    prompt (the prefill computed its KV, the decode node loads it once for all), with
    its own seed (:meth:`~cpd.protocol.wire.SamplingParams.choice`)."""
    return [(prompt, s.choice(i), ()) for i in range(s.n)]
