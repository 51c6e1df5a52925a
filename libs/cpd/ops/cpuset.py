"""CPU lists and how the engines of one host share its cores.

Several vLLM-CPU engines on one host (``cpd up``: pre-prefill, prefill and decode side by
side) each run OpenMP threads that spin while they wait for each other; two engines whose
threads share cores slow each other by far more than the shared cycles. So each engine
gets cores of its own where there are enough, and a decode engine, which runs one small
step per token, never shares with a prefill engine (docs/architecture.md, "Engines").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cpd.protocol.roles import Role

_MAX_CPU = 1 << 16


def lower_descendants(nice: int, root: int | None = None) -> int:
    """Give every thread of ``root``'s descendant processes (default: this process's,
    e.g. an engine's) a niceness of at least ``nice``; returns how many threads changed.
    Threads they create later inherit it from their creators. A no-op where ``/proc``
    does not list processes (not Linux)."""
    if nice <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    changed = 0
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # exited meanwhile
            continue
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    changed += 1
            except OSError:
                continue
    return changed


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` in the process tree (from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            out.append(child)
            pending.append(child)
    return out


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a list such as ``"0-3,8,10-11"`` (sorted, no duplicates); empty text
    gives an empty list. Raises ``ValueError`` on anything else."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            if text.strip():
                raise ValueError(f"empty item in CPU list {text!r}")
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list item {part!r} in {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last >= _MAX_CPU:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest list text of ``cpus`` (``[0, 1, 2, 5]`` → ``"0-2,5"``)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(_run_text(run))
            run = []
        run.append(c)
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


@dataclass(frozen=True)
class EnginePlacement:
    """The cores one engine is bound to and its OpenMP thread count."""

    cpus: tuple[int, ...]

    @property
    def threads(self) -> int:
        """One OpenMP thread per core: more would time-share a core with a sibling."""
        return len(self.cpus)

    @property
    def cpu_list(self) -> str:
        """``cpus`` as a CPU list (the ``worker.engine_cpus`` setting)."""
        return format_cpu_list(self.cpus)


def place_engines(cpus: Sequence[int], roles: Sequence[str]) -> list[EnginePlacement]:
    """Cores for engines of ``roles`` (in that order) on a host with ``cpus``.

    * Enough cores for every engine: each gets its own; the cores left over go to the
      prefill-side engines (their prompts are compute-bound), one at a time in turn.
    * Fewer: decode engines keep cores of their own (one each, as long as a core is left
      for the prefill side), and the prefill-side engines share the rest.
    """
    if not cpus:
        raise ValueError("no CPUs to place engines on")
    unknown = [r for r in roles if r not in Role.__members__.values()]
    if unknown:
        raise ValueError(f"unknown engine roles {unknown}")
    cores = sorted(set(cpus))
    decode = [i for i, r in enumerate(roles) if r == Role.DECODE]
    prefill = [i for i, r in enumerate(roles) if r != Role.DECODE]
    out: dict[int, list[int]] = {i: [] for i in range(len(roles))}
    if len(cores) >= len(roles):
        for i, core in zip(decode + prefill, cores, strict=False):
            out[i].append(core)
        takers = prefill or decode
        for k, core in enumerate(cores[len(roles):]):
            out[takers[k % len(takers)]].append(core)
    else:
        own = min(len(decode), len(cores) - (1 if prefill else 0))
        pool = list(cores)
        for i in decode[:own]:
            out[i].append(pool.pop())  # decode from the top, prefill from the bottom
        shared = prefill + decode[own:]
        for i in shared:
            out[i] = list(pool or cores)
    return [EnginePlacement(tuple(sorted(out[i]))) for i in range(len(roles))]


__all__ = ["EnginePlacement", "format_cpu_list", "parse_cpu_list", "place_engines",
           "usable_cpus"]
