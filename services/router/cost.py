"""The router's cost model: how long a prefill and a KV load take (docs/architecture.md, "KV tiers
and the data plane", "Routing").

Pure functions. Prefill time is linear in new tokens plus an attention term that grows
with the context each new token attends to:

    t(new, ctx) = fixed + per_token * new + per_token_ctx * (new * ctx + new² / 2)

Loading k tokens of KV from a peer costs ``bytes / bandwidth + per_transfer`` — with the
bandwidth the workers measured, never a configured guess once a measurement exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefillCost:
    """Coefficients of the prefill-time model, in milliseconds."""

    fixed_ms: float = 5.0
    per_token_ms: float = 0.05
    per_token_ctx_ms: float = 1e-6

    def ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Estimated time to prefill ``new_tokens`` after ``context_tokens`` cached ones."""
        if new_tokens <= 0:
            return 0.0
        attn = new_tokens * context_tokens + new_tokens * new_tokens / 2
        return self.fixed_ms + self.per_token_ms * new_tokens + self.per_token_ctx_ms * attn

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> PrefillCost:
        """Least-squares fit to (new_tokens, context_tokens, measured_ms) samples, with
        coefficients kept non-negative (a negative cost would invert routing choices)."""
        if len(samples) < 3:
            raise ValueError("need at least 3 samples to fit the prefill cost")
        a = np.array([[1.0, n, n * c + n * n / 2] for n, c, _ in samples])
        y = np.array([ms for _, _, ms in samples])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        coef = np.maximum(coef, 0.0)
        return cls(fixed_ms=float(coef[0]), per_token_ms=float(coef[1]),
                   per_token_ctx_ms=float(coef[2]))


@dataclass(frozen=True)
class LoadCost:
    """KV bytes per token and the fixed cost of one transfer (metadata, connection)."""

    kv_bytes_per_token: int
    per_transfer_ms: float = 0.5

    def ms(self, tokens: int, bandwidth_gbps: float) -> float:
        """Time to move ``tokens`` tokens of KV at ``bandwidth_gbps`` (GB/s)."""
        if tokens <= 0:
            return 0.0
        if bandwidth_gbps <= 0:
            return float("inf")
        return self.per_transfer_ms + tokens * self.kv_bytes_per_token / (bandwidth_gbps * 1e6)
