"""What a :class:`~tools.cluster.Cluster` is made of (its spec, NATS, its node processes,
its workdir) and what can be read of it without changing anything."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from cpd.ops.natsserver import NatsServer
from cpd.protocol.errors import CpdError
from cpd.protocol.roles import WORKER_ROLES
from tools.bench.proccpu import cpu_seconds
from tools.cluster.procs import Proc, log_tail
from tools.cluster.spec import ClusterSpec

T = TypeVar("T")


class ClusterState:
    """The parts of a cluster and reads of them (:class:`~tools.cluster.Cluster` runs
    them)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsServer | None = None
        self.procs: dict[str, Proc] = {}
        self._workdir = spec.workdir

    @property
    def workdir(self) -> Path:
        """Logs (``<node>.log``, ``nats.log``), ``nats/`` and ``snap/``."""
        return self._need(self._workdir)

    @property
    def url(self) -> str:
        """NATS's URL."""
        return self._need(self.nats).url

    @property
    def workers(self) -> dict[str, str]:
        """``node id -> role`` of every worker."""
        return {n.node_id: n.service for n in self.spec.nodes if n.service in WORKER_ROLES}

    def pid(self, node: str) -> int:
        """The node's process id (of its current incarnation)."""
        return self._need(self.procs[node].popen, f"{node} has not started").pid

    def _need(self, value: T | None, why: str = "not started") -> T:
        """``value``, which exists once the cluster (or that part of it) started."""
        if value is None:
            raise CpdError(f"{self.spec.label}: {why}")
        return value

    def alive(self, node: str) -> bool:
        """Whether the node's process runs."""
        return self.procs[node].alive()

    def dead(self) -> list[str]:
        """Nodes whose process is not running."""
        return [n for n, p in self.procs.items() if not p.alive()]

    def log_path(self, node: str) -> Path:
        """The node's log (every start of it appended)."""
        return self.workdir / f"{node}.log"

    def log_tail(self, node: str, chars: int = 3000) -> str:
        """The last ``chars`` characters of the node's log."""
        return log_tail(self.log_path(node), chars)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each node's process has used so far."""
        out = {}
        for node, p in self.procs.items():
            if p.popen is not None and (s := cpu_seconds(p.popen.pid)) is not None:
                out[node] = round(s, 2)
        return out


__all__ = ["ClusterState"]
