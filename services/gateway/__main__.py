"""``python -m services.gateway``: serve the OpenAI-compatible HTTP API until
SIGTERM/SIGINT (address in ``gateway.host``/``gateway.port``)."""

from __future__ import annotations

from cpd.bus import run_service
from cpd.ops import telemetry
from cpd.ops.config import load_settings
from services.gateway.service import GatewayService


def main() -> None:
    settings = load_settings()
    # Metrics are served on the gateway's own /metrics, not on a port of their own.
    telemetry.setup("gateway", settings.telemetry, prometheus_reader=True)
    run_service(GatewayService(settings))


if __name__ == "__main__":
    main()
