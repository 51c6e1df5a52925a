"""CPU time of the processes a benchmark drives, read from Linux ``/proc`` (``None``
elsewhere), so a benchmark can say where the time went per operation."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``None`` when unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime and stime are fields 14 and 15 of stat(5); [0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_all(pids: dict[str, int]) -> dict[str, float | None]:
    """:func:`cpu_seconds` of each named process."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_used_since(before: dict[str, float | None],
                   pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds each named process used since ``before`` (a :func:`cpu_seconds_all`
    reading); ``None`` where either reading is missing."""
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        a, b = before[name], cpu_seconds(pid)
        out[name] = b - a if a is not None and b is not None else None
    return out
