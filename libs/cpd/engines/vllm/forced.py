"""A vLLM logits processor that makes a request's first output tokens given ones.

A decode node continues a stream whose first token the prefill node already sampled.
Fed as part of the prompt, that token would not count as *output*: presence and
frequency penalties would miss it, and a seeded random stream would start one draw
early. Fed as forced output instead (``SamplingParams.extra_args[FORCED_KEY]``), the
engine samples it again under a mask that leaves only it, so every later token is
sampled exactly as in one uninterrupted run.

It runs with vLLM's other non-argmax-invariant processors, before the penalties: the
forced token keeps a finite logit (0) and every other one is ``-inf``, which no penalty,
temperature, top-k/p or min-p can turn into another choice. The log probabilities vLLM
reports are computed from the raw logits, before any processor, so they stay the
model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FORCED_KEY = "cpd_forced_output"
"""``SamplingParams.extra_args`` key: the token ids the request's output must start with."""

FQCN = "cpd.engines.vllm.forced:ForcedOutput"
"""How the engine arguments name this processor (``logits_processors``)."""


class ForcedOutput(LogitsProcessor):
    """Masks each tracked request's logits down to its next forced token while its
    output is shorter than the forced tokens."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        # batch index -> (forced ids, the request's live output token list)
        self._forced: dict[int, tuple[Sequence[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCED_KEY)
        if forced is not None and not (isinstance(forced, list)
                                       and all(isinstance(t, int) for t in forced)):
            raise ValueError(f"{FORCED_KEY} must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        """Forcing a token changes the greedy choice."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._forced, batch_update, _state)
        # Requests past their forced tokens need nothing more.
        for index in [i for i, (f, out) in self._forced.items() if len(out) >= len(f)]:
            del self._forced[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output) in self._forced.items():
            n = len(output)
            if n < len(forced):
                row = logits[index]
                row.fill_(float("-inf"))
                row[forced[n]] = 0.0
        return logits


def _state(params: Any, _prompt: list[int] | None, output: list[int]
           ) -> tuple[Sequence[int], list[int]] | None:
    forced = (params.extra_args or {}).get(FORCED_KEY)
    return (forced, output) if forced else None
