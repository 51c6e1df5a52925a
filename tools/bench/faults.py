"""``cpd bench faults``: the fault-injection harness (docs/architecture.md, "Failure handling";
docs/reliability.md).

One sim cluster of real service processes (:class:`tools.bench.simcluster.SimCluster`: NATS,
kvindex, router, a pre-prefill, two prefill and two decode workers on the simulated
engine) runs under a supervisor that restarts whatever dies, as ``cpd up`` does. For each
scenario, ``concurrency`` closed-loop clients keep that many requests in flight (a mix of
warm prompts, sharing a scenario's documents, and cold ones), the fault is injected, and
afterwards the invariants are checked:

* every request ended in tokens or a typed error before its deadline (``lost``: hung past
  the deadline and the client's grace, ended without a final message, or failed with an
  untyped exception);
* completed outputs equal the deterministic sim's reference (:func:`reference_tokens`);
* no unsealed or checksum-failed block was served or loaded (the workers' audit trail,
  :mod:`cpd.ops.audit`);
* every block a prefill node pulled as a cached prefix was VISIBLE in kvindex at read
  time (:class:`Timeline`; the precise definition is in docs/reliability.md);
* after recovery, the live kvindex's state (its snapshot) equals a state rebuilt from
  scratch by replaying ``CPD_KV`` through the pure :class:`services.kvindex.index.Index`;
* the system is back at full capacity (every node leased in the router's status and a
  probe served warm) within a measured ``recovery_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import xxhash
from nats.js import api

from cpd import apiclient
from cpd.client import Client
from cpd.engines.sim.engine import output_token
from cpd.ops.audit import read_audit
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import Namespace
from cpd.sim.analysis import percentile
from cpd.sim.workloads import DEFAULT_VOCAB, block_token_ids
from services.kvindex.index import Index
from tools.bench.hostinfo import free_port
from tools.bench.registry import SettingsFactory
from tools.bench.simcluster import SimCluster
from tools.faultproxy import FaultProxy

# The cluster: one pre-prefill node, two prefill nodes (warm requests and remote pulls
# between them), two decode nodes; a dead node of any role leaves a live one.
NODES = {"pp0": "preprefill", "p0": "prefill", "p1": "prefill", "d0": "decode",
         "d1": "decode"}
# Two router replicas: "router" is the one kill-router kills; clients resume the streams
# it carried on the other (cpd.client), as they would behind a real deployment's pair.
ROUTER, SPARE_ROUTER = "router", "router1"
# Two gateway processes, started when a scenario sends its load through them over HTTP
# (cpd.apiclient, which resumes a broken stream on the other); "gw0" is the one killed.
GATEWAYS = ("gw0", "gw1")
HTTP_SCENARIOS = frozenset({"kill-gateway"})
# Scenarios that kill -9 one service: each must complete this share of what was sent.
KILLS = ("kill-kvindex", "kill-router", "kill-preprefill", "kill-prefill", "kill-decode",
         "kill-gateway")
TARGET_KILL_COMPLETED_OK = 0.995
BLOCK = 256
# The node whose NATS connection goes through the fault proxy (network scenarios).
PROXIED_NODE = "p0"
# The node whose UCX listener is reached through the second fault proxy (its advertised
# port is the proxy's): UCX's connection set-up to it passes the proxy; its block bytes
# do not (UCX's TCP transport connects to the peer's own interface address after the
# handshake; docs/reliability.md).
UCX_PROXIED_NODE = "p1"
# The node restarted during a UCX connection fault, so that it must connect afresh.
UCX_RECONNECTING_NODE = "d0"
# A prefix read whose location stopped being VISIBLE at most this long before the request
# reached the reading worker is the lookup→read race, not a violation (docs/reliability.md).
LOOKUP_RACE_S = 1.0
# Clock granularity between the NATS server's stream timestamps and the workers' clocks.
CLOCK_SLACK_S = 0.01
# The client waits this long past a request's deadline for the router's typed error
# (cpd.client._GRACE_S) ; past that and a margin, the request is lost.
CLIENT_GRACE_S = 5.0
LOST_MARGIN_S = 2.0
SNAPSHOT_WAIT_S = 20.0
FUZZ_CASES_PER_SUBJECT = 200
FUZZ_SEED = 8


@dataclass(frozen=True)
class FaultConfig:
    """What one harness run does."""

    scenarios: tuple[str, ...]
    concurrency: int = 200          # requests kept in flight
    duration_s: float = 24.0        # load per scenario (wall seconds)
    inject_at_s: float = 6.0        # into the load
    fault_s: float = 7.0            # how long a lasting fault (pause, network) lasts
    output_tokens: int = 8
    doc_blocks: int = 6             # shared prefix of a warm prompt (blocks)
    docs: int = 12                  # documents per scenario
    warm_share: float = 0.6
    request_timeout_s: float = 30.0
    recovery_timeout_s: float = 60.0
    time_scale: float = 1.0
    seed: int = 1
    fuzz: bool = True
    progress: bool = True


# --------------------------------------------------------------------- the reference


def reference_tokens(prompt: list[int], max_tokens: int, vocab: int = DEFAULT_VOCAB
                     ) -> list[int]:
    """What the deterministic sim answers to ``prompt`` with KV that is the prompt's own
    (cpd.engines.sim.engine): the prefill side's first token from the prompt, then decode's
    tokens from prompt + first token. Any wrong KV block that passed its checksum
    changes them."""
    seed = xxhash.xxh3_64_intdigest(wire.pack_tokens(prompt))
    first = output_token(seed, 0, vocab)
    if max_tokens <= 1:
        return [first]
    seed2 = xxhash.xxh3_64_intdigest(wire.pack_tokens([*prompt, first]))
    return [first, *(output_token(seed2, i, vocab) for i in range(max_tokens - 1))]


# ------------------------------------------------------------------------ workload


class Prompts:
    """Warm prompts (a document of the scenario + a unique suffix) and cold ones."""

    def __init__(self, cfg: FaultConfig, scenario_index: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed * 1000 + scenario_index)
        self.base = (scenario_index + 1) << 36
        self.counter = 0

    def _unique(self, n: int) -> list[int]:
        ids = [self.base | (1 << 30) | (self.counter + i) for i in range(n)]
        self.counter += n
        return ids

    def fresh_doc(self) -> list[int]:
        """A document no request has used (whole blocks): for probes."""
        return block_token_ids(self._unique(self.cfg.doc_blocks), BLOCK).tolist()

    def doc(self, d: int) -> list[int]:
        """The tokens of document ``d`` of this scenario (whole blocks)."""
        return block_token_ids([self.base | (d << 8) | i for i in range(self.cfg.doc_blocks)],
                               BLOCK).tolist()

    def make(self, warm: bool | None = None) -> list[int]:
        warm = self.rng.random() < self.cfg.warm_share if warm is None else warm
        tail = self.rng.randint(1, BLOCK - 1)
        if warm:
            tokens = self.doc(self.rng.randrange(self.cfg.docs))
            tokens += block_token_ids(self._unique(1), BLOCK).tolist()
        else:
            tokens = block_token_ids(self._unique(self.cfg.doc_blocks + 1), BLOCK).tolist()
        return tokens + block_token_ids(self._unique(1), BLOCK).tolist()[:tail]


@dataclass
class Outcome:
    """One request as the client saw it."""

    t_start: float
    t_end: float = 0.0
    t_first: float = 0.0           # the first token's arrival (0: none arrived)
    deadline: float = 0.0
    error: str | None = None       # a typed error code, or a lost-request reason
    lost: bool = False
    late: bool = False             # typed error, but after the deadline
    wrong: bool = False
    path: str = ""
    moved: bool = False            # through the gateways: went on at another gateway


Attempt = Callable[[Outcome], Awaitable[tuple[list[int], str] | None]]
"""One request's exchange: its tokens and route path, or ``None`` with ``out.error`` set."""


async def _measured(prompt: list[int], cfg: FaultConfig, attempt: Attempt) -> Outcome:
    """Run ``attempt`` for ``prompt`` under the request's deadline and the client's
    grace, and judge it: typed error, late, lost (hung or untyped), wrong tokens."""
    now = time.monotonic()
    out = Outcome(t_start=now, deadline=now + cfg.request_timeout_s)
    got = None
    try:
        async with asyncio.timeout(cfg.request_timeout_s + CLIENT_GRACE_S + LOST_MARGIN_S):
            got = await attempt(out)
    except CpdError as e:
        out.error = e.code.value
    except TimeoutError:
        out.error, out.lost = "hung", True
    except Exception as e:  # untyped: the guarantee is typed errors
        out.error, out.lost = f"untyped:{type(e).__name__}", True
    out.t_end = time.monotonic()
    if out.error is not None and not out.lost and out.t_end > out.deadline + 1.0:
        out.late = True
    if got is not None:
        ids, out.path = got
        out.wrong = ids != reference_tokens(prompt, cfg.output_tokens)
    return out


async def _one(client: Client, prompts: Prompts, cfg: FaultConfig) -> Outcome:
    prompt = prompts.make()
    req = client.request(prompt, max_tokens=cfg.output_tokens, ignore_eos=True,
                         timeout_s=cfg.request_timeout_s)

    async def attempt(out: Outcome) -> tuple[list[int], str] | None:
        ids: list[int] = []
        async with contextlib.aclosing(client.stream_request(req)) as stream:
            async for msg in stream:
                if isinstance(msg, wire.TokenChunk):
                    if not out.t_first and msg.token_ids:
                        out.t_first = time.monotonic()
                    ids.extend(msg.token_ids)
                else:
                    return ids, msg.route.path
        out.error, out.lost = "no_final", True
        return None

    return await _measured(prompt, cfg, attempt)


async def _one_http(http: httpx.AsyncClient, gateways: list[str], prompts: Prompts,
                    cfg: FaultConfig) -> Outcome:
    """One request through the gateways (the first, then the next when its stream
    breaks), as :func:`_one` through the bus."""
    prompt = prompts.make()

    async def attempt(out: Outcome) -> tuple[list[int], str] | None:
        def first(r: apiclient.StreamResult) -> None:
            if not out.t_first and r.token_ids:
                out.t_first = time.monotonic()

        try:
            result = await apiclient.stream(
                http, gateways, "/v1/completions",
                {"prompt": prompt, "max_tokens": cfg.output_tokens, "temperature": 0,
                 "ignore_eos": True}, on_chunk=first)
        except apiclient.ApiError as e:
            out.error = e.code or f"http_{e.status}"
            return None
        except apiclient.StreamLost:
            out.error = "stream_lost"  # every try broke: a failure the client was told of
            return None
        out.moved = result.resumes > 0
        return result.token_ids, (result.cpd or {}).get("route", {}).get("path", "")

    return await _measured(prompt, cfg, attempt)


async def drive_http(gateways: list[str], prompts: Prompts, cfg: FaultConfig,
                     stop_at: float) -> list[Outcome]:
    """:func:`drive` over HTTP through ``gateways`` (base URLs)."""
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=cfg.concurrency * 2,
                          max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as http:
        async def loop() -> None:
            while time.monotonic() < stop_at:
                results.append(await _one_http(http, gateways, prompts, cfg))

        await asyncio.gather(*(loop() for _ in range(cfg.concurrency)))
    return results


def ttft_ms(results: list[Outcome], since: float, until: float) -> dict[str, Any]:
    """TTFT p50 and p99 (ms) of the requests sent in [``since``, ``until``) that
    completed, and how many there were (failed ones count in ``completed_ok_ratio``)."""
    xs = [(r.t_first - r.t_start) * 1000 for r in results
          if r.error is None and r.t_first and since <= r.t_start < until]
    return {"n": len(xs), "p50": round(percentile(xs, 0.5), 1) if xs else None,
            "p99": round(percentile(xs, 0.99), 1) if xs else None}


async def drive(client: Client, prompts: Prompts, cfg: FaultConfig, stop_at: float
                ) -> list[Outcome]:
    """``cfg.concurrency`` closed-loop clients until ``stop_at`` (monotonic)."""
    results: list[Outcome] = []

    async def loop() -> None:
        while time.monotonic() < stop_at:
            results.append(await _one(client, prompts, cfg))

    await asyncio.gather(*(loop() for _ in range(cfg.concurrency)))
    return results


# ------------------------------------------------------------- kvindex, visibility


class Timeline:
    """``CPD_KV`` replayed from the start through the pure index: the state rebuilt
    from scratch, and for every DRAM location the intervals it was VISIBLE in (stream
    timestamps: when NATS stored the event that made it visible or not)."""

    def __init__(self) -> None:
        self.index = Index()
        self.seq = 0
        self.visible: dict[tuple[str, str, bytes], list[list[float]]] = defaultdict(list)
        # Namespace specs (id → spec bytes) the harness heard in heartbeats. GPU-tier
        # events now carry their spec, so a replay maps them on its own; seeding these
        # as well keeps the comparison valid for streams written before that field.
        self.namespace_specs: dict[str, bytes] = {}

    async def advance(self, client: Client, upto: int) -> None:
        """Apply the stream's events up to sequence ``upto``."""
        if upto <= self.seq:
            return
        for ns_id, spec in self.namespace_specs.items():
            if ns_id not in self.index.namespaces:
                self.index.namespaces[ns_id] = Namespace.from_spec(spec)
        js = client.bus.nc.jetstream()
        sub = await js.subscribe(subjects.KV_EVENTS_ALL, ordered_consumer=True,
                                 deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                 config=api.ConsumerConfig(opt_start_seq=self.seq + 1))
        try:
            while self.seq < upto:
                msg = await sub.next_msg(timeout=10.0)
                meta = msg.metadata
                self.seq = meta.sequence.stream
                with contextlib.suppress(CpdError):
                    ev = wire.decode(msg.data, wire.KvEvent)
                    self._record(self.index.apply(ev), meta.timestamp.timestamp())
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _record(self, ch: Any, t: float) -> None:
        for ns, node, tier, h in ch.visible:
            if tier is wire.Tier.DRAM:
                self.visible[(ns, node, h)].append([t, float("inf")])
        for ns, node, tier, h in ch.invalidated:
            if tier is wire.Tier.DRAM:
                spans = self.visible.get((ns, node, h))
                if spans and spans[-1][1] == float("inf"):
                    spans[-1][1] = t

    def justified(self, ns: str, node: str, h: bytes, t_recv: float) -> bool:
        """Whether a read of ``h`` at ``node`` for a request that reached the reader at
        ``t_recv`` was backed by kvindex: VISIBLE from before ``t_recv`` and not
        invalidated more than :data:`LOOKUP_RACE_S` before it."""
        return any(tv <= t_recv + CLOCK_SLACK_S and ti >= t_recv - LOOKUP_RACE_S
                   for tv, ti in self.visible.get((ns, node, h), ()))


async def stream_last_seq(client: Client) -> int:
    info = await client.bus.nc.jetstream().stream_info(subjects.KV_STREAM)
    return info.state.last_seq


async def kvindex_matches_rebuild(cluster: SimCluster, timeline: Timeline) -> dict:
    """Wait for the live kvindex's periodic snapshot to cover the stream as it was when
    the scenario ended, then compare it with the from-scratch replay at the snapshot's
    sequence. (Not the stream's moving end: workers may still drain queued events, e.g.
    the sim's GPU-cache events, for a while after the load stops.)"""
    assert cluster.client is not None
    path = cluster.tmp / "snap" / f"kvindex-{cluster.kvindex_node}.snap"
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    snap_seq, live = -1, None
    last = await stream_last_seq(cluster.client)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, msgspec.DecodeError):
            live, snap_seq = Index.restore(path.read_bytes())
        if snap_seq >= last:
            break
        await asyncio.sleep(0.5)
    if live is None or snap_seq < last or snap_seq < timeline.seq:
        return {"kvindex_consistent": False, "detail": f"no snapshot covering the stream "
                                                       f"to {last} (snapshot seq {snap_seq})"}
    await timeline.advance(cluster.client, snap_seq)
    same = live.fingerprint() == timeline.index.fingerprint()
    return {"kvindex_consistent": same, "stream_seq": snap_seq,
            "blocks": live.num_blocks, "locations": live.num_locations,
            "detail": "" if same else _diff(live, timeline.index)}


def _diff(a: Index, b: Index) -> str:
    la = {(ns, h, n, t): loc.state for ns, h, n, t, loc in a.iter_locations()}
    lb = {(ns, h, n, t): loc.state for ns, h, n, t, loc in b.iter_locations()}
    only_a, only_b = la.keys() - lb.keys(), lb.keys() - la.keys()
    states = sum(la[k] != lb[k] for k in la.keys() & lb.keys())
    return (f"live-only locations {len(only_a)}, rebuild-only {len(only_b)}, "
            f"state differences {states}")


# -------------------------------------------------------------------------- probes


class Heartbeats:
    """Every worker heartbeat as the harness itself hears it: node → (incarnation, when
    received). The router's status alone cannot say whether a node is back: it shows a
    killed node alive until its lease lapses, and a heartbeat the old process sent just
    before the kill may be processed by a busy router after it."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, float]] = {}
        self.specs: dict[str, bytes] = {}   # namespace id → spec, as kvindex learns them
        self._sub: Any = None

    async def start(self, client: Client) -> None:
        self._sub = await client.bus.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on)

    async def _on(self, msg: Any) -> None:
        with contextlib.suppress(CpdError):
            hb = wire.decode(msg.data, wire.Heartbeat)
            self.last[hb.node] = (hb.started_unix_ms, time.monotonic())
            if hb.namespace_spec:
                self.specs[hb.namespace] = hb.namespace_spec

    def back(self, node: str, since: float, incarnation_after_ms: int = 0) -> bool:
        """Heard from ``node`` after ``since`` (monotonic), from an incarnation started
        at or after ``incarnation_after_ms`` (wall ms; a node killed then)."""
        if node not in self.last:
            return False
        epoch, t = self.last[node]
        return t >= since and epoch >= incarnation_after_ms



async def recovered(cluster: SimCluster, prompts: Prompts, cfg: FaultConfig,
                    since: float, notes: list[str], marks: dict[str, float],
                    heartbeats: Heartbeats, killed: dict[str, int]) -> float | None:
    """Seconds from ``since`` until the system is back at full capacity: every node
    alive in the router's status and heard from since ``since`` (a node in ``killed``:
    from an incarnation started after its kill, wall ms), the router's kvindex state
    serving (``ok``, or ``slow``: lookups past their deadline under load), and a probe pair
    served (:func:`probe`: a fresh document computed, then read back from the cache).
    The time is when the successful probe pair *started* (its own latency under load is
    not recovery). ``None`` if that does not happen within the recovery timeout (what
    was still missing goes to ``notes``). ``marks`` gets when each condition first held
    (seconds after ``since``): the evidence for where recovery time goes."""
    assert cluster.client is not None
    want = set(cluster.nodes)
    end = since + cfg.recovery_timeout_s
    missing = "no router status"
    while time.monotonic() < end:
        t = time.monotonic()
        try:
            status = await cluster.client.status(timeout_s=1.0)
            marks.setdefault("router_status", round(t - since, 2))
            # Leased and back *since the fault*: a killed node's old lease outlives it by
            # up to a lease; only its restarted incarnation (or, after a NATS restart or
            # a pause, its reconnected or resumed one) counts.
            fresh = {n.node for n in status.nodes
                     if n.alive and heartbeats.back(n.node, since, killed.get(n.node, 0))}
            for node in fresh:
                marks.setdefault(f"leased_{node}", round(t - since, 2))
            dead = want - fresh
            if not dead:
                marks.setdefault("all_leased", round(t - since, 2))
            if status.kvindex.serving:
                marks.setdefault("kvindex_serving", round(t - since, 2))
            missing = (f"nodes not leased: {sorted(dead)}" if dead
                       else f"router's kvindex state {status.kvindex.value!r}")
            down = await _gateways_down(cluster, killed)
            if not down:
                marks.setdefault("gateways_serving", round(t - since, 2))
            else:
                missing = f"gateways not serving: {down}"
            if not dead and status.kvindex.serving and not down:
                why = await probe(cluster.client, prompts, cfg)
                if why is None:
                    marks["probe_done"] = round(time.monotonic() - since, 2)
                    return round(t - since, 2)
                missing = why
                # Each failed probe pair costs a pair's latency under load; say why.
                notes.append(f"probe started at {t - since:.2f} s failed: {why}")
        except (CpdError, TimeoutError) as e:
            missing = f"{type(e).__name__}: {e}"
        await asyncio.sleep(0.25)
    notes.append(f"not recovered: {missing}")
    return None


async def _gateways_down(cluster: SimCluster, killed: dict[str, int]) -> list[str]:
    """The killed gateways whose ``/health`` does not answer 200 yet."""
    down: list[str] = []
    nodes = sorted(set(killed) & set(cluster.gateway_urls))
    if not nodes:
        return down
    async with httpx.AsyncClient(timeout=1.0) as http:
        for node in nodes:
            try:
                ok = (await http.get(cluster.gateway_urls[node] + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(node)
    return down


# A probe's cached read may race the visible event of the blocks just computed (worker →
# JetStream → kvindex): it is retried for this long before the probe counts as failed.
PROBE_VISIBLE_WAIT_S = 3.0


async def probe(client: Client, prompts: Prompts, cfg: FaultConfig) -> str | None:
    """Full capacity, end to end: a fresh document (never seen by the cluster) is
    computed on the cold path (pre-prefill, or overflow), then the same document with
    another suffix must be served from the cache (every document token reused: kvindex
    saw the blocks, a prefill node loaded them). ``None`` when both held, else why not.

    A fresh document each time: probing a document the scenario warmed would depend on
    whether the killed node held it (its copy is rightly gone), and probing a random
    never-warmed one (the first version of this harness) only succeeded when the random
    choice repeated, which inflated recovery times by seconds."""
    doc = prompts.fresh_doc()
    timeout = cfg.request_timeout_s
    first = await client.generate([*doc, 1], max_tokens=2, ignore_eos=True,
                                  timeout_s=timeout)
    end = time.monotonic() + PROBE_VISIBLE_WAIT_S
    suffix = 2
    while True:
        done = await client.generate([*doc, suffix], max_tokens=2, ignore_eos=True,
                                     timeout_s=timeout)
        r = done.route
        reused = r.tokens.reused
        # The reuse must come from kvindex's answer (a warm decision, or blocks loaded
        # from the sources it named), not from an engine's own prefix cache by luck: a
        # kvindex whose event feed is stale would pass otherwise.
        planned = r.path == "warm" or r.tokens.dram + r.tokens.disk + r.tokens.remote > 0
        if planned and reused >= len(doc):
            return None
        if time.monotonic() >= end:
            return (f"probe not served from cache: {done.route.path} ({r.describe()}); "
                    f"first {first.route.path} on {first.route.prefill_node}")
        suffix += 1
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------------ scenarios


@dataclass
class Ctx:
    """What a scenario's injection can act on."""

    cluster: SimCluster
    cfg: FaultConfig
    proxy: Any                       # the NATS fault proxy of PROXIED_NODE
    ucx_proxy: Any = None            # the fault proxy in front of UCX_PROXIED_NODE's listener
    killed: dict[str, int] = field(default_factory=dict)  # node → wall ms of its kill

    def kill(self, node: str) -> None:
        """``kill -9`` ``node`` (the supervisor restarts it), noting when."""
        self.killed[node] = int(time.time() * 1000)
        self.cluster.kill(node)
    notes: list[str] = field(default_factory=list)


Inject = Callable[[Ctx], Awaitable[None]]


def _kill(node: str) -> Inject:
    async def inject(ctx: Ctx) -> None:
        ctx.kill(node)
    return inject


async def _nats_restart(ctx: Ctx) -> None:
    server = ctx.cluster.nats
    assert server is not None and server.proc is not None
    before = server.proc.pid
    await asyncio.to_thread(ctx.cluster.restart_nats)
    assert server.proc is not None
    ctx.notes.append(f"nats-server restarted: pid {before} -> {server.proc.pid}")
    if server.proc.pid == before:
        raise CpdError("nats-server did not restart")


async def _nats_kill(ctx: Ctx) -> None:
    """``kill -9`` of the NATS server: the supervisor starts it again on the same port and
    JetStream store (what was in flight in the server is lost)."""
    server = ctx.cluster.nats
    assert server is not None and server.proc is not None
    before = server.proc.pid
    ctx.cluster.kill_nats()
    end = time.monotonic() + 20.0
    while time.monotonic() < end and (server.proc is None or server.proc.pid == before
                                      or server.proc.poll() is not None):
        await asyncio.sleep(0.1)
    after = server.proc.pid if server.proc is not None else None
    ctx.notes.append(f"nats-server killed: pid {before} -> {after}")
    if after in (None, before):
        raise CpdError("nats-server was not started again after its kill")


async def _pause_mid_transfer(ctx: Ctx) -> None:
    """SIGSTOP the pre-prefill node right after its UCX server starts sending blocks (its
    audit line precedes the bytes), keep it stopped past its lease, then SIGCONT."""
    node = "pp0"
    audit = ctx.cluster.tmp / "audit" / f"audit-{node}.jsonl"
    size = audit.stat().st_size if audit.exists() else 0
    end = time.monotonic() + 10.0
    hit = False
    while time.monotonic() < end:
        if audit.exists() and audit.stat().st_size > size:
            with open(audit, "rb") as f:
                f.seek(size)
                if b'"op":"serve"' in f.read():
                    hit = True
                    break
            size = audit.stat().st_size
        await asyncio.sleep(0.002)
    ctx.cluster.pause(node)
    ctx.notes.append("paused right after a serve began" if hit
                     else "no transfer seen in 10 s; paused anyway")
    await asyncio.sleep(ctx.cfg.fault_s)  # > the lease: routers and kvindex drop it
    ctx.cluster.resume(node)


async def _kvindex_restart_cold_burst(ctx: Ctx) -> None:
    """A burst of cold requests, kvindex killed in its middle."""
    assert ctx.cluster.client is not None
    client = ctx.cluster.client
    prompts = Prompts(ctx.cfg, 900)

    async def cold() -> None:
        with contextlib.suppress(CpdError):
            await client.generate(prompts.make(warm=False), max_tokens=2, ignore_eos=True,
                                  timeout_s=ctx.cfg.request_timeout_s)

    burst = [asyncio.create_task(cold()) for _ in range(min(100, ctx.cfg.concurrency))]
    await asyncio.sleep(0.3)
    ctx.kill(ctx.cluster.kvindex_node)
    await asyncio.gather(*burst)


def _net(mode: str) -> Inject:
    async def inject(ctx: Ctx) -> None:
        ctx.proxy.set_mode(mode, delay_s=0.25 if mode == "delay" else 0.0)
        await asyncio.sleep(ctx.cfg.fault_s)
        ctx.proxy.set_mode("pass")
    return inject


def _ucx_connect(mode: str) -> Inject:
    """Worker↔worker connection set-up fault: the proxy in front of p1's UCX listener
    cuts (resets and refuses) or drops (blackholes) connections, and d0 is killed so its
    restarted incarnation must connect to p1 afresh, through the fault, to pull the
    hand-offs p1 gives it. Connections made before the fault carry on: their data does
    not pass the proxy."""
    async def inject(ctx: Ctx) -> None:
        assert ctx.ucx_proxy is not None
        before = ctx.ucx_proxy.connections
        ctx.ucx_proxy.set_mode(mode)
        ctx.kill(UCX_RECONNECTING_NODE)
        await asyncio.sleep(ctx.cfg.fault_s)
        ctx.ucx_proxy.set_mode("pass")
        ctx.notes.append(f"UCX connections attempted through the proxy during the fault: "
                         f"{ctx.ucx_proxy.connections - before}")
    return inject


async def _none(ctx: Ctx) -> None:
    return None


SCENARIOS: dict[str, Inject] = {
    "baseline": _none,
    "kill-kvindex": _kill("kvi"),
    "kill-router": _kill(ROUTER),
    "kill-preprefill": _kill("pp0"),
    "kill-prefill": _kill("p0"),
    "kill-decode": _kill("d0"),
    "kill-gateway": _kill(GATEWAYS[0]),
    "nats-restart": _nats_restart,
    "kill-nats": _nats_kill,
    "sigstop-mid-transfer": _pause_mid_transfer,
    "kvindex-restart-cold-burst": _kvindex_restart_cold_burst,
    "nats-delay-prefill": _net("delay"),
    "nats-drop-prefill": _net("drop"),
    "nats-cut-prefill": _net("cut"),
    "ucx-connect-cut": _ucx_connect("cut"),
    "ucx-connect-drop": _ucx_connect("drop"),
}
FULL = tuple(SCENARIOS)
QUICK = ("kill-prefill", "kill-kvindex", "kill-decode", "kill-router",
         "sigstop-mid-transfer", "nats-restart", "kill-nats")


# --------------------------------------------------------------------------- runner


def _audit_since(folder: Path, t0: float, t1: float) -> list[dict]:
    return [r for r in read_audit(folder) if t0 <= r.get("t", 0) <= t1]


def check_blocks(records: list[dict], timeline: Timeline) -> dict:
    """The block invariants over one scenario's audit records."""
    unsealed = corrupt = reads = invisible = 0
    examples: list[str] = []
    for r in records:
        if r["op"] in ("serve", "load"):
            unsealed += r["unsealed"]
            corrupt += r["corrupt"]
        elif r["op"] == "pull" and r["purpose"] == "prefix":
            for hx in r["hashes"]:
                reads += 1
                if not timeline.justified(r["ns"], r["src"], bytes.fromhex(hx), r["t_recv"]):
                    invisible += 1
                    if len(examples) < 3:
                        examples.append(f"{r['node']} read {hx[:12]} at {r['src']}")
    failed = Counter(f"{r['purpose']}:{r['error']}" for r in records
                     if r["op"] == "pull" and r["error"])
    return {"unsealed_served": unsealed + corrupt, "unsealed": unsealed,
            "failed_pulls": dict(failed),
            "checksum_failed": corrupt, "prefix_reads": reads, "invisible_reads": invisible,
            "invisible_examples": examples,
            "serves": sum(r["op"] == "serve" for r in records),
            "loads": sum(r["op"] == "load" for r in records)}


async def run_scenario(name: str, index: int, cluster: SimCluster, cfg: FaultConfig,
                       timeline: Timeline, proxy: Any, ucx_proxy: Any = None,
                       heartbeats: Heartbeats | None = None) -> dict:
    """Load, inject, recover, check: one row of the report."""
    assert cluster.client is not None
    prompts = Prompts(cfg, index)
    ctx = Ctx(cluster, cfg, proxy, ucx_proxy)
    # Warm the scenario's documents so warm prompts have something to hit.
    await asyncio.gather(*(cluster.client.generate(
        [*prompts.doc(d), 1], max_tokens=2, ignore_eos=True) for d in range(cfg.docs)))
    t_wall0 = time.time()
    t0 = time.monotonic()
    load = asyncio.create_task(
        drive_http(list(cluster.gateway_urls.values()), prompts, cfg, t0 + cfg.duration_s)
        if name in HTTP_SCENARIOS else drive(cluster.client, prompts, cfg, t0 + cfg.duration_s))
    await asyncio.sleep(cfg.inject_at_s)
    t_inject = time.monotonic()
    await SCENARIOS[name](ctx)
    t_fault_end = time.monotonic()
    marks: dict[str, float] = {}
    recovery = (None if name == "baseline"
                else await recovered(cluster, Prompts(cfg, 1000 + index), cfg, t_fault_end,
                                     ctx.notes, marks, heartbeats or Heartbeats(),
                                     ctx.killed))
    # When the supervisor restarted what died, relative to the end of the fault.
    marks |= {f"restarted_{n}": round(t - t_fault_end, 2) for t, n in cluster.restarts
              if t >= t_inject}
    results = await load
    t_wall1 = time.time()
    # Quiet now: the state kvindex settles on must equal the rebuild from scratch.
    kv = await kvindex_matches_rebuild(cluster, timeline)
    blocks = check_blocks(_audit_since(cluster.tmp / "audit", t_wall0, t_wall1 + 60),
                          timeline)
    errors = Counter(r.error for r in results if r.error and not r.lost)
    row = {
        "scenario": name,
        "sent": len(results),
        "completed": sum(r.error is None for r in results),
        "completed_ok_ratio": round(sum(r.error is None for r in results)
                                    / max(1, len(results)), 4),
        "typed_errors": sum(r.error is not None and not r.lost for r in results),
        "lost": sum(r.lost for r in results),
        "late": sum(r.late for r in results),
        "wrong_tokens": sum(r.wrong for r in results),
        "unsealed_served": blocks["unsealed_served"],
        "invisible_reads": blocks["invisible_reads"],
        "kvindex_consistent": kv["kvindex_consistent"],
        "recovery_s": 0.0 if name == "baseline" else recovery,
        # Sent before the fault, and from its start until recovery (to the load's end
        # when it did not recover; a baseline's "fault" injects nothing).
        "ttft_before_ms": ttft_ms(results, t0, t_inject),
        "ttft_during_ms": ttft_ms(results, t_inject, t_fault_end + recovery
                                  if recovery is not None and name != "baseline"
                                  else math.inf),
        "fault_s": round(t_fault_end - t_inject, 2),
        "recovery_marks": marks,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "errors_by_code": dict(errors),
        "lost_by_reason": dict(Counter(r.error for r in results if r.lost)),
        "paths": dict(Counter(r.path for r in results if r.path)),
        # Through the gateways: requests that went on at another gateway (resumed, or
        # sent on while the killed one was down).
        "moved_gateway": sum(r.moved for r in results),
        "max_in_flight": cfg.concurrency,
        "restarts": [n for t, n in cluster.restarts if t >= t0],
        "kvindex": kv, "blocks": blocks, "notes": ctx.notes,
    }
    if cfg.progress:
        print(f"{name}: sent {row['sent']} completed {row['completed']} typed errors "
              f"{row['typed_errors']} lost {row['lost']} wrong {row['wrong_tokens']} "
              f"unsealed {row['unsealed_served']} invisible {row['invisible_reads']} "
              f"kvindex {'ok' if row['kvindex_consistent'] else 'DIFFERENT'} "
              f"recovery {row['recovery_s']} s {marks} ttft p50/p99 before "
              f"{row['ttft_before_ms']['p50']}/{row['ttft_before_ms']['p99']} ms, during "
              f"{row['ttft_during_ms']['p50']}/{row['ttft_during_ms']['p99']} ms "
              f"load {row['load_avg_1m']} "
              f"{ctx.notes}", file=sys.stderr, flush=True)
    return row


@dataclass
class Rig:
    """A running fault cluster: what :func:`run_scenario` acts on and checks with."""

    cluster: SimCluster
    timeline: Timeline
    proxy: Any
    ucx_proxy: Any
    heartbeats: Heartbeats

    async def scenario(self, name: str, index: int, cfg: FaultConfig) -> dict:
        """Run scenario ``name`` once the router sees every node again; its row."""
        await self.cluster.until_router_sees(set(self.cluster.nodes), timeout_s=60.0)
        return await run_scenario(name, index, self.cluster, cfg, self.timeline,
                                  self.proxy, self.ucx_proxy, self.heartbeats)


@contextlib.asynccontextmanager
async def fault_rig(cfg: FaultConfig, tmp: Path) -> AsyncIterator[Rig]:
    """The harness's cluster (two routers, a NATS fault proxy in front of one prefill
    node, a UCX one in front of another, killed nodes restarted by the supervisor) for
    the length of the block; everything it started is stopped after."""
    env = {
        "CPD_SIM__TIME_SCALE": str(cfg.time_scale),
        "CPD_ADMISSION__MAX_INFLIGHT": str(cfg.concurrency * 2 + 32),
        "CPD_ADMISSION__MAX_QUEUE": str(cfg.concurrency * 4),
        "CPD_WORKER__MAX_QUEUED_REQUESTS": str(cfg.concurrency * 2 + 32),
        "CPD_WORKER__AUDIT_DIR": str(tmp / "audit"),
        "CPD_KVINDEX__SNAPSHOT_INTERVAL_S": "1.0",
        "CPD_DATAPLANE__ARENA_BYTES": str(64 << 20),
    }
    # The proxied node's NATS URL is the proxy's, which forwards to NATS on a port picked
    # now (so the proxy exists before the node starts).
    nats_port = free_port()
    proxy = FaultProxy("127.0.0.1", nats_port).start_in_thread()
    ucx_port = free_port()
    ucx_proxy = FaultProxy("127.0.0.1", ucx_port).start_in_thread()
    gateways = ({g: free_port() for g in GATEWAYS}
                if HTTP_SCENARIOS.intersection(cfg.scenarios) else {})
    cluster = SimCluster(NODES, tmp, label="faults", env=env, nats_port=nats_port,
                         router_node=ROUTER, routers=(SPARE_ROUTER,), gateways=gateways,
                         node_env={
        PROXIED_NODE: {"CPD_NATS__SERVERS": f"nats://127.0.0.1:{proxy.port}"},
        UCX_PROXIED_NODE: {"CPD_DATAPLANE__LISTEN_PORT": str(ucx_port),
                           "CPD_DATAPLANE__ADVERTISE_PORT": str(ucx_proxy.port)}})
    try:
        await cluster.start()
        cluster.supervise()
        timeline = Timeline()
        heartbeats = Heartbeats()
        timeline.namespace_specs = heartbeats.specs
        assert cluster.client is not None
        await heartbeats.start(cluster.client)
        yield Rig(cluster, timeline, proxy, ucx_proxy, heartbeats)
    finally:
        await cluster.stop()
        proxy.stop_thread()
        ucx_proxy.stop_thread()


def check_scenarios(names: Iterable[str]) -> None:
    """Refuse, typed, scenario names the harness does not know."""
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise CpdError(f"unknown fault scenarios {unknown}; known: {list(SCENARIOS)}")


def run_in_tmp(main: Callable[[Path], Awaitable[dict]], prefix: str) -> dict:
    """``main(folder)`` in a new event loop and a temporary folder removed after."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return asyncio.run(main(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def run_async(cfg: FaultConfig, tmp: Path) -> dict:
    """Start the cluster, run every scenario of ``cfg``, stop; the JSON result."""
    check_scenarios(cfg.scenarios)
    t0 = time.monotonic()
    rows: list[dict] = []
    async with fault_rig(cfg, tmp) as rig:
        for i, name in enumerate(cfg.scenarios):
            try:
                rows.append(await rig.scenario(name, i, cfg))
            except Exception as e:  # the cluster may be broken: report, stop here
                rows.append(failed_row(name, e))
                print(f"{name}: FAILED {e!r}", file=sys.stderr, flush=True)
                break
    result = summarize(rows, cfg)
    # The fuzzer runs its own event loop: in a thread of its own, after the cluster.
    result["fuzz_crashes"] = await asyncio.to_thread(run_fuzz, cfg)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def failed_row(name: str, error: BaseException) -> dict:
    """A scenario the harness could not complete (the rest are not run): never
    recovered, inconsistent, with the error in ``notes``."""
    return {"scenario": name, "sent": 0, "completed": 0, "completed_ok_ratio": 0.0,
            "typed_errors": 0, "lost": 0,
            "late": 0, "wrong_tokens": 0, "unsealed_served": 0, "invisible_reads": 0,
            "kvindex_consistent": False, "recovery_s": None, "errors_by_code": {},
            "lost_by_reason": {}, "notes": [f"harness failed: {error!r}"]}


def summarize(rows: list[dict], cfg: FaultConfig) -> dict:
    """The headline keys over every scenario's row."""
    recov = [r["recovery_s"] for r in rows if r["scenario"] != "baseline"]
    return {
        "config": asdict(cfg) | {"nodes": NODES},
        "scenarios": rows,
        "lost": sum(r["lost"] for r in rows),
        "wrong_tokens": sum(r["wrong_tokens"] for r in rows),
        "unsealed_served": sum(r["unsealed_served"] for r in rows),
        "invisible_reads": sum(r["invisible_reads"] for r in rows),
        "kvindex_consistent": all(r["kvindex_consistent"] for r in rows),
        # A typed error is a failed request: the share completed in the worst kill.
        "min_kill_completed_ok_ratio": min(
            (r["completed_ok_ratio"] for r in rows if r["scenario"] in KILLS), default=None),
        "target_kill_completed_ok_ratio": TARGET_KILL_COMPLETED_OK,
        # A scenario that never recovered counts as infinitely slow (null in JSON).
        "max_recovery_s": (None if any(x is None for x in recov)
                           else max(recov, default=0.0)),
    }


def run_fuzz(cfg: FaultConfig) -> int | None:
    """``fuzz_crashes`` from the wire fuzzer (bench/fuzz.py) when this build has it."""
    if not cfg.fuzz:
        return None
    if importlib.util.find_spec("tools.bench.fuzz") is None:
        return None  # the fuzzer is not part of this build (yet)
    from tools.bench.fuzz import run as run_fuzzer

    return int(run_fuzzer(FUZZ_CASES_PER_SUBJECT, FUZZ_SEED)["fuzz_crashes"])


def run(cfg: FaultConfig) -> dict:
    """Run the harness in a temporary folder; returns the JSON result."""
    return run_in_tmp(functools.partial(run_async, cfg), "cpd-faults-")


def config_for(quick: bool, scenarios: str | None = None, concurrency: int | None = None,
               duration_s: float | None = None, progress: bool = True) -> FaultConfig:
    """The CLI's configuration: the full set, or ``--quick`` (7 scenarios, less load and
    no fuzzing); ``scenarios`` (comma-separated), ``concurrency`` and ``duration_s``
    override."""
    names = (tuple(s.strip() for s in scenarios.split(",") if s.strip()) if scenarios
             else QUICK if quick else FULL)
    fields: dict[str, Any] = {"scenarios": names, "progress": progress}
    if quick:
        fields |= {"concurrency": 60, "duration_s": 14.0, "inject_at_s": 3.0,
                   "fault_s": 6.5, "docs": 6, "fuzz": False}
    if concurrency:
        fields["concurrency"] = concurrency
    if duration_s:
        fields["duration_s"] = duration_s
    return FaultConfig(**fields)


def markdown(result: dict) -> str:
    """One row per scenario, then the headline keys."""
    lines = ["| scenario | sent | completed | typed errors | of which late | lost | "
             "wrong tokens | unsealed/unverified served | invisible reads | "
             "kvindex = rebuild | recovery s | host load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["scenarios"]:
        rec = "—" if r["scenario"] == "baseline" else (
            "never" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}")
        lines.append(f"| {r['scenario']} | {r['sent']} | {r['completed']} | "
                     f"{r['typed_errors']} | {r['late']} | {r['lost']} | {r['wrong_tokens']} | "
                     f"{r['unsealed_served']} | {r['invisible_reads']} | "
                     f"{'yes' if r['kvindex_consistent'] else 'NO'} | {rec} | "
                     f"{r.get('load_avg_1m', '')} |")
    lines += ["", ", ".join(f"`{k}` {json.dumps(result.get(k))}" for k in (
        "lost", "wrong_tokens", "unsealed_served", "fuzz_crashes", "max_recovery_s")), ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench faults``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="seven scenarios, less load, no fuzzing (tests, CI)")
    parser.add_argument("--scenarios", help="comma-separated scenario names "
                                            "(default: all; --quick: five)")
    parser.add_argument("--concurrency", type=int,
                        help="requests kept in flight (200; --quick 60)")
    parser.add_argument("--duration-s", type=float,
                        help="load per scenario, wall seconds (24; --quick 14)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench faults``'s flags; the per-scenario table goes to stderr
    (stdout carries the JSON)."""
    result = run(config_for(args.quick, scenarios=args.scenarios,
                            concurrency=args.concurrency, duration_s=args.duration_s))
    print(markdown(result), file=sys.stderr)
    return result


__all__ = ["FULL", "QUICK", "SCENARIOS", "FaultConfig", "Rig", "Timeline", "add_arguments",
           "check_blocks", "check_scenarios", "config_for", "fault_rig", "markdown",
           "reference_tokens", "run", "run_args", "run_async", "run_in_tmp"]
