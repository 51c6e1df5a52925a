"""``python -m services.router``: run one router replica until SIGTERM/SIGINT."""

from __future__ import annotations

from cpd.bus import run_service
from cpd.ops import telemetry
from cpd.ops.config import load_settings
from services.router.service import RouterService


def main() -> None:
    settings = load_settings()
    telemetry.setup("router", settings.telemetry)
    run_service(RouterService(settings))


if __name__ == "__main__":
    main()
