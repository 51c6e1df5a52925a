"""Service processes: start one in its own session with an appended log, stop or kill
its whole process group, restart it under ``cpd up``'s crash policy; the environment a
child starts with (settings as ``CPD_*`` variables) and where vLLM engines run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cpd.bus import EXIT_REFUSED
from cpd.ops import telemetry
from cpd.ops.config import ENV_PREFIX, Settings
from cpd.ops.cpuset import EnginePlacement, place_engines, usable_cpus
from cpd.protocol.errors import ConfigError
from cpd.protocol.roles import WORKER_ROLES

# Start order: the index before anything that publishes to it.
SERVICE_ORDER = ("kvindex", "preprefill", "prefill", "decode", "router", "gateway", "frontend")
UP_DEFAULT = ("preprefill", "prefill", "decode", "frontend")
"""What ``cpd up`` starts unless told otherwise: the workers and one front end."""
# A service exiting more often than this within CRASH_WINDOW_S is in a crash loop.
CRASH_WINDOW_S = 60.0
CRASH_LOOP_RESTARTS = 5
# Restarts noted in the window before a crash-looping service is started again.
CRASH_LOOP_RETRY = 8
# A Proc.restarts entry saying "refused by NATS, reported once, left down".
_REFUSED_MARK = -1.0

log = telemetry.get_logger("cpd.cluster")


@dataclass
class Proc:
    """One supervised service process."""

    service: str
    node_id: str
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    # Where this start's output begins in the (appended) log file.
    log_offset: int = 0

    def open_log(self) -> BinaryIO:
        """The log file, opened to append this start's output (noting where it begins)."""
        out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.log_offset = out.tell()
        return out

    def start(self) -> None:
        """``python -m services.<service>`` in a session of its own (so its whole process
        group can be stopped), output appended to :attr:`log_path`."""
        out = self.open_log()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", f"services.{self.service}"],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def alive(self) -> bool:
        """Started and not exited."""
        return self.popen is not None and self.popen.poll() is None

    def terminate(self, timeout: float) -> None:
        """Graceful stop of the process group (:func:`stop_tree`)."""
        if self.popen is not None:
            stop_tree(self.popen, timeout)

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group (no-op once it is gone)."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)


def kill_tree(popen: subprocess.Popen[Any]) -> None:
    """SIGKILL a service process started in its own session (``start_new_session``) and
    everything it started: vLLM's engine processes outlive a killed parent otherwise,
    each holding its KV cache memory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait()


def stop_tree(popen: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM (a graceful stop), wait up to ``timeout``, then :func:`kill_tree`, which
    also sweeps children a crashed or slow process left behind."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout)
    kill_tree(popen)


def restart_proc(proc: Proc, report: Callable[[str], None]) -> bool:
    """Restart ``proc`` after it exited, as ``cpd up`` does; returns whether it started.

    A process NATS refused (:data:`EXIT_REFUSED`: its credentials need fixing) stays
    down, reported once. One exiting more than ``CRASH_LOOP_RESTARTS`` times within
    ``CRASH_WINDOW_S`` is reported as crash-looping and skipped until the window holds
    ``CRASH_LOOP_RETRY`` exits (each call counts one). ``report`` gets one line per
    decision (the ``cpd up`` terminal, a harness's event list)."""
    now = time.monotonic()
    code = proc.popen.returncode if proc.popen else None
    if code == EXIT_REFUSED:
        if not proc.restarts or proc.restarts[-1] != _REFUSED_MARK:
            log.error("service.refused_by_nats", node=proc.node_id, log=str(proc.log_path))
            report(f"{proc.node_id} was refused by NATS (its credentials); not restarted: "
                   f"{proc.log_path}")
            proc.restarts.append(_REFUSED_MARK)
        return False
    proc.restarts = [t for t in proc.restarts if now - t < CRASH_WINDOW_S] + [now]
    if len(proc.restarts) > CRASH_LOOP_RESTARTS:
        log.error("service.crash_loop", node=proc.node_id, exit_code=code)
        report(f"{proc.node_id} keeps exiting (code {code}); backing off: {proc.log_path}")
        if len(proc.restarts) < CRASH_LOOP_RETRY:
            return False
    log.warning("service.restart", node=proc.node_id, exit_code=code)
    report(f"{proc.node_id} exited (code {code}); restarting")
    if proc.popen is not None:
        kill_tree(proc.popen)  # what the dead process started (engines) dies with it
    proc.start()
    return True


def override_env(overrides: Iterable[str]) -> dict[str, str]:
    """``section.field=value`` overrides as the ``CPD_<SECTION>__<FIELD>`` variables a
    child process reads (later ones win, as on the command line)."""
    env = {}
    for item in overrides:
        name, _, value = item.partition("=")
        section, _, field_ = name.strip().partition(".")
        env[f"{ENV_PREFIX}{section.upper()}__{field_.upper()}"] = value.strip()
    return env


def env_overrides(env: Mapping[str, str]) -> tuple[str, ...]:
    """``CPD_<SECTION>__<FIELD>`` variables as ``section.field=value`` overrides (the
    inverse of :func:`override_env`); anything else is refused."""
    out = []
    for key, value in env.items():
        section, sep, field_ = key.removeprefix(ENV_PREFIX).partition("__")
        if not key.startswith(ENV_PREFIX) or not sep:
            raise ConfigError(f"{key} is not a CPD_<SECTION>__<FIELD> setting")
        out.append(f"{section.lower()}.{field_.lower()}={value}")
    return tuple(out)


def settings_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a child's environment that :func:`cpd.ops.config.load_settings` reads."""
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}


def plan_nodes(wanted: list[str], counts: dict[str, int] | None) -> dict[str, str]:
    """``node id -> service`` of every process ``cpd up`` starts, in start order."""
    return {f"{service}-{i}": service for service in wanted
            for i in range((counts or {}).get(service, 1))}


def engine_placements(settings: Settings, nodes: dict[str, str]) -> dict[str, EnginePlacement]:
    """Cores and OpenMP threads of each vLLM worker ``cpd up`` starts on this host
    (cpd.ops.cpuset.place_engines), unless the settings name them (``worker.engine_cpus``
    or ``worker.engine_threads``, for every worker alike), or the engine is simulated."""
    w = settings.worker
    if w.engine != "vllm" or w.engine_cpus or w.engine_threads:
        return {}
    workers = [n for n, svc in nodes.items() if svc in WORKER_ROLES]
    if not workers:
        return {}
    placed = place_engines(usable_cpus(), [nodes[n] for n in workers])
    return dict(zip(workers, placed, strict=True))


def start_failure(proc: Proc, label: str) -> str | None:
    """Why ``proc`` failed its start, with its log; ``None`` while it runs. One NATS
    refused (:data:`EXIT_REFUSED`) is named as such: its credentials need fixing, and
    neither waiting nor restarting helps."""
    if proc.alive():
        return None
    code = proc.popen.returncode if proc.popen is not None else None
    if code == EXIT_REFUSED:
        return (f"NATS refused {proc.node_id}; see {proc.log_path}:\n"
                + log_tail(proc.log_path, 2000))
    return (f"{label}: {proc.node_id} exited (code {code}) during start-up:\n"
            f"{log_tail(proc.log_path)}")


def last_log_line(path: Path, width: int = 100, since: int = 0) -> str:
    """The last line a process logged since byte ``since`` of its log (its current
    start: the file keeps earlier runs), without vLLM's prefix (what it is doing now)."""
    lines = [x for x in log_tail(path, 4096, since).splitlines() if x.strip()]
    line = lines[-1] if lines else "(nothing logged yet)"
    head, sep, rest = line.partition("] ")
    return (rest if sep and len(head) < 120 else line).strip()[:width]


def log_tail(path: Path, chars: int = 3000, since: int = 0) -> str:
    """The last ``chars`` characters a process logged at or after byte ``since`` of its
    log (``""`` when unreadable)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            # Up to four bytes a character: enough bytes for ``chars`` of them.
            f.seek(max(since, end - 4 * chars))
            return f.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""


__all__ = ["SERVICE_ORDER", "UP_DEFAULT", "Proc", "engine_placements",
           "env_overrides", "kill_tree",
           "last_log_line", "log_tail", "override_env", "plan_nodes", "restart_proc",
           "settings_env", "start_failure", "stop_tree"]
