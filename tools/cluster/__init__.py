"""One launcher for a CPD cluster on this machine: a :class:`ClusterSpec` (nodes, NATS,
settings) run as a :class:`Cluster` of service processes, plus the process machinery
``cpd up`` (:mod:`tools.supervisor`) shares with it.

``spec`` says what runs, ``procs`` starts and stops one process (its whole group),
``ready`` says when a node serves, ``cluster`` runs them together.
"""

from tools.cluster.cluster import METRICS_PORT_ENV, Cluster
from tools.cluster.procs import (
    SERVICE_ORDER,
    Proc,
    engine_placements,
    env_overrides,
    kill_tree,
    log_tail,
    override_env,
    plan_nodes,
    restart_proc,
    settings_env,
    stop_tree,
)
from tools.cluster.ready import (
    heartbeat_since,
    kvindex_serving,
    router_sees,
    until_ready,
    wait_ready,
)
from tools.cluster.spec import ClusterSpec, Engine, NatsSpec, NodeSpec, Role, nodes_of

__all__ = ["METRICS_PORT_ENV", "SERVICE_ORDER", "Cluster", "ClusterSpec", "Engine", "NatsSpec",
           "NodeSpec", "Proc", "Role", "engine_placements", "env_overrides", "heartbeat_since",
           "kill_tree", "kvindex_serving", "log_tail", "nodes_of", "override_env",
           "plan_nodes", "restart_proc", "router_sees", "settings_env", "stop_tree",
           "until_ready", "wait_ready"]
