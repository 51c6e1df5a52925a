"""``cpd up``: the whole system on one machine as supervised processes.

Embedded NATS (JetStream) first, then every service that this build ships a
``services/<name>/__main__.py`` for, each with its own node id, log file and restart on
crash; readiness is a NATS micro PING answered by that very process. Ctrl-C (or SIGTERM)
stops services first, then NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from cpd.bus import EXIT_REFUSED
from cpd.engines.profile import engine_profile
from cpd.ops import telemetry
from cpd.ops.config import ENV_PREFIX, NatsSettings, Settings
from cpd.ops.natsserver import NatsServer
from tools.cluster import (
    METRICS_PORT_ENV,
    SERVICE_ORDER,
    Proc,
    engine_placements,
    kill_tree,
    log_tail,
    override_env,
    plan_nodes,
    restart_proc,
    stop_tree,
    until_ready,
    wait_ready,
)

# How often `cpd up` names the services still starting (engines take tens of seconds).
PROGRESS_EVERY_S = 10.0
# The line `cpd up` prints once every service answers (tools watch for it).
UP_BANNER = "CPD is up."
CLUSTER_LOG = "cluster.log"
SCRAPE_TARGETS_FILE = "prometheus-targets.json"

log = telemetry.get_logger("cpd.cluster")


def available_services() -> list[str]:
    """Services this build can run (those with a ``__main__`` module), in start order."""
    return [s for s in SERVICE_ORDER if importlib.util.find_spec(f"services.{s}.__main__")]


def run_cluster(settings: Settings, port: int | None = None, *,
                counts: dict[str, int] | None = None, log_dir: str | None = None,
                only: list[str] | None = None, ready_timeout: float = 300.0,
                overrides: list[str] | None = None, config_file: str | None = None,
                secure: bool = False, secrets_dir: str | None = None) -> int:
    """Run until interrupted; returns the exit code. ``overrides`` (``section.field=value``)
    and ``config_file`` reach every service, as the environment they start with.

    ``secure``: least-privilege NATS (cpd.ops.security) - credentials, CA and certificates
    generated into (or reused from) ``secrets_dir`` (default ``nats.secrets_dir``), NATS
    started with the generated config (auth, TLS, per-identity permissions), and every
    service given its own identity through its environment."""
    logs = Path(log_dir or Path(settings.nats.embedded_store_dir).expanduser().parent / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    # The scrape ports are the services' (from telemetry.prometheus_port on): this
    # process serves none, or it would take the first one from kvindex. Its own log goes
    # to a file: the terminal shows progress lines and the banner only.
    telemetry.setup("cluster", msgspec.structs.replace(settings.telemetry, prometheus_port=0),
                    log_file=logs / CLUSTER_LOG)
    wanted = [x for x in available_services() if not only or x in only]
    nodes = plan_nodes(wanted, counts)
    secrets = None
    admin_nats: NatsSettings | None = None
    if secure:
        from cpd.ops import security

        secrets = security.SecretsDir.ensure(secrets_dir or settings.nats.secrets_dir,
                                             security.identities_for(nodes))
        admin_nats = security.nats_settings_for(secrets, security.ADMIN, settings.nats)
    server = NatsServer(port=settings.nats.embedded_port if port is None else port,
                        store_dir=settings.nats.embedded_store_dir,
                        log_file=str(logs / "nats.log"),
                        config_file=str(secrets.config_file) if secrets else None)
    server.start()
    if any(x != "kvindex" for x in wanted):
        # Builds the local model once, before the workers (the sim engine has none).
        engine_profile(settings).served_model()
    procs: list[Proc] = []
    stop = asyncio.Event()

    async def supervise() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        base_env = {**os.environ, **override_env(overrides or []),
                    "CPD_NATS__SERVERS": server.url}
        if secrets is not None:
            # Each process gets only its own identity, never one inherited from here.
            base_env = {k: v for k, v in base_env.items()
                        if not k.startswith(f"{ENV_PREFIX}NATS__") or k == "CPD_NATS__SERVERS"}
        if config_file:
            base_env["CPD_CONFIG"] = str(Path(config_file).resolve())
        # kvindex first (it replays the stream); then every worker at once: their
        # engines take the longest to start and do not depend on each other.
        stages = [[x for x in wanted if x == "kvindex"], [x for x in wanted if x != "kvindex"]]
        placements = engine_placements(settings, nodes)
        t_up = time.monotonic()
        # With telemetry.prometheus_port set, it is the first of consecutive scrape ports,
        # one per process (printed in the banner).
        metrics_port = settings.telemetry.prometheus_port
        for stage in stages:
            started = []
            for service in stage:
                for node_id in (n for n, svc in nodes.items() if svc == service):
                    env = {**base_env, "CPD_NODE__NODE_ID": node_id,
                           **(secrets.env(node_id) if secrets else {})}
                    if metrics_port:
                        env[METRICS_PORT_ENV] = str(metrics_port + len(procs))
                    where = ""
                    if (placed := placements.get(node_id)) is not None:
                        env["CPD_WORKER__ENGINE_CPUS"] = placed.cpu_list
                        env["CPD_WORKER__ENGINE_THREADS"] = str(placed.threads)
                        where = f" (engine on CPUs {placed.cpu_list}, {placed.threads} threads)"
                    proc = Proc(service, node_id, logs / f"{node_id}.log", env)
                    proc.start()
                    _progress(f"starting {node_id}{where}")
                    procs.append(proc)
                    started.append(proc)
            await _ready_or_refused(started, asyncio.ensure_future(_each_ready(
                started, server.url, ready_timeout, admin_nats, time.monotonic())))
        _progress(f"ready in {time.monotonic() - t_up:.0f} s")
        if metrics_port:
            _write_scrape_targets(logs / SCRAPE_TARGETS_FILE, procs)
        _banner(server.url, procs, logs, settings, secrets)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            if server.proc is None or server.proc.poll() is not None:
                log.warning("nats.restarting")
                _progress("NATS exited; restarting it")
                server.start()
            for proc in procs:
                if not stop.is_set() and not proc.alive():
                    _restart(proc)

    try:
        asyncio.run(supervise())
    finally:
        for proc in reversed(procs):
            proc.terminate(settings.nats.drain_timeout_s)
        server.stop()
        print("cpd: stopped", flush=True)
    return 0


def _progress(line: str) -> None:
    """A start-up line on the terminal (the services' own logs go to their files)."""
    print(f"cpd: {line}", flush=True)


def _last_log_line(path: Path, width: int = 100, since: int = 0) -> str:
    """The last line a process logged since byte ``since`` of its log (its current
    start: the file keeps earlier runs), without vLLM's prefix (what it is doing now)."""
    lines = [x for x in log_tail(path, 4096, since).splitlines() if x.strip()]
    line = lines[-1] if lines else "(nothing logged yet)"
    head, sep, rest = line.partition("] ")
    return (rest if sep and len(head) < 120 else line).strip()[:width]


async def _each_ready(procs: list[Proc], url: str, timeout: float,
                      admin: NatsSettings | None, t0: float) -> None:
    """Wait for every process of ``procs`` to answer, saying each one's readiness as it
    comes and, while some are still starting, which ones every ``PROGRESS_EVERY_S``."""

    async def one(p: Proc) -> None:
        await wait_ready(url, p.service, p.node_id, timeout, admin)
        pending.discard(p.node_id)
        log.info("service.ready", service=p.service, node=p.node_id)
        _progress(f"{p.node_id} ready ({time.monotonic() - t0:.0f} s)")

    pending = {p.node_id for p in procs}
    waits = asyncio.gather(*(one(p) for p in procs))
    try:
        while not waits.done():
            await asyncio.wait([waits], timeout=PROGRESS_EVERY_S)
            if pending and not waits.done():
                elapsed = time.monotonic() - t0
                for p in procs:
                    if p.node_id in pending:
                        _progress(f"{p.node_id} starting ({elapsed:.0f} s): "
                                  f"{_last_log_line(p.log_path, since=p.log_offset)}")
        waits.result()
    finally:
        waits.cancel()
        with contextlib.suppress(BaseException):
            await waits


async def _ready_or_refused(procs: list[Proc], ready: asyncio.Future[Any]) -> None:
    """Await ``ready``, failing fast when a process exits because NATS refused it
    (wrong credentials or permissions: waiting or restarting cannot fix that)."""

    def refused(p: Proc) -> str | None:
        if p.popen is None or p.popen.poll() != EXIT_REFUSED:
            return None
        return (f"NATS refused {p.node_id}; see {p.log_path}:\n"
                + p.log_path.read_text(errors="replace")[-2000:])

    await until_ready(ready, procs, refused)


def _restart(proc: Proc) -> None:
    """Restart a process that exited, under the shared crash policy, on the terminal."""
    restart_proc(proc, _progress)


def _write_scrape_targets(path: Path, procs: list[Proc]) -> None:
    """Every process's scrape address, as Prometheus file-based service discovery reads
    it (deploy/prometheus/prometheus.yml; docs/observability.md). Written whole, then
    renamed: Prometheus never reads half a file."""
    targets = [{"targets": [f"127.0.0.1:{p.env[METRICS_PORT_ENV]}"],
                "labels": {"service": p.service, "node": p.node_id}}
               for p in procs if METRICS_PORT_ENV in p.env]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets, indent=1) + "\n")
    tmp.replace(path)


def _banner(url: str, procs: list[Proc], logs: Path, settings: Settings,
            secrets: Any = None) -> None:
    names = ", ".join(p.node_id for p in procs) or "none yet"
    running = {p.service for p in procs}
    lines = ["", UP_BANNER, f"  NATS (JetStream): {url}", f"  services:         {names}",
             f"  logs:             {logs}"]
    client_env = f"CPD_NATS__SERVERS={url}"
    if secrets is not None:
        from cpd.ops.security import CLIENT

        env = {"CPD_NATS__SERVERS": url, **secrets.env(CLIENT)}
        lines += [f"  secure NATS:      TLS + per-service identities; secrets in {secrets.root}",
                  "  clients connect as the client identity (generate and status only):",
                  *(f"    export {k}={v}" for k, v in env.items())]
        client_env = "(after the exports above)"
    tries = []
    if "gateway" in running:
        g = settings.gateway
        base = f"http://{g.host}:{g.port}/v1"
        model = g.served_model_name or f"cpd-{settings.model.preset}"
        lines.append(f'  OpenAI API:       {base}  (model "{model}")')
        tries += [f"  curl {base}/completions -H 'Content-Type: application/json' \\",
                  f"""    -d '{{"model": "{model}", "prompt": "def fib(n):", "max_tokens": 16}}'"""]
    if "router" in running:
        tries += [f'  {client_env} cpd generate "def fib(n):" --max-tokens 16',
                  f"  {client_env} cpd status"]
    if settings.telemetry.prometheus_port:
        first = settings.telemetry.prometheus_port
        lines.append(f"  metrics:          http://127.0.0.1:{first}..{first + len(procs) - 1}"
                     "/metrics (one port per service, in the order above; Prometheus "
                     f"targets: {logs / SCRAPE_TARGETS_FILE})")
    if tries:
        lines += ["Try:", *tries]
    lines += ["Stop: Ctrl-C", ""]
    print("\n".join(lines), flush=True)


# The process machinery lives in tools.cluster; these names stay importable from here.
__all__ = ["CLUSTER_LOG", "METRICS_PORT_ENV", "SCRAPE_TARGETS_FILE", "SERVICE_ORDER",
           "UP_BANNER", "Proc", "available_services", "engine_placements", "kill_tree",
           "override_env", "plan_nodes", "run_cluster", "stop_tree", "until_ready",
           "wait_ready"]
