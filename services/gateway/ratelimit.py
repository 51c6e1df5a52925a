"""Per-tenant request rate limits of the gateway: token buckets, without I/O.

Each tenant has a bucket of ``burst`` tokens that refills at ``rate_per_s``; a request
takes one token or is refused with the time until one is back (the ``Retry-After`` of a
429). Time comes from the caller (monotonic seconds), so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled continuously at ``rate_per_s``; starts full."""

    rate_per_s: float
    burst: float
    tokens: float = -1.0  # -1: full (set on first use)
    updated: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` tokens at ``now``: 0.0 when granted, else the seconds until
        they would be (nothing is taken then)."""
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        # A clock that stepped back (another caller's "now") never adds tokens.
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
        self.updated = max(self.updated, now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate_per_s


class RateLimiter:
    """One :class:`TokenBucket` per tenant that has a rate; others are unlimited."""

    def __init__(self, limits: dict[str, tuple[float, int]],
                 clock: Callable[[], float]) -> None:
        """``limits``: tenant → (rate_per_s, burst); a rate of 0 means unlimited."""
        self.clock = clock
        self._buckets = {name: TokenBucket(rate, burst)
                         for name, (rate, burst) in limits.items() if rate > 0}

    def check(self, tenant: str) -> float:
        """0.0 if ``tenant`` may send a request now (and count it), else the seconds to
        wait."""
        bucket = self._buckets.get(tenant)
        return 0.0 if bucket is None else bucket.take(self.clock())


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` value (whole seconds, at least 1) for a wait of ``wait_s``."""
    return str(max(1, math.ceil(wait_s)))
