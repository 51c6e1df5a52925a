"""The router's view of the workers, from their heartbeats and load reports. Pure: the
caller passes the clock, so liveness rules are unit-testable without a server."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpd.protocol import wire
from cpd.protocol.roles import PREFILL_ROLES, WORKER_ROLES, Role
from services.router.cost import PrefillCost
from services.router.policy import NodeLoad
from services.router.queueing import ahead_ms

_MAX_DISPATCHED = 256  # entries kept per node between two of its load reports


@dataclass
class _Node:
    node: str
    role: Role
    last_seen: float
    lease_ttl_s: float
    namespace: str = ""
    capacity_blocks: int = 0
    load: wire.LoadReport | None = None
    started_unix_ms: int = 0
    decodes: bool = False        # a prefill-side node that also serves decode
    # Work this router sent since the node's last load report (estimated ms per
    # request): without it, a burst between two reports would all land on the node
    # that looked idlest.
    dispatched_ms: list[float] = field(default_factory=list)
    # What the policy sees of it, built once per change (a heartbeat, a load report, a
    # dispatch), not once per decision.
    view: NodeLoad | None = None

    def load_view(self) -> NodeLoad:
        """The node as the policy sees it (:class:`NodeLoad`)."""
        if self.view is None:
            r = self.load
            self.view = NodeLoad(node=self.node, role=self.role,
                                 queued_new_tokens=r.queued_new_tokens if r else 0,
                                 in_flight=r.in_flight if r else 0,
                                 bandwidth_gbps=r.kv_bandwidth_gbps if r else 0.0,
                                 disk_gbps=r.disk_read_gbps if r else 0.0,
                                 prefills=tuple(r.prefills) if r else (),
                                 dispatched_ms=tuple(self.dispatched_ms),
                                 shares_steps=bool(r and r.prefill_token_cap),
                                 decodes=self.decodes)
        return self.view


@dataclass
class NodeTable:
    """Live workers of one namespace. A node is alive while its lease (heartbeat or load
    report within ``lease_ttl``) holds; a node that restarts with a new epoch is the same
    name with a fresh state."""

    namespace: str = ""
    _nodes: dict[str, _Node] = field(default_factory=dict)
    foreign: set[str] = field(default_factory=set)

    def heartbeat(self, hb: wire.Heartbeat, now: float) -> None:
        """Record a heartbeat; nodes serving another namespace (model) are kept out."""
        if hb.role not in WORKER_ROLES:
            return
        if self.namespace and hb.namespace and hb.namespace != self.namespace:
            self.foreign.add(hb.node)
            return
        self.foreign.discard(hb.node)
        n = self._nodes.get(hb.node)
        if n is None or n.started_unix_ms != hb.started_unix_ms or n.role != hb.role:
            n = self._nodes[hb.node] = _Node(hb.node, Role(hb.role), now,
                                             hb.lease_ttl_ms / 1000)
        n.last_seen = now
        n.lease_ttl_s = hb.lease_ttl_ms / 1000
        n.namespace = hb.namespace
        n.capacity_blocks = hb.capacity_blocks
        n.started_unix_ms = hb.started_unix_ms
        n.decodes = hb.decodes and n.role in PREFILL_ROLES
        n.view = None

    def load_report(self, report: wire.LoadReport, now: float) -> None:
        """Record a load report (it renews liveness too: a node that reports is alive)."""
        n = self._nodes.get(report.node)
        if n is None or n.role != report.role:
            return  # heartbeats introduce nodes; a report alone does not say its namespace
        n.load = report
        n.last_seen = now
        n.dispatched_ms = []
        n.view = None

    def dispatched(self, node: str, est_ms: float) -> None:
        """Note work just sent to ``node`` until its next load report accounts for it."""
        n = self._nodes.get(node)
        if n is not None:
            n.dispatched_ms.append(est_ms)
            if len(n.dispatched_ms) > _MAX_DISPATCHED:  # a node that stopped reporting
                n.dispatched_ms[:] = [sum(n.dispatched_ms)]
            n.view = None

    def alive(self, node: str, now: float, epoch: int = 0) -> bool:
        """Whether ``node`` holds its lease; with ``epoch``, the incarnation started
        then (a restart under the same name is a different node to its old requests)."""
        n = self._nodes.get(node)
        return (n is not None and now - n.last_seen <= n.lease_ttl_s
                and (not epoch or n.started_unix_ms == epoch))

    def epoch(self, node: str) -> int:
        """The start time (``Heartbeat.started_unix_ms``) of the node's current
        incarnation; 0 if unknown."""
        n = self._nodes.get(node)
        return n.started_unix_ms if n is not None else 0

    def live(self, now: float, exclude: frozenset[str] = frozenset()) -> list[NodeLoad]:
        """Every live worker as the policy sees it."""
        return [n.load_view() for n in self._nodes.values()
                if n.node not in exclude and now - n.last_seen <= n.lease_ttl_s]

    def status(self, now: float, cost: PrefillCost) -> list[wire.NodeStatus]:
        """Every node ever heard of, alive or not, for ``cpd status``; a node's queue is
        what the router prices its held prefills at with ``cost`` (the compute they still
        need), plus what it dispatched there since the node's last report."""
        out = []
        for n in sorted(self._nodes.values(), key=lambda x: (x.role, x.node)):
            r = n.load or wire.LoadReport(node=n.node, role=n.role)  # type: ignore[arg-type]
            queue_ms = sum(ahead_ms(r.prefills, n.dispatched_ms, cost,
                                    bool(r.prefill_token_cap)))
            out.append(wire.NodeStatus(
                node=n.node, role=n.role, alive=now - n.last_seen <= n.lease_ttl_s,
                last_seen_ms=max(0.0, (now - n.last_seen) * 1000),
                queue_depth=r.queue_depth, queued_new_tokens=r.queued_new_tokens,
                est_queue_ms=queue_ms, in_flight=r.in_flight,
                dram_used_bytes=r.dram_used_bytes, dram_total_bytes=r.dram_total_bytes,
                kv_bandwidth_gbps=r.kv_bandwidth_gbps, capacity_blocks=n.capacity_blocks,
                disk_used_bytes=r.disk_used_bytes, disk_total_bytes=r.disk_total_bytes,
                disk_read_gbps=r.disk_read_gbps, decodes=n.decodes))
        return out

    def serves_every_role(self, now: float) -> bool:
        """Whether live nodes can take a request from prefill to decode: a node of a
        prefill role and a decode node hold their leases."""
        roles = {n.role for n in self._nodes.values() if now - n.last_seen <= n.lease_ttl_s}
        return Role.DECODE in roles and bool(roles & {Role.PREFILL, Role.PREPREFILL})

    def forget_dead(self, now: float, after_s: float) -> None:
        """Drop nodes silent for ``after_s`` (bounded memory with churning node ids)."""
        for name in [k for k, n in self._nodes.items() if now - n.last_seen > after_s]:
            del self._nodes[name]
