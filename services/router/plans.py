"""What the routing policies plan with (docs/architecture.md, "Routing"): workers as the
router sees them, the policies' knobs, one way to prefill a request on one node, and a
single-flight wait. Pure data; :mod:`services.router.policy` decides with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cpd.ops.config import RouterSettings
from cpd.protocol import wire
from cpd.protocol.roles import Role

PolicyName = Literal["cpd", "pd-kv", "pd-rr"]


@dataclass(frozen=True)
class NodeLoad:
    """A worker as the router sees it (from its load reports and heartbeats)."""

    node: str
    role: Role
    queued_new_tokens: int = 0
    in_flight: int = 0
    bandwidth_gbps: float = 0.0  # measured by the worker; 0 until it has measured
    disk_gbps: float = 0.0       # its disk tier's measured read rate; 0: none measured
    # Its queue, as the router prices it (services.router.queueing): the prefills it
    # reported holding, the estimated ms of each request sent to it since, and whether
    # its prefills share steps (a long-prefill cap).
    prefills: tuple[wire.PrefillWork, ...] = ()
    dispatched_ms: tuple[float, ...] = ()
    shares_steps: bool = False
    # A prefill-side node that also decodes (its heartbeat says so).
    decodes: bool = False


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the routing policies (from :class:`cpd.ops.config.RouterSettings`)."""

    name: PolicyName = "cpd"
    # Reuse below this share of the prompt makes a request cold.
    cold_reuse_ratio: float = 0.5
    # Reuse below this many tokens makes a request cold whatever the share.
    min_reuse_tokens: int = 256
    # Cross-tier overflow only when it finishes sooner by more than this.
    overflow_margin_ms: float = 100.0
    # A warm request may take an idle pre-prefill node that holds its prefix itself.
    warm_on_idle_preprefill: bool = True
    # The decode stays on a prefill node that decodes once the least loaded decode node
    # holds this many requests (services.router.elastic); 0: never.
    decode_lend_at: int = 0
    # Until a node reports a measured bandwidth.
    default_bandwidth_gbps: float = 1.0
    # Loading from a node's own DRAM into its engine.
    host_bandwidth_gbps: float = 8.0
    # Reading blocks from a node's disk tier into its arena, until it reports a measured
    # read rate.
    disk_bandwidth_gbps: float = 2.0
    single_flight: bool = True
    max_single_flight_wait_ms: float = 30_000.0
    # A KV source whose planned load failed is not planned again for this long,
    # doubled on each failure in a row (services.router.breaker).
    source_breaker_s: float = 2.0

    @classmethod
    def from_settings(cls, router: RouterSettings) -> PolicyConfig:
        """The policy of ``[router]`` (the router service and the planner both build
        theirs here, so they cannot drift apart)."""
        return cls(name=router.policy, cold_reuse_ratio=router.cold_reuse_ratio,
                   min_reuse_tokens=router.min_reuse_tokens,
                   overflow_margin_ms=router.overflow_margin_ms,
                   warm_on_idle_preprefill=router.warm_on_idle_preprefill,
                   decode_lend_at=router.decode_lend_at,
                   default_bandwidth_gbps=router.default_bandwidth_gbps,
                   host_bandwidth_gbps=router.host_bandwidth_gbps,
                   disk_bandwidth_gbps=router.disk_bandwidth_gbps,
                   single_flight=router.single_flight,
                   max_single_flight_wait_ms=router.max_single_flight_wait_ms,
                   source_breaker_s=router.source_breaker_s)


@dataclass(frozen=True)
class Plan:
    """One way to prefill the request on one node, with its estimated cost."""

    node: str
    role: Role
    gpu_tokens: int = 0
    dram_tokens: int = 0
    disk_tokens: int = 0   # of the node's own, read back from its disk tier
    remote_tokens: int = 0
    remote_node: str = ""
    computed_tokens: int = 0
    queue_ms: float = 0.0
    load_ms: float = 0.0
    compute_ms: float = 0.0
    sources: tuple[wire.LoadSource, ...] = ()
    # The best peer's load, priced against recomputing (taken or not).
    peer_load: wire.PeerLoad | None = None

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.load_ms + self.compute_ms

    @property
    def reused_tokens(self) -> int:
        return self.gpu_tokens + self.dram_tokens + self.disk_tokens + self.remote_tokens


@dataclass(frozen=True)
class Wait:
    """Single-flight: wait for ``node`` to make ``blocks`` blocks visible, then re-route."""

    node: str
    blocks: int
    max_wait_ms: float
