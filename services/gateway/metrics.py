"""The gateway's metrics (docs/architecture.md, "Observability"), as OpenTelemetry instruments of
the process
meter; ``python -m services.gateway`` exports them for Prometheus on ``/metrics``.

Latencies are the client's view from the gateway: TTFT runs from the request's arrival
to its first generated token, TPOT is the mean gap between later tokens. Prompt tokens
are counted per tier they were served from (``route.tokens_gpu`` ...), so that hit
ratios per tier are ``rate(tokens{tier=X}) / rate(tokens)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.metrics import Meter

from cpd.ops import telemetry
from cpd.protocol import wire

# Bucket bounds (ms): from a warm hit on a short prompt to a cold prefill of ~100K
# tokens, and from a fast decode step to a stalled one.
LATENCY_BUCKETS_MS: Sequence[float] = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000,
                                       10_000, 30_000, 60_000, 120_000, 300_000)
TPOT_BUCKETS_MS: Sequence[float] = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000)

CLIENT_CLOSED = 499
"""Status recorded for a stream whose client went away (nginx's convention)."""

TIERS = ("gpu", "dram", "remote", "computed")


@dataclass
class Progress:
    """Timestamps (``time.perf_counter()``) and token count of one request."""

    started: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    _after_first: int = field(default=0, repr=False)

    def on_tokens(self, count: int, now: float) -> None:
        """Note ``count`` generated tokens arriving at ``now``."""
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
            self._after_first = count - 1
        else:
            self._after_first += count
        self.last_token = now
        self.tokens += count

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (``None`` with fewer than two)."""
        if self.first_token is None or self.last_token is None or not self._after_first:
            return None
        return (self.last_token - self.first_token) * 1000 / self._after_first


class GatewayMetrics:
    """The instruments, and one call per request outcome."""

    def __init__(self, meter: Meter | None = None) -> None:
        m = meter or telemetry.meter()
        self._requests = m.create_counter(
            "cpd_gateway_requests",
            description="generation requests by endpoint and HTTP status (a stream that "
                        "failed after it started counts with its error's status)")
        self._rejected = m.create_counter(
            "cpd_gateway_rejected_requests",
            description="generation requests answered with an error, by CPD error code")
        self._ttft = m.create_histogram(
            "cpd_gateway_ttft", unit="ms",
            description="request arrival to first generated token, at the gateway",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS)
        self._tpot = m.create_histogram(
            "cpd_gateway_tpot", unit="ms",
            description="mean time per output token after the first, at the gateway",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS_MS)
        self._latency = m.create_histogram(
            "cpd_gateway_e2e_latency", unit="ms",
            description="request arrival to its last message, at the gateway",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS)
        self._prompt_tokens = m.create_counter(
            "cpd_gateway_prompt_tokens", unit="{token}",
            description="prompt tokens of finished requests by the tier their KV came "
                        "from (gpu, dram, remote) or computed, and by route path")
        self._completion_tokens = m.create_counter(
            "cpd_gateway_completion_tokens", unit="{token}",
            description="generated tokens of finished requests")
        self._tenant_rejected = m.create_counter(
            "cpd_gateway_tenant_rejections",
            description="requests refused by the tenant checks, by tenant and reason "
                        "(unauthorized, rate_limited, request_too_large, prompt_too_long, "
                        "max_tokens); tenant 'unknown' when no valid key was given")

    def finished(self, endpoint: str, final: wire.Final, progress: Progress,
                 now: float) -> None:
        """A request that ended with its final message."""
        self._requests.add(1, {"endpoint": endpoint, "status": "200"})
        attrs = {"endpoint": endpoint}
        if progress.first_token is not None:
            self._ttft.record((progress.first_token - progress.started) * 1000, attrs)
        if (tpot := progress.tpot_ms) is not None:
            self._tpot.record(tpot, attrs)
        self._latency.record((now - progress.started) * 1000, attrs)
        route = final.route
        path = route.path or "unknown"
        for tier, count in zip(TIERS, (route.tokens_gpu, route.tokens_dram,
                                       route.tokens_remote, route.tokens_computed),
                               strict=True):
            # Zeros too: every tier's series exists, so ratios never lack a term.
            self._prompt_tokens.add(count, {"tier": tier, "path": path})
        self._completion_tokens.add(final.usage.completion_tokens, attrs)

    def failed(self, endpoint: str, status: int, code: str) -> None:
        """A request answered with an error (before or during its stream)."""
        self._requests.add(1, {"endpoint": endpoint, "status": str(status)})
        self._rejected.add(1, {"endpoint": endpoint, "code": code})

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        """A request refused by its tenant's key or limits."""
        self._tenant_rejected.add(1, {"tenant": tenant, "reason": reason})

    def abandoned(self, endpoint: str) -> None:
        """A stream whose client disconnected before its end."""
        self._requests.add(1, {"endpoint": endpoint, "status": str(CLIENT_CLOSED)})
