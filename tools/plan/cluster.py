"""One topology serving one workload in simulated time: the planner's discrete-event
simulation (docs/plan.md, "The simulation").

Everything that decides is the services' own pure code; only the I/O is replaced:

* **Routing** — :class:`services.router.policy.Router`, built by
  :func:`services.router.service.make_policy` as the router service builds its own,
  fed the :class:`~services.router.policy.Hits` kvindex would answer and the
  :class:`~services.router.policy.NodeLoad` the workers' load reports would give
  (held prefills with their time in the engine), as late as the workers' reports
  make them: a worker reports every ``report_interval_s`` and at once when a held
  prefill starts or ends, so the router sees every held prefill, its time in the
  engine as of the node's last report. (The router service's own estimates of work it
  sent, ``dispatched_ms``, last only until that report, taken here as immediate.)
  Single-flight waits are honoured as the router does (woken when the prefix is
  sealed, then decide once more).
* **Engines** — :class:`cpd.sim.scheduler.Scheduler` with the node's cost preset and
  the sim engine's admission rule (its GPU prefix cache first, then the arena blocks the
  worker found sealed, every new full block written through); decode nodes step through
  whole decode spans (:meth:`~cpd.sim.scheduler.Scheduler.decode_span`), which price
  exactly the steps one by one would.
* **Caches** — each worker's GPU prefix cache and DRAM arena as a
  :class:`~tools.plan.prefixstore.PrefixStore` of their capacities, the GPU cache by
  LRU, the arena by its own policy (``dataplane.eviction``), both prefix-closed; a
  block's use is a hit in the engine or a pin in the arena (a load, a peer's pull, a
  hand-off), a router's look-up is none; looked up per location by binary search as
  kvindex does.
* **Transfers** — a peer pull costs :class:`services.router.cost.LoadCost` (the data
  plane's fixed cost plus bytes over the network bandwidth), one pull at a time per
  receiving node; loads from a node's own arena into its engine are the cost model's
  host link, inside the step (prefill) or off it (decode), as the sim engine does.
* **Client** — the load driver's open loop: at most ``max_inflight`` requests out, the
  rest in a FIFO whose wait counts in TTFT (measured from the scheduled arrival).

The flow of one request is the workers': route → pull the planned remote prefix →
prefill, its new blocks sealed (visible to kvindex) as each chunk ends → first token →
hand-off: decode pulls what it lacks → decode to the last token. The services' own
latency around the engines is charged as fixed delays (``dispatch_s``, ``relay_s``,
``handoff_s``; docs/plan.md, "What the services add").
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from cpd.kvstore import CopiesFirstGate, evicts_copies_first
from cpd.kvstore.eviction import EvictionName
from cpd.ops.config import DecodeCopiesFirst
from cpd.protocol import wire
from cpd.protocol.roles import PREFILL_ROLES, Role
from cpd.sim.costmodel import CostModel
from cpd.sim.scheduler import Admission, Scheduler, SchedulerConfig
from cpd.sim.workloads import WorkloadRequest
from services.router.hits import Hits
from services.router.policy import Decision, NodeLoad, Plan, Router
from tools.bench.loaddriver import UNFINISHED, Result
from tools.plan.blocks import engine_blocks
from tools.plan.prefixstore import Copies, PrefixStore

# A single-flight waiter resumes this long after the awaited node sealed the prefix:
# kvindex's visibility event reaching the router, and its look-up (services/router/
# waiters.py; the wake-up benchmark measures it).
SINGLE_FLIGHT_WAKE_S = 0.002
# The services' latency around the engines, as measured on the real services with sim
# engines at a low load (tools.plan.fidelity; docs/plan.md, "What the services add").
DISPATCH_S = 0.0075
RELAY_S = 0.0035
HANDOFF_S = 0.002


@dataclass(frozen=True)
class NodeSpec:
    """One worker: its id, role and cost preset."""

    name: str
    role: str
    cost: CostModel


@dataclass(frozen=True)
class ClusterConfig:
    """A topology and everything its simulation needs besides the workload."""

    nodes: tuple[NodeSpec, ...]
    scheduler: SchedulerConfig
    # Which engines load arena KV off the step (worker.async_kv_load).
    async_kv_load: str = "decode"
    block_size: int = 256
    # The engine's GPU prefix cache in blocks (None: from each preset's GPU memory).
    gpu_cache_blocks: int | None = None
    # Host DRAM each worker gives its block arena, and the arena's eviction policy
    # (dataplane.eviction).
    dram_bytes: int = 2 << 40
    eviction: EvictionName = "tinylfu"
    # Whether a decode node's arena evicts copies first too (dataplane.decode_copies_first).
    decode_copies_first: DecodeCopiesFirst = "adaptive"
    # Each worker's disk tier below its arena (dataplane.disk_bytes; 0: none), which
    # every sealed block is written behind to, evicting by the same policy, and its
    # read rate (GB/s; the router's router.disk_bandwidth_gbps, which prices it).
    disk_bytes: int = 0
    disk_gbps: float = 2.0
    # Prefill-side workers also decode (worker.serve_decode): the router may keep a
    # request's decode on its prefill node (router.decode_lend_at).
    prefill_decodes: bool = False
    # Between nodes, per receiving node (GB/s of modelled KV bytes).
    network_gbps: float = 50.0
    max_inflight: int = 24
    # Workers' load reports (worker.load_report_interval_s; 0: the router always sees
    # the present).
    report_interval_s: float = 0.15
    # The services' own latency (simulated seconds; docs/plan.md, "What the services
    # add"): from the client's send to the request in the prefill node's engine (the
    # router's look-up and decision, its bus hop, the worker's admission), from a
    # worker's token to the client (the worker's and the router's bus hops), and from
    # the first token to decode having the hand-off.
    dispatch_s: float = DISPATCH_S
    relay_s: float = RELAY_S
    handoff_s: float = HANDOFF_S

    def __post_init__(self) -> None:
        if not any(n.role == Role.DECODE for n in self.nodes):
            raise ValueError("a topology needs a decode node")
        if not any(n.role in PREFILL_ROLES for n in self.nodes):
            raise ValueError("a topology needs a prefill-side node")
        if self.max_inflight < 1 or self.network_gbps <= 0:
            raise ValueError("max_inflight and network_gbps must be > 0")


@dataclass(slots=True)
class _Held:
    """A prefill a node holds, as its load report lists it."""

    new_tokens: int
    context_tokens: int
    start: float = -1.0        # in the engine since (-1: still pulling)


@dataclass
class _Req:
    w: WorkloadRequest
    blocks: tuple[int, ...]          # full engine blocks
    sent: float = -1.0
    routed: float | None = None      # dispatched to its prefill node
    entered: float | None = None     # in the prefill node's engine (its pull done)
    decode_in: float | None = None   # in the decode node's engine
    prefilled: float | None = None   # the first token left the prefill node
    first: float | None = None       # ... and reached the client
    finish: float | None = None
    decision: Decision | None = None
    waited: bool = False
    # Per node it is on: arena blocks found sealed when it entered the engine.
    dram_have: int = 0
    sealed: int = 0                  # leading blocks its prefill node has sealed
    cached_tokens: int = 0
    tokens: wire.PromptTokens = field(default_factory=wire.PromptTokens)


class _Node:
    def __init__(self, spec: NodeSpec, cfg: ClusterConfig, copies: Copies | None = None
                 ) -> None:
        self.name, self.role, self.cost = spec.name, spec.role, spec.cost
        bs = cfg.block_size
        async_load = cfg.async_kv_load == "all" or (cfg.async_kv_load == "decode"
                                                    and spec.role == Role.DECODE)
        sc = replace(cfg.scheduler, block_size=bs, async_kv_load=async_load)
        self.sched = Scheduler(spec.cost, sc, admit_hook=self._admit)
        gpu = (cfg.gpu_cache_blocks if cfg.gpu_cache_blocks is not None
               else spec.cost.kv_capacity_tokens // bs)
        self.gpu = PrefixStore(gpu)
        block_bytes = spec.cost.kv_bytes_per_token * bs
        # The arena evicts blocks with a copy elsewhere first (kvindex tells it which), a
        # decode node's as dataplane.decode_copies_first says (as the workers' arenas).
        self.dram = PrefixStore(cfg.dram_bytes // block_bytes, eviction=cfg.eviction,
                                copies=copies, copies_first=evicts_copies_first(
                                    spec.role, cfg.decode_copies_first))
        self.copies_gate = (CopiesFirstGate(cfg.decode_copies_first)
                            if spec.role == Role.DECODE and copies is not None else None)
        self.disk = (PrefixStore(cfg.disk_bytes // block_bytes, eviction=cfg.eviction,
                                 copies=copies) if cfg.disk_bytes else None)
        if copies is not None and spec.role in PREFILL_ROLES:
            copies.join_engine(self.gpu)
        self.disk_free = 0.0      # its disk reads, one at a time
        self.writing: Counter[int] = Counter()   # arena blocks allocated, not sealed
        self.reqs: dict[str, _Req] = {}           # in the engine
        # Prefills held (pulling or in the engine).
        self.held: dict[str, _Held] = {}
        # When a held prefill last started or ended: the worker reports such a change at
        # once (services.worker.load), besides its periodic report.
        self.changed = 0.0
        self.busy = False
        self.epoch = 0            # a step end scheduled under an older epoch is void
        self.span: tuple[float, object] | None = None
        self.nic_free = 0.0
        self.busy_s = 0.0
        self.waiters: list[_Req] = []            # single-flight requests waiting on us
        self.prefill_role = spec.role in PREFILL_ROLES

    def prefilling(self, r: _Req) -> bool:
        """Whether ``r`` is in its prefill here (not its decode, which a prefill-side
        node may keep: router.decode_lend_at)."""
        return self.prefill_role and r.decode_in is None

    def keep(self, blocks: Sequence[int], upto: int) -> None:
        """``blocks[:upto]`` sealed in the arena, and written behind to the disk tier."""
        self.dram.insert(blocks, upto)
        if self.disk is not None:
            self.disk.insert(blocks, upto)

    def _admit(self, rid: str) -> Admission:
        """The sim engine's rule (cpd.engines.sim.engine.SimEngine._admit)."""
        r = self.reqs[rid]
        bs = self.sched.config.block_size
        n = len(r.blocks)
        prefilling = self.prefilling(r)
        cap = (r.w.prompt_len - 1) // bs if prefilling else min(r.w.prompt_len // bs, n)
        gpu = self.gpu.hit(r.blocks, cap)
        have = min(r.dram_have, cap)
        loaded = max(have - gpu, 0)
        cached = max(gpu, have) * bs
        if not prefilling:  # decode: what the client sees was the prefill's
            return Admission(cached_tokens=cached, load_tokens=loaded * bs)
        r.cached_tokens = cached
        r.tokens.gpu, r.tokens.dram = gpu * bs, loaded * bs
        return Admission(cached_tokens=cached, load_tokens=loaded * bs,
                         save_blocks=range(r.dram_have, n))


@dataclass
class SimResult:
    """What one simulated run gives."""

    results: list[Result]
    paths: Counter[str] = field(default_factory=Counter)
    tokens: wire.PromptTokens = field(default_factory=wire.PromptTokens)
    busy_s: dict[str, float] = field(default_factory=dict)
    end_s: float = 0.0
    events: int = 0
    # (prompt tokens, block size, hits, nodes, decision) of the first decisions, when
    # asked for: the inputs a router given them must decide the same on.
    decisions: list[tuple[int, int, Hits, list[NodeLoad], Decision]] = field(
        default_factory=list)


class Cluster:
    """The simulation of one :class:`ClusterConfig` (see the module doc)."""

    def __init__(self, cfg: ClusterConfig, router: Router, record_decisions: int = 0) -> None:
        self.cfg = cfg
        # Every arena's and disk tier's blocks, as kvindex counts them.
        self.copies = copies = Copies()
        self.nodes = {s.name: _Node(s, cfg, copies) for s in cfg.nodes}
        self.workers = list(self.nodes.values())
        self.prefill_side = [n for n in self.workers if n.prefill_role]
        self.bs = cfg.block_size
        self.router = router
        # Pulls cost what the router prices them at: the data plane's fixed cost plus
        # the bytes over the network.
        self.load = router.load
        self.single_flight = router.config.single_flight and router.config.name == "cpd"
        self.shares_steps = cfg.scheduler.long_prefill_token_threshold > 0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self._queue: deque[_Req] = deque()
        self._out = 0
        self._record = record_decisions
        self.result = SimResult(results=[])

    # ------------------------------------------------------------------- events

    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, requests: Sequence[WorkloadRequest]) -> SimResult:
        """Serve ``requests`` (sorted by arrival) to the end; per-request records."""
        reqs = [_Req(w, engine_blocks(w, self.bs)) for w in requests]
        for r in reqs:
            self._at(r.w.arrival_s, self._arrive, r)
        events = self._events
        n = 0
        while events:
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(*args)
            n += 1
        res = self.result
        res.events, res.end_s = n, self.now
        res.results = [_result(r) for r in reqs]
        res.busy_s = {x.name: x.busy_s for x in self.workers}
        return res

    # ------------------------------------------------------------------- client

    def _arrive(self, r: _Req) -> None:
        if self._out < self.cfg.max_inflight:
            self._send(r)
        else:
            self._queue.append(r)

    def _send(self, r: _Req) -> None:
        self._out += 1
        r.sent = self.now
        self._at(self.now + self.cfg.dispatch_s, self._route, r)

    def _done(self, r: _Req) -> None:
        """The last token left its node: the client has it a relay later."""
        self._at(self.now + self.cfg.relay_s, self._finished, r)

    def _finished(self, r: _Req) -> None:
        r.finish = self.now
        self._out -= 1
        if self._queue:
            self._send(self._queue.popleft())

    # ------------------------------------------------------------------- router

    def _hits(self, r: _Req) -> Hits:
        blocks, n = r.blocks, len(r.blocks)
        gpu: dict[str, int] = {}
        dram: dict[str, int] = {}
        disk: dict[str, int] = {}
        pending: dict[str, int] = {}
        single_flight = self.single_flight
        for x in self.workers:
            if x.prefill_role and (g := x.gpu.match(blocks, n)):
                gpu[x.name] = g
            d = x.dram.match(blocks, n)
            if d:
                dram[x.name] = d
            if x.disk is not None and (k := x.disk.match(blocks, n)) > d:
                disk[x.name] = k
            if single_flight and x.writing and d < n:
                cover = _cover(x, blocks, n)
                if cover > d:
                    pending[x.name] = cover
        return Hits(gpu=gpu, dram=dram, pending=pending, disk=disk)

    def _loads(self) -> list[NodeLoad]:
        every = self.cfg.report_interval_s
        # The workers' last periodic reports (all taken at one phase), or now if never
        # late; a node whose held prefills changed since reported that change, so every
        # prefill it holds is in its report (module doc).
        tick = math.floor(self.now / every) * every if every > 0 else self.now
        out = []
        for x in self.workers:
            if x.prefill_role:
                at = max(tick, x.changed)
                works = tuple(wire.PrefillWork(
                    new_tokens=h.new_tokens, context_tokens=h.context_tokens,
                    elapsed_ms=(at - h.start) * 1e3 if 0 <= h.start <= at else 0.0)
                    for h in itertools.islice(x.held.values(), wire.MAX_REPORTED_PREFILLS))
                out.append(NodeLoad(node=x.name, role=x.role, in_flight=len(x.reqs),
                                    bandwidth_gbps=self.cfg.network_gbps, prefills=works,
                                    shares_steps=self.shares_steps,
                                    decodes=self.cfg.prefill_decodes))
            else:
                out.append(NodeLoad(node=x.name, role=x.role, in_flight=len(x.reqs),
                                    bandwidth_gbps=self.cfg.network_gbps))
        return out

    def _route(self, r: _Req) -> None:
        hits, loads = self._hits(r), self._loads()
        self.copies.missed(r.blocks, max([0, *hits.gpu.values(), *hits.dram.values(),
                                          *hits.disk.values()]))
        d = self.router.decide(r.w.prompt_len, self.bs, hits, loads)
        if len(self.result.decisions) < self._record:
            self.result.decisions.append((r.w.prompt_len, self.bs, hits, loads, d))
        if d.wait is not None and not r.waited:
            r.waited = True
            node = self.nodes[d.wait.node]
            node.waiters.append(r)
            self._at(self.now + d.wait.max_wait_ms / 1e3, self._wait_over, r, node)
            return
        r.decision = d
        r.routed = self.now
        self.result.paths[d.path] += 1
        p = d.plan
        node = self.nodes[p.node]
        node.held[r.w.request_id] = _Held(p.computed_tokens, r.w.prompt_len - p.computed_tokens)
        node.changed = self.now
        self._fetch(node, r, p)

    def _fetch(self, node: _Node, r: _Req, p: Plan) -> None:
        """Bring the plan's reused prefix into ``node``'s arena, then start its
        prefill: what the node holds on its disk only is read back first, and a peer's
        run is pulled (one pull at a time into a node, its NIC, as the transfer client
        queues them) once the peer has read back what it holds on disk only."""
        ready = self.now
        if p.disk_tokens:
            end = max(s.first_block + s.num_blocks for s in p.sources if s.node == p.node)
            ready, read = self._read_back(node, r.blocks, end)
            r.tokens.disk = read * self.bs
        remote = [s for s in p.sources if s.node != p.node and s.num_blocks]
        if not remote:
            if ready > self.now:
                self._at(ready, self._enter, node, r)
            else:
                self._enter(node, r)
            return
        src = remote[0]
        peer = self.nodes[src.node]
        end = src.first_block + src.num_blocks
        sent, _ = self._read_back(peer, r.blocks, end)
        got = max(0, peer.dram.hit(r.blocks, end) - src.first_block)  # pinned to send
        start = max(sent, node.nic_free)
        node.nic_free = start + self.load.ms(got * self.bs, self.cfg.network_gbps) / 1e3
        r.tokens.remote = got * self.bs
        self._at(max(node.nic_free, ready), self._pulled, node, r, src.first_block + got)

    def _read_back(self, node: _Node, blocks: tuple[int, ...], end: int) -> tuple[float, int]:
        """Read the blocks of ``blocks[:end]`` that ``node`` holds on its disk but not in
        its arena into the arena (one read at a time per disk); when the read ends, and
        how many blocks it read."""
        if node.disk is None:
            return self.now, 0
        have = node.dram.match(blocks, end)
        on_disk = node.disk.hit(blocks, end)
        if on_disk <= have:
            return self.now, 0
        start = max(self.now, node.disk_free)
        node.disk_free = start + self.load.ms((on_disk - have) * self.bs,
                                              self.cfg.disk_gbps) / 1e3
        node.dram.insert(blocks, on_disk)
        return node.disk_free, on_disk - have

    def _wait_over(self, r: _Req, node: _Node) -> None:
        if r in node.waiters:
            node.waiters.remove(r)
            self._route(r)

    def _pulled(self, node: _Node, r: _Req, upto: int) -> None:
        node.keep(r.blocks, upto)
        self._enter(node, r)

    # -------------------------------------------------------------- prefill side

    def _enter(self, node: _Node, r: _Req) -> None:
        rid = r.w.request_id
        r.entered = self.now
        r.dram_have = node.dram.hit(r.blocks)  # pinned for the load
        r.sealed = r.dram_have
        held = node.held.get(rid)
        if held is not None:
            held.start = self.now
        for b in r.blocks[r.dram_have:]:
            node.writing[b] += 1
        node.reqs[rid] = r
        node.sched.add(rid, r.w.prompt_len, 1)
        self._kick(node)

    def _prefilled(self, node: _Node, r: _Req) -> None:
        rid = r.w.request_id
        del node.reqs[rid]
        if node.held.pop(rid, None) is not None:
            node.changed = self.now
        self._seal(node, r, len(r.blocks))
        r.prefilled, r.first = self.now, self.now + self.cfg.relay_s
        t = r.tokens
        t.computed = r.w.prompt_len - r.cached_tokens
        # Pulled or read blocks the engine held on its GPU were not loaded (the worker's
        # rule).
        t.remote = min(t.remote, t.dram)
        t.disk = min(t.disk, t.dram - t.remote)
        t.dram -= t.remote + t.disk
        self.result.tokens.add(t)
        if node.waiters:
            wake = self.now + SINGLE_FLIGHT_WAKE_S
            for q in node.waiters:
                self._at(wake, self._wait_over, q, node)
        if r.w.output_len <= 1:
            self._done(r)
            return
        assert r.decision is not None
        self._at(self.now + self.cfg.handoff_s, self._handoff, node,
                 self.nodes[r.decision.decode_node], r)

    def _seal(self, node: _Node, r: _Req, upto: int) -> None:
        """The prefill has computed ``upto`` leading blocks: sealed in the arena and
        held in the GPU cache, visible to the router as kvindex shows a worker's sealed
        blocks while the rest of the prompt is still computed."""
        upto = min(upto, len(r.blocks))
        if upto <= r.sealed:
            return
        node.gpu.insert(r.blocks, upto)
        node.keep(r.blocks, upto)
        w = node.writing
        for b in r.blocks[r.sealed:upto]:
            if w[b] <= 1:
                del w[b]
            else:
                w[b] -= 1
        r.sealed = upto

    # ------------------------------------------------------------------- decode

    def _handoff(self, src: _Node, dst: _Node, r: _Req) -> None:
        n = len(r.blocks)
        gate = dst.copies_gate
        if gate is not None:  # the worker's KvStore.handoff, on kvindex's count
            gate.observe("kvindex", self.copies.misses)
            dst.dram.set_copies_first(gate.handoff())
        held = src.dram.hit(r.blocks, n)  # pinned for the hand-off, at both ends
        lack = held - dst.dram.hit(r.blocks, held)
        start = max(self.now, dst.nic_free)
        dst.nic_free = start + (self.load.ms(lack * self.bs, self.cfg.network_gbps) / 1e3
                                if lack > 0 else 0.0)
        self._at(dst.nic_free, self._decode, dst, r, held)

    def _decode(self, node: _Node, r: _Req, upto: int) -> None:
        node.keep(r.blocks, upto)
        rid = r.w.request_id
        r.decode_in = self.now
        r.dram_have = node.dram.match(r.blocks)
        node.reqs[rid] = r
        node.sched.add(rid, r.w.prompt_len + 1, r.w.output_len - 1)
        if node.span is not None:
            self._cut_span(node)
        self._kick(node)

    # -------------------------------------------------------------------- steps

    def _kick(self, node: _Node) -> None:
        if node.busy or not node.sched.has_work():
            return
        now = self.now
        if not node.prefill_role:
            span = node.sched.decode_span(now)
            if span is not None:
                node.busy = True
                node.span = (now, span)
                node.epoch += 1
                self._at(now + float(span.ends_s[-1]), self._span_end, node, span.steps,
                         node.epoch)
                return
        plan = node.sched.step(now)
        if plan is None:
            ready = node.sched.next_ready_s()
            if ready is not None:
                node.epoch += 1
                self._at(max(ready, now), self._wake, node, node.epoch)
            return
        node.busy = True
        node.epoch += 1
        self._at(now + plan.duration_s, self._step_end, node, plan, node.epoch)

    def _wake(self, node: _Node, epoch: int) -> None:
        if epoch == node.epoch:
            self._kick(node)

    def _step_end(self, node: _Node, plan: object, epoch: int) -> None:
        if epoch != node.epoch:
            return
        node.busy = False
        node.busy_s += plan.duration_s  # type: ignore[attr-defined]
        bs = self.bs
        for adv in plan.advances:  # type: ignore[attr-defined]
            r = node.reqs.get(adv.request_id)
            if r is None:
                continue
            prefilling = node.prefilling(r)
            if not adv.emits_token:
                if prefilling:
                    self._seal(node, r, adv.prompt_done // bs)
                continue
            if prefilling:
                self._prefilled(node, r)
            else:
                if adv.output_index == 0:
                    node.gpu.insert(r.blocks, len(r.blocks))
                if adv.finished:
                    del node.reqs[adv.request_id]
                    self._done(r)
        self._kick(node)

    def _cut_span(self, node: _Node) -> None:
        """A request joined mid-span: the span ends with the step running now."""
        assert node.span is not None
        t0, span = node.span
        k = span.started_before(self.now - t0)  # type: ignore[attr-defined]
        if k < span.steps:  # type: ignore[attr-defined]
            node.epoch += 1
            self._at(t0 + float(span.ends_s[k - 1]), self._span_end, node, k,  # type: ignore[attr-defined]
                     node.epoch)

    def _span_end(self, node: _Node, steps: int, epoch: int) -> None:
        if epoch != node.epoch:
            return
        assert node.span is not None
        t0 = node.span[0]
        node.span = None
        node.busy = False
        node.busy_s += self.now - t0
        for rid in node.sched.apply_decodes(steps):
            self._done(node.reqs.pop(rid))
        self._kick(node)


def _result(r: _Req) -> Result:
    """A request as the load driver records it (so one report serves both)."""
    d = r.decision
    return Result(
        request_id=r.w.request_id, arrival_s=r.w.arrival_s, prompt_tokens=r.w.prompt_len,
        sent_s=r.sent if r.sent >= 0 else None, first_token_s=r.first, finish_s=r.finish,
        output_tokens=r.w.output_len if r.finish is not None else 0,
        cached_tokens=r.cached_tokens, path=d.path if d else "",
        prefill_node=d.plan.node if d else "", decode_node=d.decode_node if d else "",
        tokens=r.tokens, turn=r.w.turn, timings=_timings(r),
        error=None if r.finish is not None else UNFINISHED)


def _timings(r: _Req) -> dict[str, float] | None:
    """The request's phases as the services' final message times them (simulated ms;
    the load driver's report averages them per route path)."""
    if (r.finish is None or r.first is None or r.prefilled is None or r.routed is None
            or r.entered is None):
        return None
    ms = 1e3
    decode_in = r.decode_in if r.decode_in is not None else r.prefilled
    return {"decision_ms": (r.routed - r.sent) * ms, "load_ms": (r.entered - r.routed) * ms,
            "prefill_ms": (r.prefilled - r.entered) * ms, "ttft_ms": (r.first - r.sent) * ms,
            "handoff_ms": (decode_in - r.prefilled) * ms,
            "decode_ms": (r.finish - decode_in) * ms, "total_ms": (r.finish - r.sent) * ms}


def _cover(node: _Node, blocks: tuple[int, ...], n: int) -> int:
    """Leading blocks held or being written on ``node`` (kvindex's pending coverage)."""
    held, writing = node.dram, node.writing

    def has(i: int) -> bool:
        b = blocks[i]
        return b in held or b in writing

    if not has(0):
        return 0
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if has(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def simulate(cfg: ClusterConfig, router: Router, requests: Sequence[WorkloadRequest], *,
             record_decisions: int = 0) -> SimResult:
    """Serve ``requests`` on the cluster of ``cfg``, routed by ``router`` (see the
    module doc; :func:`services.router.service.make_policy` builds the router a router
    service of the same settings would run)."""
    return Cluster(cfg, router, record_decisions).run(requests)
