"""Changes of the simulated engine's GPU prefix cache, as vLLM's KV cache events report
them (the worker forwards them to kvindex as GPU-tier events)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheStored:
    """Blocks entered the GPU prefix cache: ``hashes`` chained after ``parent``, their
    ``tokens`` (``len(hashes) * block_size``)."""

    hashes: list[int]
    parent: int | None
    tokens: np.ndarray


@dataclass(frozen=True)
class CacheRemoved:
    """Blocks left the GPU prefix cache (evicted)."""

    hashes: list[int]


@dataclass(frozen=True)
class CacheCleared:
    """The whole GPU prefix cache was dropped (a reset)."""


CacheEvent = CacheStored | CacheRemoved | CacheCleared
