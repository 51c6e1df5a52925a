"""What a :class:`tools.cluster.Cluster` runs: its nodes, its NATS server and the settings
every process starts with, as frozen values (a spec can be shared and compared)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from cpd.protocol.errors import ConfigError
from cpd.protocol.roles import WORKER_ROLES
from tools.cluster.procs import SERVICE_ORDER, plan_nodes

Role = Literal["kvindex", "preprefill", "prefill", "decode", "router", "gateway"]
Engine = Literal["sim", "vllm"]


@dataclass(frozen=True)
class NodeSpec:
    """One service process.

    ``env``: extra environment of this node only, applied last (a NATS URL through a
    fault proxy, an advertised data-plane port); ``overrides``: ``section.field=value``
    settings of this node only; ``metrics_port``: its Prometheus port (none by default).
    """

    node_id: str
    service: Role
    env: Mapping[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    metrics_port: int | None = None

    @property
    def stage(self) -> int:
        """When it starts: kvindex, then the workers, the router, the gateway."""
        if self.service in WORKER_ROLES:
            return 1
        return {"kvindex": 0, "router": 2}.get(self.service, 3)


@dataclass(frozen=True)
class NatsSpec:
    """The embedded NATS server: ``port`` 0 picks a free one (a fixed one lets a fault
    proxy in front of it exist before NATS does); ``store_dir`` defaults to the
    cluster's workdir; ``extra_args`` go to ``nats-server`` (``("-m", port)``: its
    monitoring endpoint)."""

    port: int = 0
    store_dir: Path | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: nodes started in stages on one embedded NATS server.

    Every child gets ``overrides`` (``section.field=value``; validated with
    ``load_settings`` before anything starts) on top of the harness defaults (``engine``,
    quiet plain-text logs, snapshots in ``workdir``); ``CPD_*`` variables of the caller's
    environment reach them only with ``inherit_cpd_env`` (``cpd up``'s policy, not a
    harness's). ``workdir`` holds ``<node>.log``, ``nats/`` and ``snap/``: ``None`` is a
    temporary folder of the cluster's own, removed when it stops. ``placement`` pins
    vLLM engines to cores as ``cpd up`` does; ``build_model`` builds the local model
    once before any worker starts; ``serial_start`` starts workers one at a time (small
    hosts). ``label`` names the cluster in errors and its client connection.
    """

    nodes: tuple[NodeSpec, ...]
    engine: Engine = "sim"
    nats: NatsSpec = NatsSpec()
    overrides: tuple[str, ...] = ()
    config_file: str | None = None
    workdir: Path | None = None
    inherit_cpd_env: bool = False
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


def nodes_of(services: Mapping[str, str],
             env: Mapping[str, Mapping[str, str]] | None = None) -> tuple[NodeSpec, ...]:
    """Node specs of a ``node id -> service`` map, with each node's extra ``env``."""
    env = env or {}
    return tuple(NodeSpec(node, service, env=dict(env.get(node, {})))  # type: ignore[arg-type]
                 for node, service in services.items())


__all__ = ["ClusterSpec", "Engine", "NatsSpec", "NodeSpec", "Role", "nodes_of"]
