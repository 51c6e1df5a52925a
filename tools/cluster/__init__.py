"""One launcher for a CPD cluster on this machine: a :class:`ClusterSpec` (nodes, NATS,
settings) run as a :class:`Cluster` of service processes, plus the process machinery
``cpd up`` (:mod:`tools.supervisor`) shares with it.

``spec`` says what runs, ``procs`` starts and stops one process (its whole group),
``ready`` says when a node serves, ``state`` holds a cluster's parts, ``cluster`` runs
them together.
"""

from tools.cluster.cluster import Cluster
from tools.cluster.procs import (
    SERVICE_ORDER,
    UP_DEFAULT,
    Proc,
    engine_placements,
    env_overrides,
    kill_tree,
    last_log_line,
    log_tail,
    override_env,
    plan_nodes,
    restart_proc,
    settings_env,
    start_failure,
    stop_tree,
)
from tools.cluster.ready import (
    PROGRESS_EVERY_S,
    heartbeat_since,
    kvindex_serving,
    report_starting,
    router_sees,
    until_ready,
    wait_ready,
)
from tools.cluster.spec import (
    METRICS_PORT_ENV,
    ClusterSpec,
    Engine,
    NatsSpec,
    NodeSpec,
    Role,
    hosts_kvindex,
    nodes_of,
)

__all__ = ["METRICS_PORT_ENV", "PROGRESS_EVERY_S", "SERVICE_ORDER",
           "UP_DEFAULT", "Cluster", "ClusterSpec",
           "Engine", "NatsSpec", "NodeSpec", "Proc", "Role", "engine_placements",
           "env_overrides", "heartbeat_since", "hosts_kvindex", "kill_tree", "kvindex_serving",
           "last_log_line", "log_tail", "nodes_of", "override_env", "plan_nodes",
           "report_starting", "restart_proc", "router_sees", "settings_env",
           "start_failure", "stop_tree", "until_ready", "wait_ready"]
