"""The pure helpers of the worker's handlers: how a run continues after tokens sampled
elsewhere, and when a prefill node samples one more token before its hand-off."""

from __future__ import annotations

import numpy as np
import pytest

from cpd.protocol import wire
from services.worker.requests import continuation, first_text, next_token, wants_text

PROMPT = np.arange(1, 6, dtype=wire.TOKEN_DTYPE)
GREEDY = wire.SamplingParams(max_tokens=10, min_tokens=3)
SEEDED = wire.SamplingParams(max_tokens=10, min_tokens=3, temperature=0.8, seed=7)


@pytest.mark.parametrize(("s", "generated", "prompt", "max_tokens", "min_tokens", "forced"), [
    # The tokens join the prompt; what is left to generate shrinks by them.
    (GREEDY, [9], [1, 2, 3, 4, 5, 9], 9, 2, ()),
    (GREEDY, [9, 8, 7, 6], [1, 2, 3, 4, 5, 9, 8, 7, 6], 6, 0, ()),
    # Seeded sampling depends on the output so far: forced output of a run from the
    # prompt, with the request's own limits.
    (SEEDED, [9, 8], [1, 2, 3, 4, 5], 10, 3, (9, 8)),
])
def test_a_run_continues_after_the_tokens_sampled_elsewhere(
        s: wire.SamplingParams, generated: list[int], prompt: list[int], max_tokens: int,
        min_tokens: int, forced: tuple[int, ...]) -> None:
    run_prompt, run, run_forced = continuation(s, PROMPT, generated)
    assert run_prompt.tolist() == prompt and run_prompt.dtype == wire.TOKEN_DTYPE
    assert (run.max_tokens, run.min_tokens, run_forced) == (max_tokens, min_tokens, forced)


@pytest.mark.parametrize(("s", "generated", "prompt", "max_tokens", "min_tokens", "forced"), [
    (GREEDY, [9], [1, 2, 3, 4, 5, 9], 1, 1, ()),
    (GREEDY, [9, 8, 7], [1, 2, 3, 4, 5, 9, 8, 7], 1, 0, ()),
    # Forced tokens count in max_tokens: one more than them samples exactly one.
    (SEEDED, [9], [1, 2, 3, 4, 5], 2, 2, (9,)),
    (SEEDED, [9, 8, 7], [1, 2, 3, 4, 5], 4, 3, (9, 8, 7)),
])
def test_the_next_token_is_one_engine_run_of_one_token(
        s: wire.SamplingParams, generated: list[int], prompt: list[int], max_tokens: int,
        min_tokens: int, forced: tuple[int, ...]) -> None:
    run_prompt, run, run_forced = next_token(s, PROMPT, generated)
    assert run_prompt.tolist() == prompt
    assert (run.max_tokens, run.min_tokens, run_forced) == (max_tokens, min_tokens, forced)
    assert run.max_tokens - len(run_forced) == 1


@pytest.mark.parametrize(("incomplete", "generated", "stopped", "limit", "max_tokens", "want"), [
    (True, 1, False, 4, 10, True),     # half a character: one more
    (True, 3, False, 4, 10, True),
    (True, 4, False, 4, 10, False),    # at the limit: hand off anyway
    (True, 2, False, 4, 2, False),     # the request is done
    (True, 1, True, 4, 10, False),     # a stop token ended it
    (False, 1, False, 4, 10, False),   # whole text: hand off
    (True, 1, False, 1, 10, False),    # first_text_tokens 1: never
])
def test_a_prefill_node_samples_on_only_while_its_text_is_held_back(
        incomplete: bool, generated: int, stopped: bool, limit: int, max_tokens: int,
        want: bool) -> None:
    s = wire.SamplingParams(max_tokens=max_tokens)
    assert wants_text(incomplete, generated, stopped, limit, s) is want


@pytest.mark.parametrize(("max_tokens", "min_tokens", "limit", "run_max", "run_min"), [
    (10, 0, 4, 4, 0),     # up to first_text_tokens
    (10, 3, 4, 4, 3),     # the end of sequence held back as in one run
    (10, 9, 4, 4, 4),
    (2, 2, 4, 2, 2),      # the request's own max_tokens first
    (10, 0, 1, 1, 0),     # first_text_tokens 1: the first token only
])
def test_a_prefill_run_to_whole_text_keeps_the_requests_limits(
        max_tokens: int, min_tokens: int, limit: int, run_max: int, run_min: int) -> None:
    s = wire.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.5,
                            seed=3)
    run = first_text(s, limit)
    assert (run.max_tokens, run.min_tokens) == (run_max, run_min)
    assert (run.temperature, run.seed) == (0.5, 3)
