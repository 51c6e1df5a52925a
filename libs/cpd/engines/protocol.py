"""The engine protocol every CPD worker drives: vLLM in production, the simulator for
scale experiments. Both take token ids and a KV plan, and stream token deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cpd.protocol import wire


@dataclass(frozen=True)
class ArenaSpec:
    """The shared-memory block arena the engine copies KV blocks to and from."""

    path: str
    num_slots: int
    slot_bytes: int


@dataclass(frozen=True)
class EngineRequest:
    """One generation: prompt tokens, sampling, and which arena slots to load and save."""

    request_id: str
    # Workers pass the wire's uint32 array as is: a list of 100K+ Python ints costs
    # milliseconds per request to build and convert back.
    tokens: Sequence[int] | np.ndarray
    sampling: wire.SamplingParams
    # Slots holding the prompt's first blocks, in order, with their checksums.
    load_slots: Sequence[int] = ()
    load_checksums: Sequence[int] = ()
    # Slot per prompt block index to write the block's KV into (-1: don't).
    save_slots: Sequence[int] = ()
    # Isolates the engine's own prefix cache per tenant (vLLM's cache_salt).
    cache_salt: str = ""
    # Tokens the output must start with, already generated elsewhere (a decode node
    # continuing a prefill's stream): sampled again as output, so penalties and seeded
    # streams see them as a single run would, and not reported again.
    forced_output: Sequence[int] = ()
    # End the run once its output's text is whole (its last token ends a character), or
    # at ``max_tokens``: a prefill's first text. Only where ``Engine.stops_at_whole_text``.
    until_whole_text: bool = False


@dataclass
class EngineStep:
    """What one engine step produced for a request (deltas, not cumulative)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[wire.TokenLogprob] = field(default_factory=list)  # when asked, per id
    finished: bool = False
    finish_reason: str | None = None
    stop_token: int | None = None  # the stop_token_ids entry that ended the request
    prompt_tokens: int = 0
    cached_tokens: int = 0     # prompt tokens not computed (engine cache + arena)
    gpu_blocks: int = 0        # of which were in the engine's own prefix cache
    loaded_blocks: int = 0     # loaded from the arena
    failed_blocks: int = 0     # arena blocks that failed verification (recomputed)
    saved_blocks: int = 0      # written through to the arena
    # When the engine first scheduled the request (``time.monotonic()``, a clock every
    # process of the host shares; 0: not known), on the last step: its queue time ends.
    scheduled_at: float = 0.0


class Engine(Protocol):
    """What a worker needs from an engine."""

    block_size: int
    max_model_len: int
    # Whether the engine honours ``EngineRequest.until_whole_text``.
    stops_at_whole_text: bool

    async def start(self) -> None:
        """Load the model; ready to generate when this returns."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        """Stream the request's steps; the last one has ``finished`` set."""

    async def abort(self, request_id: str) -> None:
        """Stop a running request (its stream ends)."""

    async def reset_prefix_cache(self) -> bool:
        """Drop the engine's own prefix cache; False if requests still hold blocks."""

    async def stop(self) -> None:
        """Release the engine."""
