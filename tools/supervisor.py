"""``cpd up``: the whole system on one machine as supervised processes.

Embedded NATS (JetStream) first, then the workers and one front end (the gateway, the
router and a kvindex replica in one process), or the services ``--only`` names, each
with its own node id, log file and restart on crash: a :class:`tools.cluster.Cluster`
with ``cpd up``'s settings (the caller's environment, persistent NATS store and logs,
kvindex first, then everything else at once). Readiness is each role's probe
(:mod:`tools.cluster.ready`) of that very process. Ctrl-C (or SIGTERM) stops services
first, then NATS. This module is what the terminal shows: progress lines, banner, scrape
targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from cpd.ops import telemetry
from cpd.ops.config import Settings
from cpd.protocol.errors import ConfigError
from tools.cluster import (
    METRICS_PORT_ENV,
    SERVICE_ORDER,
    UP_DEFAULT,
    Cluster,
    ClusterSpec,
    NatsSpec,
    NodeSpec,
    Proc,
    engine_placements,
    hosts_kvindex,
    kill_tree,
    last_log_line,
    override_env,
    plan_nodes,
    restart_proc,
    start_failure,
    stop_tree,
    until_ready,
    wait_ready,
)

# The line `cpd up` prints once every service answers (tools watch for it).
UP_BANNER = "CPD is up."
CLUSTER_LOG = "cluster.log"
SCRAPE_TARGETS_FILE = "prometheus-targets.json"
_LABEL = "cpd up"

log = telemetry.get_logger("cpd.cluster")


class UnstartedCount(ConfigError):
    """``--count`` of services ``cpd up`` does not start (``--only`` names them)."""

    def __init__(self, services: list[str], started: list[str]) -> None:
        super().__init__(f"--count {', '.join(services)}: not among the services cpd up "
                         f"starts ({', '.join(started)}); name them with --only")
        self.services = services
        self.started = started


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
    wanted = [x for x in available_services() if x in (only or UP_DEFAULT)]
    if unstarted := sorted(set(counts or {}) - set(wanted)):
        raise UnstartedCount(unstarted, wanted)
    logs = Path(log_dir or Path(settings.nats.embedded_store_dir).expanduser().parent / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    # The scrape ports are the services' (from telemetry.prometheus_port on): this
    # process serves none, or it would take the first one from kvindex. Its own log goes
    # to a file: the terminal shows progress lines and the banner only.
    telemetry.setup("cluster", msgspec.structs.replace(settings.telemetry, prometheus_port=0),
                    log_file=logs / CLUSTER_LOG)
    nodes = plan_nodes(wanted, counts)
    secrets = None
    if secure:
        from cpd.ops import security

        secrets = security.SecretsDir.ensure(secrets_dir or settings.nats.secrets_dir,
                                             security.identities_for(nodes))
    spec = _spec(settings, nodes, logs, secrets, port=port, ready_timeout=ready_timeout,
                 overrides=overrides or [], config_file=config_file)
    cluster = Cluster(spec, progress=_progress)
    try:
        asyncio.run(_up(cluster, settings, secrets))
    finally:
        cluster.kill_all()  # a no-op after a clean stop; after an interrupted one, a sweep
        print("cpd: stopped", flush=True)
    return 0


def _spec(settings: Settings, nodes: dict[str, str], logs: Path, secrets: Any, *,
          port: int | None, ready_timeout: float, overrides: list[str],
          config_file: str | None) -> ClusterSpec:
    """``cpd up``'s cluster: the caller's settings as they are (no harness defaults),
    consecutive scrape ports from ``telemetry.prometheus_port`` on, each service with its
    own identity on secured NATS, and kvindex (alone or in the front end) first (it
    creates and replays the stream), then every other service at once (engines take the
    longest and do not depend on each other)."""
    first = settings.telemetry.prometheus_port
    admin = {}
    if secrets is not None:
        from cpd.ops.security import ADMIN

        admin = secrets.env(ADMIN)  # how readiness probes connect
    return ClusterSpec(
        nodes=tuple(NodeSpec(node, service,  # type: ignore[arg-type]
                             env=secrets.env(node) if secrets is not None else {},
                             metrics_port=first + i if first else None,
                             # The index first: secured workers may only read
                             # the event stream it creates, not create it.
                             start_stage=0 if hosts_kvindex(service, settings) else 1)
                    for i, (node, service) in enumerate(nodes.items())),
        nats=NatsSpec(port=settings.nats.embedded_port if port is None else port,
                      store_dir=Path(settings.nats.embedded_store_dir),
                      config_file=str(secrets.config_file) if secrets is not None else None),
        overrides=tuple(overrides), config_file=config_file, workdir=logs,
        inherit_cpd_env=True, harness_defaults=False, client_env=admin, label=_LABEL,
        ready_timeout_s=ready_timeout, stop_timeout_s=settings.nats.drain_timeout_s)


async def _up(cluster: Cluster, settings: Settings, secrets: Any) -> None:
    """Start ``cluster`` (Ctrl-C meanwhile stops it), say so, supervise it until Ctrl-C
    or SIGTERM, then stop it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    t_up = time.monotonic()
    start = asyncio.ensure_future(cluster.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([start, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # interrupted while starting: what started stops
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            return
        start.result()
        _progress(f"ready in {time.monotonic() - t_up:.0f} s")
        procs = list(cluster.procs.values())
        if settings.telemetry.prometheus_port:
            _write_scrape_targets(cluster.workdir / SCRAPE_TARGETS_FILE, procs)
        _banner(cluster.url, procs, cluster.workdir, settings, secrets)
        cluster.supervise(_progress)
        await stopping
    finally:
        stopping.cancel()
        await cluster.stop()


def _progress(line: str) -> None:
    """A start-up line on the terminal (the services' own logs go to their files)."""
    print(f"cpd: {line}", flush=True)


# What a starting process's progress line quotes (white-box tests read it from here).
_last_log_line = last_log_line


async def _ready_or_refused(procs: list[Proc], ready: asyncio.Future[Any]) -> None:
    """Await ``ready``, failing fast with its log when a process exits during the start,
    by name when NATS refused it (its credentials: waiting or restarting cannot fix
    that): the start-up check :class:`tools.cluster.Cluster` makes."""
    await until_ready(ready, procs, lambda p: start_failure(p, _LABEL))


def _restart(proc: Proc) -> None:
    """Restart a process that exited, under the shared crash policy, on the terminal (what
    :meth:`tools.cluster.Cluster.supervise` does for every node)."""
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
    if running & {"gateway", "frontend"}:
        g = settings.gateway
        base = f"http://{g.host}:{g.port}/v1"
        model = g.served_model_name or f"cpd-{settings.model.preset}"
        lines.append(f'  OpenAI API:       {base}  (model "{model}")')
        tries += [f"  curl {base}/completions -H 'Content-Type: application/json' \\",
                  f"""    -d '{{"model": "{model}", "prompt": "def fib(n):", "max_tokens": 16}}'"""]
    if running & {"router", "frontend"}:
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
           "UP_BANNER", "Proc", "UnstartedCount", "available_services", "engine_placements",
           "kill_tree", "override_env", "plan_nodes", "run_cluster", "stop_tree", "until_ready",
           "wait_ready"]
