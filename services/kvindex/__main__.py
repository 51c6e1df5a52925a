"""``python -m services.kvindex``: run one kvindex replica until SIGTERM/SIGINT."""

from __future__ import annotations

from cpd.bus import run_service
from cpd.ops import telemetry
from cpd.ops.config import load_settings
from services.kvindex.service import KvIndexService


def main() -> None:
    settings = load_settings()
    telemetry.setup("kvindex", settings.telemetry)
    run_service(KvIndexService(settings))


if __name__ == "__main__":
    main()
