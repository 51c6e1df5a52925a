"""``python -m services.router``: run one router replica until SIGTERM/SIGINT."""

from __future__ import annotations

from cpd import telemetry
from cpd.bus import run_service
from cpd.config import load_settings

from .service import RouterService


def main() -> None:
    settings = load_settings()
    telemetry.setup("router", settings.telemetry)
    run_service(RouterService(settings))


if __name__ == "__main__":
    main()
