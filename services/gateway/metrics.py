"""The gateway's metrics (docs/architecture.md, "Observability"), as OpenTelemetry instruments of
the process
meter; ``python -m services.gateway`` exports them for Prometheus on ``/metrics``.

Latencies are the client's view from the gateway: TTFT runs from the request's arrival
to its first generated token, TPOT is the mean gap between later tokens. Prompt tokens
are counted per tier they were served from (``route.tokens``), so that hit
ratios per tier are ``rate(tokens{tier=X}) / rate(tokens)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import Meter

from cpd.ops import metrics, telemetry
from cpd.protocol import wire
from services.gateway.tenants import DEFAULT_TENANT

TENANT_LIMIT_REASONS = ("rate_limited", "request_too_large", "prompt_too_long", "max_tokens")
"""Why a known tenant's request is refused (the ``reason`` label)."""
UNKNOWN_TENANT, UNAUTHORIZED = "unknown", "unauthorized"
"""The tenant and reason of a request without a valid key."""

CLIENT_CLOSED = 499
"""Status recorded for a stream whose client went away (nginx's convention)."""


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

    def __init__(self, meter: Meter | None = None, tenants: Iterable[str] = ()) -> None:
        """``tenants``: the configured tenant names (none: the open gateway's one), whose
        rejection counts start at 0."""
        m = meter or telemetry.meter()
        self._requests = metrics.counter(m, metrics.GATEWAY_REQUESTS)
        self._rejected = metrics.counter(m, metrics.GATEWAY_REJECTED)
        self._ttft = metrics.histogram(m, metrics.GATEWAY_TTFT)
        self._tpot = metrics.histogram(m, metrics.GATEWAY_TPOT)
        self._latency = metrics.histogram(m, metrics.GATEWAY_E2E)
        self._prompt_tokens = metrics.counter(m, metrics.GATEWAY_PROMPT_TOKENS)
        self._completion_tokens = metrics.counter(m, metrics.GATEWAY_GENERATION_TOKENS)
        names = list(tenants)
        self._tenant_rejected = metrics.counter(m, metrics.GATEWAY_TENANT_REJECTIONS, [
            *({"tenant": t, "reason": r} for t in names or [DEFAULT_TENANT]
              for r in TENANT_LIMIT_REASONS),
            *([{"tenant": UNKNOWN_TENANT, "reason": UNAUTHORIZED}] if names else [])])

    def finished(self, endpoint: str, final: wire.Final, progress: Progress,
                 now: float) -> None:
        """A request that ended with its final message."""
        self._requests.add(1, {"endpoint": endpoint, "status": "200"})
        attrs = {"endpoint": endpoint}
        if progress.first_token is not None:
            self._ttft.record(progress.first_token - progress.started, attrs)
        if (tpot := progress.tpot_ms) is not None:
            self._tpot.record(tpot / 1000, attrs)
        self._latency.record(now - progress.started, attrs)
        route = final.route
        path = route.path or "unknown"
        for source, count in route.tokens.by_source().items():
            # Zeros too: every tier's series exists, so ratios never lack a term.
            self._prompt_tokens.add(count, {"tier": source.value, "path": path})
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
