"""What a :class:`tools.cluster.Cluster` runs: its nodes, its NATS server and the settings
every process starts with, as frozen values (a spec can be shared and compared)."""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from cpd.ops.config import ENV_PREFIX, Settings
from cpd.protocol.errors import ConfigError
from cpd.protocol.roles import WORKER_ROLES
from tools.cluster.procs import SERVICE_ORDER, override_env, plan_nodes

Role = Literal["kvindex", "preprefill", "prefill", "decode", "router", "gateway", "frontend"]
Engine = Literal["sim", "vllm"]
METRICS_PORT_ENV = f"{ENV_PREFIX}TELEMETRY__PROMETHEUS_PORT"
TMP_DIR = "tmp"
"""The children's temp folder inside the cluster's workdir."""


def compile_cache() -> str:
    """torch inductor's cache folder (compiled kernels, a precompiled header of ~150 MB:
    seconds to rebuild) where it is when TMPDIR is left alone, so that processes given
    a temp folder of their own still share it across runs."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


@dataclass(frozen=True)
class NodeSpec:
    """One service process.

    ``env``: extra environment of this node only, applied last (a NATS URL through a
    fault proxy, an advertised data-plane port); ``overrides``: ``section.field=value``
    settings of this node only; ``metrics_port``: its Prometheus port (none by default);
    ``start_stage``: when it starts, instead of its role's :attr:`stage`.
    """

    node_id: str
    service: Role
    env: Mapping[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    metrics_port: int | None = None
    start_stage: int | None = None

    @property
    def stage(self) -> int:
        """When it starts: kvindex, then the workers, the router (or the front end, which
        holds one), the gateway (unless ``start_stage`` says otherwise)."""
        if self.start_stage is not None:
            return self.start_stage
        if self.service in WORKER_ROLES:
            return 1
        return {"kvindex": 0, "router": 2, "frontend": 2}.get(self.service, 3)

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """This node's environment: the cluster's ``base``, its node id, its own
        overrides and metrics port, then its ``env``."""
        env = {**base, "CPD_NODE__NODE_ID": self.node_id, **override_env(self.overrides)}
        if self.metrics_port:
            env[METRICS_PORT_ENV] = str(self.metrics_port)
        return {**env, **self.env}


@dataclass(frozen=True)
class NatsSpec:
    """The embedded NATS server: ``port`` 0 picks a free one (a fixed one lets a fault
    proxy in front of it exist before NATS does); ``store_dir`` defaults to the
    cluster's workdir; ``extra_args`` go to ``nats-server`` (``("-m", port)``: its
    monitoring endpoint); ``config_file``: a secured server's configuration
    (:mod:`cpd.ops.security`: every node then brings its identity in its ``env``)."""

    port: int = 0
    store_dir: Path | None = None
    extra_args: tuple[str, ...] = ()
    config_file: str | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: nodes started in stages on one embedded NATS server.

    Every child gets ``overrides`` (``section.field=value``; validated with
    ``load_settings`` before anything starts) on top of the harness defaults (``engine``,
    quiet plain-text logs, snapshots in ``workdir``; none without ``harness_defaults``);
    ``CPD_*`` variables of the caller's environment reach them only with
    ``inherit_cpd_env`` (``cpd up``'s policy, not a harness's), its ``CPD_NATS__*``
    identity never on a secured server. ``client_env`` is the identity the cluster's own
    client and readiness probes connect as (``cpd up --secure``: the admin's).
    ``workdir`` holds ``<node>.log``, ``nats/``, ``snap/`` and the children's temp
    folder ``tmp/`` (removed when the cluster stops): ``None`` is a temporary
    folder of the cluster's own, removed when it stops. ``placement`` pins vLLM engines
    to cores as ``cpd up`` does; ``build_model`` builds the local model once before any
    service that loads it starts; ``serial_start`` starts workers one at a time (small
    hosts). ``label`` names the cluster in errors and its client connection.
    """

    nodes: tuple[NodeSpec, ...]
    engine: Engine = "sim"
    nats: NatsSpec = NatsSpec()
    overrides: tuple[str, ...] = ()
    config_file: str | None = None
    workdir: Path | None = None
    inherit_cpd_env: bool = False
    harness_defaults: bool = True
    client_env: Mapping[str, str] = field(default_factory=dict)
    placement: bool = True
    build_model: bool = True
    serial_start: bool = False
    label: str = "cluster"
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{self.label}: node ids repeat: {ids}")
        unknown = [n.service for n in self.nodes if n.service not in get_args(Role)]
        if unknown:
            raise ConfigError(f"{self.label}: unknown services {unknown}")

    @classmethod
    def topology(cls, counts: Mapping[str, int], **kwargs: object) -> ClusterSpec:
        """``counts[service]`` nodes of each service, named ``<service>-<i>`` as ``cpd up``
        names them (:func:`tools.cluster.plan_nodes`)."""
        wanted = [s for s in SERVICE_ORDER if counts.get(s, 0)]
        nodes = plan_nodes(wanted, dict(counts))
        return cls(nodes=nodes_of(nodes), **kwargs)  # type: ignore[arg-type]

    def node(self, node_id: str) -> NodeSpec:
        """The spec of ``node_id`` (KeyError if none)."""
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    def services(self) -> dict[str, str]:
        """``node id -> service`` of every node."""
        return {n.node_id: n.service for n in self.nodes}

    def base_env(self, workdir: Path, url: str) -> dict[str, str]:
        """What every child starts with: this environment (its ``CPD_*`` variables only
        with ``inherit_cpd_env``), the harness defaults, the overrides, NATS at ``url``."""
        secured = self.nats.config_file is not None
        env = {k: v for k, v in os.environ.items()
               if (self.inherit_cpd_env or not k.startswith(ENV_PREFIX))
               and not (secured and k.startswith(f"{ENV_PREFIX}NATS__"))}
        defaults = {"CPD_WORKER__ENGINE": self.engine, "CPD_TELEMETRY__LOG_LEVEL": "warning",
                    "CPD_TELEMETRY__LOG_JSON": "false",
                    "CPD_KVINDEX__SNAPSHOT_DIR": str(workdir / "snap")}
        # TMPDIR: what the children leave in the temp folder (vLLM's sockets and rank
        # rendezvous files, a killed node's leftovers) goes with the cluster.
        env = {**(defaults if self.harness_defaults else {}), "PYTHONUNBUFFERED": "1",
               "TORCHINDUCTOR_CACHE_DIR": compile_cache(),
               **env, **override_env(self.overrides), "CPD_NATS__SERVERS": url,
               "TMPDIR": str(workdir / TMP_DIR)}
        if self.config_file:
            env["CPD_CONFIG"] = str(Path(self.config_file).resolve())
        return env


def hosts_kvindex(service: str, settings: Settings) -> bool:
    """Whether a process of ``service`` with ``settings`` runs kvindex: kvindex itself,
    or a front end with ``frontend.kvindex`` on."""
    return service == "kvindex" or (service == "frontend" and settings.frontend.kvindex)


def nodes_of(services: Mapping[str, str],
             env: Mapping[str, Mapping[str, str]] | None = None) -> tuple[NodeSpec, ...]:
    """Node specs of a ``node id -> service`` map, with each node's extra ``env``."""
    env = env or {}
    return tuple(NodeSpec(node, service, env=dict(env.get(node, {})))  # type: ignore[arg-type]
                 for node, service in services.items())


__all__ = ["METRICS_PORT_ENV", "TMP_DIR", "ClusterSpec", "Engine", "NatsSpec", "NodeSpec", "Role",
           "compile_cache", "hosts_kvindex", "nodes_of"]
