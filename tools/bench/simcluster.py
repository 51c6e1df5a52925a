"""A whole CPD cluster of real service processes on simulated engines (``worker.engine =
"sim"``): embedded NATS, kvindex, sim workers, router. Shared by ``cpd bench sweep``
(:mod:`bench.sweep`) and the fault harness (:mod:`bench.faults`).

It is a :class:`tools.cluster.Cluster` with these roles: the harness also needs what an
operator's supervisor does (``cpd up``): :meth:`~tools.cluster.Cluster.supervise`
restarts a service that died, NATS included, and the fault verbs (``kill``, ``pause``,
``resume``, ``restart_nats``) act on the real processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cpd.protocol import subjects, wire
from tools.cluster import Cluster, ClusterSpec, NatsSpec, NodeSpec, env_overrides, nodes_of

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class SimCluster(Cluster):
    """NATS, kvindex, sim workers (``nodes``: node id → role) and a router, as processes.

    ``env``: settings for every process (``CPD_<SECTION>__<FIELD>``); ``node_env``: extra
    environment of single nodes (a NATS URL through a fault proxy, an advertised port);
    ``nats_port``: a fixed NATS port (a proxy in front of it is set up before NATS runs);
    ``routers``: more router replicas besides ``router_node`` (clients reach any of them);
    ``gateways``: gateway processes (node id → HTTP port on 127.0.0.1, base URLs in
    :attr:`gateway_urls`). Logs, snapshots and NATS's store go to ``tmp``, which the
    caller owns.
    """

    def __init__(self, nodes: Mapping[str, str], tmp: Path, *, label: str = "cluster",
                 env: Mapping[str, str] | None = None,
                 node_env: Mapping[str, Mapping[str, str]] | None = None,
                 router_node: str = "router", kvindex_node: str = "kvi",
                 nats_port: int = 0, routers: Sequence[str] = (),
                 gateways: Mapping[str, int] | None = None) -> None:
        every = {kvindex_node: "kvindex", **nodes, router_node: "router",
                 **dict.fromkeys(routers, "router")}
        gateways = dict(gateways or {})
        front = tuple(NodeSpec(node, "gateway", overrides=(
            f"gateway.port={port}", "gateway.host=127.0.0.1")) for node, port in gateways.items())
        super().__init__(ClusterSpec(
            nodes=nodes_of(every, node_env) + front, nats=NatsSpec(port=nats_port),
            overrides=env_overrides(env or {}), workdir=tmp, label=label,
            ready_timeout_s=READY_TIMEOUT_S, stop_timeout_s=STOP_TIMEOUT_S))
        self.nodes = dict(nodes)
        self.tmp = tmp
        self.router_node = router_node
        self.routers = (router_node, *routers)
        self.kvindex_node = kvindex_node
        self.gateway_urls = {node: f"http://127.0.0.1:{port}" for node, port in gateways.items()}

    async def start(self) -> SimCluster:
        """Start NATS, then kvindex, the workers and the router, each stage serving
        before the next (the router once it sees every worker); connect :attr:`client`."""
        await super().start()
        await self.connect()
        return self

    async def reset_caches(self) -> None:
        """Drop every engine's own prefix cache (the GPU tier)."""
        for node, role in self.nodes.items():
            await self.bus.request(subjects.admin(role, node), wire.ResetCache(reason="bench"),
                                   expect=wire.Accepted, timeout=5.0)


__all__ = ["SimCluster"]
