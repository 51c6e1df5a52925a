"""Routing decisions, without I/O (docs/architecture.md, "Routing").

Three policies share every input and differ only in the decision, so an A/B between
them is honest:

* ``cpd`` - cold prompts (no usable prefix, reuse below a threshold, or loading slower
  than recomputing) go to the pre-prefill node with the least estimated finish time; warm
  prompts go to the prefill node with the least estimated TTFT = queue + KV load + suffix
  compute, where local hits beat remote ones because they cost less, or to an idle
  pre-prefill node that holds the prefix itself when that is sooner still (the prefix it
  just computed is in its engine: no transfer at all). Neither tier idles while the
  other queues: work overflows across tiers when that finishes sooner by more than a
  margin. A cold prompt whose prefix another node is computing right now waits for
  it when that is cheaper (single-flight).
* ``pd-kv`` - KV-aware cost like Dynamo/llm-d: every prefill-capable node is a
  candidate; cost = queue + compute of the blocks not cached on that node; no remote
  loads, no tiers.
* ``pd-rr`` - plain round-robin over prefill-capable nodes.

Decode goes to the least-loaded decode node for every policy.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from cpd.protocol import wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.roles import PREFILL_ROLES, Role
from cpd.protocol.wire import RouteReason
from services.router.breaker import SourceBreaker
from services.router.cost import LoadCost, PrefillCost
from services.router.elastic import lend_decode
from services.router.hits import Hits
from services.router.plans import NodeLoad, Plan, PolicyConfig, PolicyName, Wait
from services.router.queueing import ahead_ms, wait_ms

__all__ = ["POLICIES", "Decision", "NoCapacity", "NodeLoad", "Plan", "PolicyConfig",
           "PolicyName", "Router", "RoutingPolicy", "Wait", "choose_decode"]

class NoCapacity(CpdError):
    """No live node can take this request (none of the needed role is up)."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: a reason code and the figures behind it
    (:meth:`route` carries both; :meth:`wire.Route.describe` words them)."""

    policy: str
    path: Literal["cold", "warm", "overflow"]
    plan: Plan
    decode_node: str
    reason: RouteReason
    # The most any prefill node could reuse (what warm or cold was decided on).
    reusable_tokens: int = 0
    # On overflow: the estimated TTFT on the tier the request was taken from.
    busy_ttft_ms: float = 0.0
    wait: Wait | None = None
    waited_for: str = ""
    lookup_missed: bool = False   # decided without kvindex's answer
    decode_lent: bool = False     # decode stays on the prefill node (services.router.elastic)
    # A peer load the prefill tier declined as slower than recomputing, when the chosen
    # plan priced none of its own (the route carries the plan's own first).
    peer_load: wire.PeerLoad | None = None

    def route(self) -> wire.Route:
        """The decision as the ``Route`` of the final message."""
        p = self.plan
        return wire.Route(policy=self.policy, path=self.path, reason=self.reason,
                          prefill_node=p.node, decode_node=self.decode_node,
                          tokens=wire.PromptTokens(gpu=p.gpu_tokens, dram=p.dram_tokens,
                                                   disk=p.disk_tokens,
                                                   remote=p.remote_tokens,
                                                   computed=p.computed_tokens),
                          reusable_tokens=self.reusable_tokens,
                          planned_reused_tokens=p.reused_tokens,
                          est_ttft_ms=round(p.ttft_ms, 3),
                          busy_ttft_ms=round(self.busy_ttft_ms, 3),
                          remote_node=p.remote_node, waited_for=self.waited_for,
                          lookup_missed=self.lookup_missed, decode_lent=self.decode_lent,
                          peer_load=p.peer_load or self.peer_load)


class Router:
    """Plans every node and lets the configured :class:`RoutingPolicy` choose; stateful
    only for round-robin, everything else a function of the inputs."""

    def __init__(self, config: PolicyConfig, prefill: PrefillCost, load: LoadCost) -> None:
        self.config = config
        self.prefill = prefill
        self.load = load
        self.policy: RoutingPolicy = POLICIES[config.name]()
        # The priced work each node holds, by name, kept while its view (frozen) is the
        # same object: a decision plans every node several times, the router's node
        # table rebuilds a view only when the node changes, and the held work does not
        # depend on the request. Per decision: the two peers with the longest DRAM hits
        # (the best remote source of any node is one).
        self._ahead: dict[str, tuple[NodeLoad, list[float]]] = {}
        self._top: tuple[Hits, int, int, list[tuple[int, str]]] | None = None
        # Per decision: its nodes, and the disk read rates they measured (node → GB/s),
        # gathered only when a plan reads from disk (most decisions do not).
        self._nodes: list[NodeLoad] = []
        self._disk: dict[str, float] | None = None
        self.breaker = SourceBreaker(open_s=config.source_breaker_s)

    def observe(self, route: wire.Route) -> None:
        """Learn from a finished request's route which KV sources failed or served."""
        self.breaker.observe(route)

    def decide(self, prompt_tokens: int, block_size: int, hits: Hits,
               nodes: Iterable[NodeLoad]) -> Decision:
        """Route one request of ``prompt_tokens`` tokens."""
        if prompt_tokens <= 0:
            raise ValueError("a prompt has at least one token")
        nodes = list(nodes)
        if len(self._ahead) > 2 * len(nodes):  # nodes gone: keep the cache bounded
            self._ahead.clear()
        self._top = None
        self._nodes, self._disk = nodes, None
        decode = choose_decode(nodes)
        if not hits.ok:
            hits = Hits(ok=False)  # kvindex slow, stale or restarting: a miss, never a guess
        hits = self.breaker.filter(hits)  # no source whose last load failed
        d = self.policy.choose(self, prompt_tokens, block_size, hits, nodes, decode)
        d = lend_decode(d, nodes, self.config.decode_lend_at)
        return d if hits.ok else replace(d, lookup_missed=True)

    # -------------------------------------------------------------------- plans

    def plan(self, node: NodeLoad, prompt_tokens: int, block_size: int, hits: Hits, *,
             remote: bool = True, local: bool = True) -> Plan:
        """The cheapest way to prefill on ``node``: reuse its GPU hit, load its DRAM hit
        and a peer's DRAM hit when loading beats recomputing, compute the rest."""
        # The last token is always computed (the engine needs its logits).
        cap = (prompt_tokens - 1) // block_size * block_size
        gpu = min(hits.gpu.get(node.node, 0) * block_size, cap) if local else 0
        base = gpu
        dram = disk = 0
        sources: list[wire.LoadSource] = []
        load_ms = 0.0
        local_dram, t = self._local_load(hits, node.node, base, cap, block_size) \
            if local else (0, 0.0)
        if local_dram > base:
            sources.append(hits.source(node.node, base // block_size,
                                       (local_dram - base) // block_size))
            disk = hits.from_disk(node.node, base // block_size,
                                  local_dram // block_size) * block_size
            dram, load_ms, base = local_dram - base - disk, load_ms + t, local_dram
        remote_tokens, remote_node, peer = 0, "", None
        if remote:
            best = self._best_peer(hits, cap, block_size, node.node)
            if best[0] > base:
                bw = self._bandwidth(best[1], node)
                t = self.load.ms(best[0] - base, bw) + \
                    self._disk_ms(hits, best[1], base, best[0], block_size)
                instead = self.prefill.ms(best[0] - base, base)
                peer = wire.PeerLoad(peer=best[1], tokens=best[0] - base, gbps=bw,
                                     measured=node.bandwidth_gbps > 0, load_ms=round(t, 3),
                                     compute_ms=round(instead, 3), loaded=t < instead)
                if peer.loaded:
                    sources.append(hits.source(best[1], base // block_size,
                                               (best[0] - base) // block_size))
                    remote_tokens, remote_node = best[0] - base, best[1]
                    load_ms += t
                    base = best[0]
        computed = prompt_tokens - base
        compute_ms = self.prefill.ms(computed, base)
        return Plan(node=node.node, role=node.role, gpu_tokens=gpu, dram_tokens=dram,
                    disk_tokens=disk, remote_tokens=remote_tokens, remote_node=remote_node,
                    computed_tokens=computed, queue_ms=self.queue_ms(node, compute_ms),
                    load_ms=load_ms, compute_ms=compute_ms, sources=tuple(sources),
                    peer_load=peer)

    def _best_peer(self, hits: Hits, cap: int, bs: int, node: str) -> tuple[int, str]:
        """The peer of ``node`` with the longest DRAM hit (tokens up to ``cap``; ties to
        the larger name) and that hit: one of the two best overall, found once per
        decision instead of once per node (hundreds of prefill nodes, hundreds of peers)."""
        top = self._top
        if top is None or top[0] is not hits or top[1:3] != (cap, bs):
            top = self._top = (hits, cap, bs, heapq.nlargest(
                2, ((min(b * bs, cap), peer) for peer, b in hits.served.items())))
        return next((best for best in top[3] if best[1] != node), (0, ""))

    def queue_ms(self, node: NodeLoad, own_ms: float) -> float:
        """How long a prefill of ``own_ms`` waits on ``node`` behind what it holds."""
        cached = self._ahead.get(node.node)
        if cached is None or cached[0] is not node:
            cached = self._ahead[node.node] = (node, ahead_ms(
                node.prefills, node.dispatched_ms, self.prefill, node.shares_steps))
        return wait_ms(cached[1], own_ms, node.shares_steps)

    def _local_load(self, hits: Hits, node: str, base: int, cap: int, bs: int
                    ) -> tuple[int, float]:
        """How far ``node`` loads its own served blocks past ``base`` tokens, and in how
        long: through its disk prefix, else its DRAM prefix, when that beats recomputing."""
        for blocks in dict.fromkeys((hits.served.get(node, 0), hits.dram.get(node, 0))):
            end = min(blocks * bs, cap)
            if end <= base:
                continue
            t = self.load.ms(end - base, self.config.host_bandwidth_gbps) + \
                self._disk_ms(hits, node, base, end, bs)
            if t < self.prefill.ms(end - base, base):
                return end, t
        return 0, 0.0

    def _disk_ms(self, hits: Hits, node: str, start: int, end: int, bs: int) -> float:
        """Reading the part of tokens ``start``..``end`` that ``node`` holds on disk only,
        at the read rate ``node`` measured (the configured one until it has)."""
        blocks = hits.from_disk(node, start // bs, end // bs)
        if not blocks:
            return 0.0
        if self._disk is None:
            self._disk = {n.node: n.disk_gbps for n in self._nodes if n.disk_gbps}
        return self.load.ms(blocks * bs, self._disk.get(node) or self.config.disk_bandwidth_gbps)

    def _bandwidth(self, src: str, dst: NodeLoad) -> float:
        # Each worker measures what it achieves when pulling; the puller's figure counts.
        return dst.bandwidth_gbps or self.config.default_bandwidth_gbps


def _by_cost(p: Plan) -> tuple[float, float, str]:
    """The cheapest plan first: soonest first token, then shortest queue, then name."""
    return (p.ttft_ms, p.queue_ms, p.node)


class RoutingPolicy(ABC):
    """How one policy chooses among the router's plans (module doc); the router calls
    :meth:`choose` with the live nodes and the decode node already chosen."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, r: Router, n: int, bs: int, hits: Hits, nodes: list[NodeLoad],
               decode: str) -> Decision:
        """The decision for a prompt of ``n`` tokens in blocks of ``bs``."""


class CpdPolicy(RoutingPolicy):
    """Cold prompts to pre-prefill, warm ones to prefill, overflow and single-flight."""

    name = "cpd"

    def choose(self, r: Router, n: int, bs: int, hits: Hits, nodes: list[NodeLoad],
               decode: str) -> Decision:
        warm_nodes = [x for x in nodes if x.role == Role.PREFILL]
        cold_nodes = [x for x in nodes if x.role == Role.PREPREFILL]
        if not warm_nodes and not cold_nodes:
            raise NoCapacity("no prefill or pre-prefill node is up")
        warm = [r.plan(x, n, bs, hits) for x in warm_nodes]
        # Local hits beat remote ones at equal cost; then the shorter queue.
        warm.sort(key=lambda p: (p.ttft_ms, p.remote_tokens > 0, p.queue_ms, p.node))
        d = self._decide(r, n, bs, hits, warm_nodes, warm, cold_nodes, decode)
        # A prefix recomputed because loading it from a peer was slower says so, on
        # whichever tier the request went to (the chosen plan's own price comes first).
        declined = warm[0].peer_load if warm else None
        if d.plan.peer_load is None and declined is not None and not declined.loaded:
            return replace(d, peer_load=declined)
        return d

    def _decide(self, r: Router, n: int, bs: int, hits: Hits, warm_nodes: list[NodeLoad],
                warm: list[Plan], cold_nodes: list[NodeLoad], decode: str) -> Decision:
        """The decision, given the prefill nodes and their plans (``warm``, best first)."""
        cfg = r.config
        best_warm = warm[0] if warm else None
        reuse = best_warm.reused_tokens if best_warm else 0
        if cold_nodes and not best_warm:
            reuse = max((r.plan(x, n, bs, hits).reused_tokens for x in cold_nodes),
                        default=0)
        is_cold = (not hits.ok or reuse < min(cfg.min_reuse_tokens, n - 1) or reuse == 0
                   or reuse < cfg.cold_reuse_ratio * n)
        if not is_cold and best_warm is None:  # the pre-prefill tier has it all to itself
            own = self._cheapest(r, cold_nodes, n, bs, hits, reuse_prefix=True)
            assert own is not None  # no prefill node, so some pre-prefill node is up
            return Decision("cpd", "overflow", own, decode, RouteReason.NO_PREFILL,
                            reusable_tokens=reuse)
        if not is_cold:
            assert best_warm is not None
            # Overflow only relieves a queue: an idle tier keeps its own work (and the
            # pre-prefill tier is planned for it only then).
            alt = self._cheapest(r, cold_nodes, n, bs, hits, reuse_prefix=True) \
                if best_warm.queue_ms > cfg.overflow_margin_ms else None
            if alt and alt.ttft_ms + cfg.overflow_margin_ms < best_warm.ttft_ms:
                return Decision("cpd", "overflow", alt, decode, RouteReason.PREFILL_BUSY,
                                reusable_tokens=reuse, busy_ttft_ms=best_warm.ttft_ms)
            if own := self._idle_holder(r, cold_nodes, n, bs, hits, best_warm):
                return Decision("cpd", "warm", own, decode, RouteReason.IDLE_PREPREFILL_HIT,
                                reusable_tokens=reuse)
            return Decision("cpd", "warm", best_warm, decode, RouteReason.WARM,
                            reusable_tokens=reuse)
        reason = RouteReason.COLD if hits.ok else RouteReason.KVINDEX_UNAVAILABLE
        cold = self._cheapest(r, cold_nodes, n, bs, hits, reuse_prefix=False)
        # Overflow: a cold request takes an idle prefill node rather than queue (the
        # prefill nodes' plans are the warm ones already made).
        over = min(warm, key=_by_cost, default=None)
        if cold is None or (over and cold.queue_ms > cfg.overflow_margin_ms
                            and over.ttft_ms + cfg.overflow_margin_ms < cold.ttft_ms):
            assert over is not None
            why = (RouteReason.NO_PREPREFILL if cold is None
                   else RouteReason.PREPREFILL_BUSY)
            decision = Decision("cpd", "overflow", over, decode, why, reusable_tokens=reuse,
                                busy_ttft_ms=cold.ttft_ms if cold is not None else 0.0)
        else:
            decision = Decision("cpd", "cold", cold, decode, reason, reusable_tokens=reuse)
        wait = self._single_flight(r, n, bs, hits, warm_nodes, decision.plan) if hits.ok else None
        if wait is not None:
            decision = replace(decision, wait=wait)
        return decision

    def _cheapest(self, r: Router, nodes: list[NodeLoad], n: int, bs: int, hits: Hits, *,
                  reuse_prefix: bool) -> Plan | None:
        if not nodes:
            return None
        plans = [r.plan(x, n, bs, hits, remote=reuse_prefix, local=reuse_prefix)
                 if reuse_prefix else r.plan(x, n, bs, Hits(ok=False)) for x in nodes]
        return min(plans, key=_by_cost)

    def _idle_holder(self, r: Router, cold_nodes: list[NodeLoad], n: int, bs: int,
                     hits: Hits, best: Plan) -> Plan | None:
        """The idle pre-prefill node that holds the prefix itself (no transfer) and so
        finishes sooner than ``best``, the best prefill node's plan; None if there is none
        or the setting is off. Only an idle one: its tier is there for cold prompts."""
        if not r.config.warm_on_idle_preprefill:
            return None
        plans = [p for x in cold_nodes if not x.prefills and not x.dispatched_ms
                 for p in (r.plan(x, n, bs, hits, remote=False),)
                 if p.reused_tokens and p.ttft_ms < best.ttft_ms]
        return min(plans, key=lambda p: (p.ttft_ms, p.node), default=None)

    def _single_flight(self, r: Router, n: int, bs: int, hits: Hits,
                       warm_nodes: list[NodeLoad], now: Plan) -> Wait | None:
        """Wait for a prefix another node is computing when, once it is visible, the
        request is warm and finishes about as soon as going ahead now (within the
        overflow margin): equal latency, and that prefix is computed once, not twice."""
        cfg = r.config
        if not cfg.single_flight or not hits.pending or not warm_nodes:
            return None
        node, blocks = max(hits.pending.items(), key=lambda kv: (kv[1], kv[0]))
        covered = min(blocks * bs, (n - 1) // bs * bs)
        if covered < max(cfg.min_reuse_tokens, cfg.cold_reuse_ratio * n):
            return None  # even after the wait it would be cold
        # Upper bound: that node computing the whole pending prefix from now on.
        wait_ms = r.prefill.ms(covered, 0)
        suffix_ms = r.prefill.ms(n - covered, covered)
        # The least loaded prefill node works off what it holds while the prefix is
        # computed: the suffix starts after the later of the two.
        queue = min(r.queue_ms(x, suffix_ms) for x in warm_nodes)
        after = (max(wait_ms, queue) + r.load.ms(covered, cfg.default_bandwidth_gbps)
                 + suffix_ms)
        if after > now.ttft_ms + cfg.overflow_margin_ms or wait_ms > cfg.max_single_flight_wait_ms:
            return None
        return Wait(node=node, blocks=covered // bs, max_wait_ms=wait_ms)


class KvAwarePolicy(RoutingPolicy):
    """Every prefill-capable node a candidate at its own cached prefix; no tiers."""

    name = "pd-kv"

    def choose(self, r: Router, n: int, bs: int, hits: Hits, nodes: list[NodeLoad],
               decode: str) -> Decision:
        cands = [x for x in nodes if x.role in PREFILL_ROLES]
        if not cands:
            raise NoCapacity("no prefill node is up")
        plans = [r.plan(x, n, bs, hits, remote=False) for x in cands]
        best = min(plans, key=lambda p: (p.ttft_ms, p.queue_ms, p.node))
        return Decision("pd-kv", "warm" if best.reused_tokens else "cold", best, decode,
                        RouteReason.LEAST_COST, reusable_tokens=best.reused_tokens)


class RoundRobinPolicy(RoutingPolicy):
    """Prefill-capable nodes in turn."""

    name = "pd-rr"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, r: Router, n: int, bs: int, hits: Hits, nodes: list[NodeLoad],
               decode: str) -> Decision:
        cands = sorted((x for x in nodes if x.role in PREFILL_ROLES), key=lambda x: x.node)
        if not cands:
            raise NoCapacity("no prefill node is up")
        node = cands[next(self._turn) % len(cands)]
        # The engine still uses its own GPU prefix cache; the router just doesn't look.
        plan = r.plan(node, n, bs, Hits(ok=hits.ok, gpu=hits.gpu), remote=False)
        return Decision("pd-rr", "warm" if plan.reused_tokens else "cold", plan, decode,
                        RouteReason.ROUND_ROBIN, reusable_tokens=plan.reused_tokens)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (CpdPolicy, KvAwarePolicy, RoundRobinPolicy)}


def choose_decode(nodes: Iterable[NodeLoad]) -> str:
    """The least-loaded decode node: the fewest requests in flight, then the name
    (decode nodes hold no prefills: their load is the requests they decode)."""
    best = min((x for x in nodes if x.role == Role.DECODE),
               key=lambda x: (x.in_flight, x.node), default=None)
    if best is None:
        raise NoCapacity("no decode node is up")
    return best.node
