"""``cpd bench router``: the routing decision for 100K-token prompts, and how many
decisions one router process makes per second.

One run sets up, on an embedded NATS server:

* a kvindex *process* (``python -m services.kvindex``, so its CPU is not the router's)
  filled through JetStream with ``blocks`` background blocks (1M; 100K with ``--quick``)
  plus the cached prefixes of the warm prompts and of the agent sessions, all VISIBLE in
  host DRAM of fake workers;
* fake workers (2 pre-prefill, 4 prefill, 2 decode nodes) that only heartbeat and send
  load reports, at the workers' own intervals, so the router's node table and kvindex's
  leases stay live;
* an in-process :class:`~services.router.RouterService` on the locally built model with
  its length limit raised to 131,072 tokens: the decision does not depend on the engine.

**Every prompt new to the router** (the headline figures): prompts are 100K random token
ids, half warm (90% of their blocks cached on a pre-prefill node; every other one also on
a prefill node) and half cold (nothing cached). These few prompts are sent over and over,
so the router's prefix-hash memo (``router.hash_memo_bytes``) is *disabled* for them: with
it, every decision after the first few would reuse all of its hashes, which no real
prompt stream gives. This is the worst case: every prompt hashed in full. Measured:

* latency of ``await router.decide(req)`` one at a time (warm, cold, both):
  ``decision_p50_ms``, ``decision_p99_ms``, ...;
* throughput: decisions/s with 8 and 32 decisions in flight for a fixed time, with the CPU
  each process spent per decision (``decisions_per_s``: the better level);
* the breakdown, each part alone in the same run: unpacking and validating the tokens,
  block hashing, the kvindex round trip and the policy.

**Agent turns, memo enabled** (``agent_turns``; ``*_agent_turns`` keys): what multi-turn
chat and coding agents send. A session's first turn is 100K random token ids; each next
turn is the previous turn's tokens plus 2,000 new random ones (15 turns, up to 128K
tokens); the first turn's blocks are cached on a pre-prefill node (as after it ran), so
every turn routes warm. 40 sessions are open at once, interleaved, one turn of a session
in flight at a time; a finished session is replaced by a new one (whose first turn the
memo has never seen); the first sessions end after staggered numbers of turns, so
openings are spread out from the start. A pass ends when no new session is left to open.
Each pass starts with an empty memo (as after a router restart), so the memo knows only
what that pass sent. Two passes over the same sessions:

* one decision at a time: ``decision_p50_ms_agent_turns``, ``decision_p99_ms_agent_turns``
  (comparable with ``decision_p99_ms``);
* 32 in flight: ``decisions_per_s_agent_turns`` (building each request's 400-500 KB of
  tokens counts in its wall time), with the router's CPU per decision;

and the memo's own counts for each (``hash_memo_reuse_ratio``: share of blocks whose hash
was reused, of the 32-in-flight pass).

**In a front end** (``front_end``): the same prompts decided by a second router whose
kvindex replica runs in the bench process and answers through a
:class:`~cpd.bus.LocalHub` (``services.frontend``), interleaved with the first router,
whose kvindex is the other process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import math
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from cpd.bus import Bus, LocalHub
from cpd.engines.profile import engine_profile
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.ops.config import RouterSettings, Settings, load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError
from cpd.protocol.hashing import BlockHasher, Namespace, block_hashes
from cpd.protocol.roles import Role
from services.kvindex import KvIndexService
from services.router import Decision, Hits, RouterService, Wait
from services.router.configured import prefill_cost
from services.router.cost import PrefillCost
from tools.bench.kvindex import CHAIN, _run_loop
from tools.bench.proccpu import cpu_seconds_all, cpu_used_since
from tools.bench.registry import SettingsFactory
from tools.cluster import Cluster, ClusterSpec, NodeSpec

PROMPT_TOKENS = 100_000
MAX_MODEL_LEN = 131_072
MAX_TOKENS = 16
WARM_SHARE = 0.9  # of a warm prompt's full blocks, cached
WORKERS = {"pp0": "preprefill", "pp1": "preprefill", "p0": "prefill", "p1": "prefill",
           "p2": "prefill", "p3": "prefill", "d0": "decode", "d1": "decode"}
PREPREFILL = [n for n, r in WORKERS.items() if r == Role.PREPREFILL]
PREFILL = [n for n, r in WORKERS.items() if r == Role.PREFILL]
CONCURRENCY = (8, 32)
TARGET_P99_MS = 2.0
TARGET_DECISIONS_PER_S = 2000
TARGET_WAKE_P50_MS = 5.0
# Single-flight rounds: each waits for an 8-block prefix pp0 is writing.
WAKE_CHAIN_BLOCKS = 8
# The poll the router used before visibility events woke its waiters (the baseline).
POLL_BASELINE_S = 0.05
SEED = 20261201
# Long enough that a fake node never expires while two cores are busy ingesting a million
# blocks; the lease length does not enter the decision's cost.
LEASE_TTL_MS = 30_000
# The queues of the fake prefill-capable workers (ms, as the router prices the prefill
# each one reports holding): enough spread that some decisions overflow across tiers, as
# under real load.
MAX_QUEUE_MS = 300.0
KV_BANDWIDTH_GBPS = 5.0
PUBLISH_BATCH = 500
# The agent-like mix: sessions that resend their previous turn plus some new tokens.
AGENT_FIRST_TOKENS = PROMPT_TOKENS
AGENT_TURN_TOKENS = 2_000
AGENT_TURNS = 15  # the last turn is 128,000 tokens: below MAX_MODEL_LEN with MAX_TOKENS
AGENT_OPEN_SESSIONS = 40  # more than in flight, so turns of many sessions interleave
AGENT_CONCURRENCY = 32
WARMUP_DECISIONS = 30
READY_TIMEOUT_S = 60.0
VISIBLE_TIMEOUT_S = 300.0
KVINDEX_STOP_TIMEOUT_S = 30.0
KVINDEX_NODE = "bench-kvi"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much one run does."""

    blocks: int  # background blocks in kvindex
    prompts: int  # warm prompts, and as many cold ones
    decisions: int  # sequential decisions timed
    seconds: float  # per throughput level
    breakdown: int  # repetitions of each part of the breakdown
    agent_sessions: int  # sessions of the agent-turn passes (~15 decisions each)
    wake_rounds: int  # single-flight wake-ups, of each kind (push, poll)

    @classmethod
    def of(cls, quick: bool, blocks: int | None = None) -> Sizes:
        """The full run, or the ``--quick`` one (< 60 s on two cores)."""
        if quick:
            return cls(blocks=blocks or 100_000, prompts=4, decisions=400, seconds=2.0,
                       breakdown=200, agent_sessions=80, wake_rounds=20)
        return cls(blocks=blocks or 1_000_000, prompts=8, decisions=2000, seconds=5.0,
                   breakdown=1000, agent_sessions=240, wake_rounds=100)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt and what kvindex holds of it."""

    kind: str  # "warm" or "cold"
    request: wire.GenerateRequest
    hashes: bytes  # every full block's hash
    cached: dict[str, int]  # node -> blocks of its prefix VISIBLE there


def run(settings: Settings | None = None, quick: bool = False,
        blocks: int | None = None) -> dict:
    """Run the benchmark; returns the JSON-able result."""
    settings = settings or load_settings()
    sizes = Sizes.of(quick, blocks)
    load_before = os.getloadavg()[0]
    # As the router process does; warnings only, so stdout stays the JSON result.
    telemetry.setup("router", msgspec.structs.replace(settings.telemetry,
                                                      log_level="warning"))
    model = dataclasses.replace(ServedModel.load(settings), max_model_len=MAX_MODEL_LEN)
    tmp = Path(tempfile.mkdtemp(prefix="cpd-bench-router-"))
    try:
        result = _run_loop(_bench(settings, model, sizes, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["quick"] = quick
    result["cpu_count"] = os.cpu_count()
    # Other work on the machine shows up in every wall-clock figure: say how much.
    result["load_average_1m"] = {"before": round(load_before, 2),
                                 "after": round(os.getloadavg()[0], 2)}
    return result


# ------------------------------------------------------------------------- setup


def _prompts(model: ServedModel, n: int) -> list[Prompt]:
    """``n`` warm and ``n`` cold prompts, interleaved."""
    rng = np.random.default_rng(SEED)
    ns = model.namespace
    blocks = PROMPT_TOKENS // ns.block_size
    cached = int(WARM_SHARE * blocks)
    out = []
    for i in range(2 * n):
        kind = "warm" if i % 2 == 0 else "cold"
        tokens = rng.integers(0, model.vocab_size, size=PROMPT_TOKENS, dtype=np.uint32)
        where: dict[str, int] = {}
        if kind == "warm":
            j = i // 2
            # Written through by a pre-prefill node (a remote load for a prefill node);
            # every other prompt also sits in a prefill node's own DRAM.
            where[PREPREFILL[j % len(PREPREFILL)]] = cached
            if j % 2:
                where[PREFILL[(j // 2) % len(PREFILL)]] = cached
        req = wire.GenerateRequest(request_id=f"{kind}-{i}", tokens=wire.pack_tokens(tokens),
                                   sampling=wire.SamplingParams(max_tokens=MAX_TOKENS))
        out.append(Prompt(kind, req, block_hashes(ns, tokens), where))
    return out


@dataclasses.dataclass(frozen=True)
class AgentSession:
    """One agent-like session: turn ``t`` sends ``tokens[:AGENT_FIRST_TOKENS + t *
    AGENT_TURN_TOKENS]``; its first turn's blocks are cached on ``node``."""

    tokens: np.ndarray
    first_hashes: bytes
    node: str

    def request(self, sid: int, turn: int) -> wire.GenerateRequest:
        n = AGENT_FIRST_TOKENS + turn * AGENT_TURN_TOKENS
        return wire.GenerateRequest(request_id=f"agent-{sid}-{turn}",
                                    tokens=self.tokens[:n].tobytes(),
                                    sampling=wire.SamplingParams(max_tokens=MAX_TOKENS))


def _agent_sessions(model: ServedModel, n: int) -> list[AgentSession]:
    """``n`` sessions of independent random tokens."""
    rng = np.random.default_rng(SEED + 3)
    size = AGENT_FIRST_TOKENS + (AGENT_TURNS - 1) * AGENT_TURN_TOKENS
    out = []
    for i in range(n):
        tokens = rng.integers(0, model.vocab_size, size=size, dtype=np.uint32)
        out.append(AgentSession(tokens, block_hashes(model.namespace,
                                                     tokens[:AGENT_FIRST_TOKENS]),
                                PREPREFILL[i % len(PREPREFILL)]))
    return out


class _Writer:
    """One fake worker's event stream: its sequence numbers within its epoch."""

    def __init__(self, node: str, ns: Namespace, epoch: int, nbytes: int) -> None:
        self.node, self.ns, self.epoch, self.nbytes = node, ns, epoch, nbytes
        self.seq = 0

    def chain(self, hashes: list[bytes], *, writing: bool) -> list[wire.KvEvent]:
        """A chain's lifecycle as a worker reports it: allocated, (writing,) sealed."""
        bs = self.ns.block_size
        refs = [wire.BlockRef(h, hashes[i - 1] if i else b"", bs) for i, h in enumerate(hashes)]
        common: dict[str, Any] = {"node": self.node, "namespace": self.ns.id,
                                  "epoch": self.epoch, "tier": wire.Tier.DRAM}
        events: list[wire.KvEvent] = [wire.BlocksAllocated(seq=0, blocks=refs, **common)]
        if writing:
            events.append(wire.BlocksWriting(seq=0, hashes=list(hashes), **common))
        events.append(wire.BlocksSealed(seq=0, seals=[wire.BlockSeal(h, self.nbytes, 1)
                                                      for h in hashes], **common))
        for ev in events:
            self.seq += 1
            ev.seq = self.seq
        return events


def _background(writers: dict[str, _Writer], n_blocks: int) -> Iterator[wire.KvEvent]:
    """``n_blocks`` blocks as chains of a 100K-token prompt's length, spread over the
    prefill-capable nodes, generated lazily (a million blocks of events at once would
    be hundreds of MB of Python objects)."""
    rng = np.random.default_rng(SEED + 1)
    holders = PREPREFILL + PREFILL
    for c in range(n_blocks // CHAIN):
        raw = rng.bytes(CHAIN * wire.HASH_BYTES)
        chain = [raw[i * wire.HASH_BYTES:(i + 1) * wire.HASH_BYTES] for i in range(CHAIN)]
        yield from writers[holders[c % len(holders)]].chain(chain, writing=False)


def _cached(writers: dict[str, _Writer], chains: list[tuple[str, bytes, int]]
            ) -> Iterator[wire.KvEvent]:
    """The ``(node, hashes, blocks)`` prefixes, written through by their nodes."""
    for node, hashes, n in chains:
        chain = [hashes[i * wire.HASH_BYTES:(i + 1) * wire.HASH_BYTES] for i in range(n)]
        yield from writers[node].chain(chain, writing=True)


async def _publish(js: Any, events: Iterator[wire.KvEvent]) -> int:
    """Store events in ``CPD_KV``, a batch of acks at a time; returns how many."""
    count = 0
    acks = []
    for ev in events:
        acks.append(await js.publish_async(subjects.kv_events(ev.node), wire.encode(ev)))
        count += 1
        if len(acks) >= PUBLISH_BATCH:
            await asyncio.gather(*acks)
            acks.clear()
    await asyncio.gather(*acks)
    return count


async def _fake_workers(bus: Bus, settings: Settings, ns: Namespace, epoch: int,
                        cost: PrefillCost) -> None:
    """Heartbeats and load reports of every fake worker, at the workers' intervals; a
    prefill-capable one holds a prefill ``cost`` prices at 0 to ``MAX_QUEUE_MS``."""
    rng = np.random.default_rng(SEED + 2)
    spec = ns.to_spec()
    next_heartbeat = 0.0
    while True:
        now = time.monotonic()
        if now >= next_heartbeat:
            next_heartbeat = now + settings.node.heartbeat_interval_s
            for node, role in WORKERS.items():
                await bus.publish(subjects.heartbeat(node), wire.Heartbeat(
                    node=node, role=role, started_unix_ms=epoch,  # type: ignore[arg-type]
                    lease_ttl_ms=LEASE_TTL_MS, namespace=ns.id, namespace_spec=spec,
                    capacity_blocks=4096))
        for node, role in WORKERS.items():
            queue_ms = float(rng.uniform(0, MAX_QUEUE_MS))
            held = ([wire.PrefillWork(new_tokens=n, context_tokens=0)]
                    if role != Role.DECODE and (n := _tokens_priced_at(cost, queue_ms))
                    else [])
            await bus.publish(subjects.load(role, node), wire.LoadReport(
                node=node, role=role, queue_depth=len(held),  # type: ignore[arg-type]
                queued_new_tokens=sum(w.new_tokens for w in held), prefills=held,
                in_flight=int(rng.integers(0, 8)),
                kv_bandwidth_gbps=KV_BANDWIDTH_GBPS if role != Role.DECODE else 0.0))
        await asyncio.sleep(settings.worker.load_report_interval_s)


def _tokens_priced_at(cost: PrefillCost, ms: float) -> int:
    """The new tokens (no cached context) ``cost`` prices at about ``ms``: 0 when ``ms``
    is not above its fixed part, or when tokens cost nothing."""
    budget = ms - cost.fixed_ms
    a, b = cost.per_token_ms, cost.per_token_ctx_ms / 2  # budget = a·n + b·n²
    if budget <= 0 or (a <= 0 and b <= 0):
        return 0
    n = budget / a if b <= 0 else (math.sqrt(a * a + 4 * b * budget) - a) / (2 * b)
    return int(n)


async def _until(what: str, timeout: float, check: Callable[[], Awaitable[bool]]) -> float:
    """Poll ``check`` until it holds; returns the seconds it took."""
    t0 = time.perf_counter()
    while not await check():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


async def _lookup(bus: Bus, ns: Namespace, hashes: bytes) -> wire.LookupReply | None:
    try:
        return await bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
            namespace=ns.id, block_hashes=hashes), expect=wire.LookupReply, timeout=2)
    except Exception:
        return None


async def _all_visible(bus: Bus, ns: Namespace, chains: list[tuple[str, bytes, int]]) -> bool:
    for node, hashes, want in chains:
        reply = await _lookup(bus, ns, hashes)
        if reply is None or reply.status != "ok":
            return False
        got = {m.node: m.num_blocks for m in reply.matches}
        if got.get(node, 0) < want:
            return False
    return True


def _kvindex(tmp: Path) -> Cluster:
    """``python -m services.kvindex`` on an embedded NATS server, logs and state in ``tmp``
    (a cluster of one: its own process group, ready once it answers lookups)."""
    return Cluster(ClusterSpec(
        nodes=(NodeSpec(KVINDEX_NODE, "kvindex"),), workdir=tmp, label="bench-router",
        # A background snapshot is a forked child competing for two cores: none during
        # the run (recovery is `cpd bench kvindex`'s business).
        overrides=("kvindex.snapshot_interval_s=86400",),
        ready_timeout_s=READY_TIMEOUT_S, stop_timeout_s=KVINDEX_STOP_TIMEOUT_S))


# ------------------------------------------------------------------------ measure


async def _bench(settings: Settings, model: ServedModel, sizes: Sizes, tmp: Path) -> dict:
    ns = model.namespace
    prompts = _prompts(model, sizes.prompts)
    sessions = _agent_sessions(model, sizes.agent_sessions)
    cached = ([(node, p.hashes, n) for p in prompts for node, n in p.cached.items()]
              + [(a.node, a.first_hashes, len(a.first_hashes) // wire.HASH_BYTES)
                 for a in sessions])
    epoch = int(time.time() * 1000)
    kvi = _kvindex(tmp)
    bus: Bus | None = None
    workers: asyncio.Task[None] | None = None
    router: RouterService | None = None
    try:
        await kvi.start()  # kvindex (the CPD_KV stream's owner) created the stream
        s = msgspec.structs.replace(
            settings, nats=msgspec.structs.replace(settings.nats, servers=[kvi.url]),
            node=msgspec.structs.replace(settings.node, node_id="bench-router"))
        bus = await Bus.open(s, "bench-router-load")
        js = bus.nc.jetstream()
        profile = engine_profile(s)
        workers = asyncio.create_task(_fake_workers(bus, s, ns, epoch, prefill_cost(profile)))
        writers = {n: _Writer(n, ns, epoch, profile.slot_bytes) for n in WORKERS}
        t0 = time.perf_counter()
        n_events = await _publish(js, _background(writers, sizes.blocks))
        n_events += await _publish(js, _cached(writers, cached))
        publish_s = time.perf_counter() - t0
        last_bg = _last_background_chain(sizes.blocks)
        expect = list(cached)
        if last_bg is not None:
            expect.append(last_bg)
        try:
            await _until("every block visible", VISIBLE_TIMEOUT_S,
                         lambda: _all_visible(bus, ns, expect))
        except TimeoutError as e:
            raise RuntimeError(f"{e}; kvindex log:\n{kvi.log_tail(KVINDEX_NODE)}") from None
        ingest_s = time.perf_counter() - t0
        # The memo off: these few prompts repeat, and every one must count as new.
        off = msgspec.structs.replace(s, router=msgspec.structs.replace(s.router,
                                                                      hash_memo_bytes=0))
        router = RouterService(off, nats_url=kvi.url, model=model)
        await router.start()
        r = router
        await _until("router sees every worker", READY_TIMEOUT_S,
                     lambda: _sees_workers(r))
        await _warm_up(router, prompts)
        result: dict[str, Any] = {
            "prompt_tokens": PROMPT_TOKENS,
            "prompt_blocks": len(prompts[0].hashes) // wire.HASH_BYTES,
            "warm_cached_blocks": max(prompts[0].cached.values()),
            "prompts": {"warm": sizes.prompts, "cold": sizes.prompts},
            "index_blocks": (sizes.blocks // CHAIN) * CHAIN
                            + sum(max(p.cached.values(), default=0) for p in prompts)
                            + sum(len(a.first_hashes) // wire.HASH_BYTES for a in sessions),
            "hash_memo": "disabled (router.hash_memo_bytes=0) except in agent_turns",
            "kvindex": "separate process (python -m services.kvindex)",
            "router": "in this process (RouterService.decide)",
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            "nodes": dict(Counter(WORKERS.values())),
            "setup": {"events": n_events, "publish_s": round(publish_s, 2),
                      "ingest_until_visible_s": round(ingest_s, 2)},
            "timer_resolution_ns": time.get_clock_info("perf_counter").resolution * 1e9,
        }
        pids = {"router": os.getpid(), "kvindex": kvi.pid(KVINDEX_NODE)}
        if kvi.nats is not None and kvi.nats.proc is not None:
            pids["nats_server"] = kvi.nats.proc.pid
        cpu0 = cpu_seconds_all(pids)
        result.update(await _sequential(router, prompts, sizes.decisions))
        result["sequential_cpu_ms_per_decision"] = _cpu_per(cpu0, pids, sizes.decisions)
        levels = [await _throughput(router, prompts, c, sizes.seconds, pids)
                  for c in CONCURRENCY]
        best = max(levels, key=lambda x: x["decisions_per_s"])
        result["throughput"] = levels
        result["decisions_per_s"] = best["decisions_per_s"]
        result["decisions_per_s_concurrency"] = best["concurrency"]
        router_cpu = best["cpu_ms_per_decision"].get("router")
        # What one router process would sustain with a core to itself: on a shared
        # two-core machine the wall-clock figure also measures the neighbours.
        result["router_cpu_bound_decisions_per_s"] = (round(1000 / router_cpu)
                                                      if router_cpu else None)
        result.update(await _breakdown(router, prompts, sizes.breakdown))
        memo_bytes = settings.router.hash_memo_bytes or RouterSettings().hash_memo_bytes
        result.update(await _agent_passes(router, sessions, memo_bytes, pids))
        result.update(await _single_flight_wake(router, bus, js, writers["pp0"], ns,
                                                sizes.wake_rounds))
        result.update(await _front_end(off, kvi.url, model, router, prompts,
                                       sizes.decisions // 2, tmp))
        result["targets"] = {
            "decision_p99_ms": TARGET_P99_MS,
            "decisions_per_s": TARGET_DECISIONS_PER_S,
            "decision_p99_met": result["decision_p99_ms"] < TARGET_P99_MS,
            "decisions_per_s_met": result["decisions_per_s"] >= TARGET_DECISIONS_PER_S,
            "decision_p99_agent_turns_met":
                result["decision_p99_ms_agent_turns"] < TARGET_P99_MS,
            "decisions_per_s_agent_turns_met":
                result["decisions_per_s_agent_turns"] >= TARGET_DECISIONS_PER_S,
            "single_flight_wake_p50_ms": TARGET_WAKE_P50_MS,
            "single_flight_wake_p50_met":
                result["single_flight_wake_p50_ms"] <= TARGET_WAKE_P50_MS,
        }
        return result
    finally:
        if router is not None:
            with contextlib.suppress(Exception):
                await router.stop()
        if workers is not None:
            workers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await workers
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        await kvi.stop()


async def _front_end(s: Settings, url: str, model: ServedModel, separate: RouterService,
                     prompts: list[Prompt], decisions: int, tmp: Path) -> dict:
    """The same decisions by a router in a front end (``services.frontend``): a kvindex
    replica in this process, which replays the same stream and answers its lookups
    through a :class:`~cpd.bus.LocalHub`, interleaved decision by decision with the
    router whose kvindex is another process (``front_end``)."""
    node = msgspec.structs.replace(s.node, node_id="bench-fe")
    kv = msgspec.structs.replace(s.kvindex, snapshot_dir=str(tmp / "fe-snap"),
                                 snapshot_interval_s=86400)
    fe = msgspec.structs.replace(s, node=node, kvindex=kv)
    hub = LocalHub()
    index = KvIndexService(fe, nats_url=url, hub=hub)
    router = RouterService(fe, nats_url=url, model=model, hub=hub)
    try:
        await index.start()
        await asyncio.wait_for(index.ready.wait(), VISIBLE_TIMEOUT_S)
        await router.start()
        await _until("the front end's router sees every worker", READY_TIMEOUT_S,
                     lambda: _sees_workers(router))
        await _warm_up(router, prompts)
        lat: dict[str, list[float]] = {"front_end": [], "separate": []}
        missed = errors = 0
        pair = (("front_end", router), ("separate", separate))
        for i in range(decisions):
            p = prompts[i % len(prompts)]
            for name, r in pair if i % 2 else pair[::-1]:  # each first in turn
                t0 = time.perf_counter_ns()
                d = await r.decide(p.request)
                lat[name].append((time.perf_counter_ns() - t0) / 1e6)
                missed += _lookup_missed(d)
                errors += bool(_check(p.kind, d))
    finally:
        for service in (router, index):
            with contextlib.suppress(Exception):
                await service.stop()
    fe_ms, sep_ms = _stats(lat["front_end"]), _stats(lat["separate"])
    return {"front_end": {
        "decision_ms": fe_ms, "separate_decision_ms": sep_ms,
        "decision_p50_over_separate": round(fe_ms["p50"] / sep_ms["p50"], 3),
        "in_process_messages": hub.delivered, "decisions_without_kvindex_answer": missed,
        "decision_errors": errors}}


async def _warm_up(router: RouterService, prompts: list[Prompt]) -> None:
    """Untimed decisions first: the first ones pay one-off costs (connections, caches)."""
    for p in prompts[:WARMUP_DECISIONS // 2] * 2:
        await router.decide(p.request)


async def _sees_workers(router: RouterService) -> bool:
    return len(router.nodes.live(time.monotonic())) == len(WORKERS)


def _last_background_chain(n_blocks: int) -> tuple[str, bytes, int] | None:
    """(holder, hashes, blocks) of the last background chain: visible means all are."""
    chains = n_blocks // CHAIN
    if not chains:
        return None
    rng = np.random.default_rng(SEED + 1)
    raw = b""
    for _ in range(chains):
        raw = rng.bytes(CHAIN * wire.HASH_BYTES)
    holders = PREPREFILL + PREFILL
    return holders[(chains - 1) % len(holders)], raw, CHAIN


async def _single_flight_wake(router: RouterService, bus: Bus, js: Any, writer: _Writer,
                              ns: Namespace, rounds: int) -> dict:
    """Single-flight wake-up: pp0 allocates and starts writing a new prefix; a waiter
    waits for it (the router's own ``await_prefix``: woken by kvindex's visibility
    event), and, interleaved round by round, a waiter that polls kvindex every 50 ms
    as the router did before (the baseline); then pp0 seals the prefix. Measured per
    round: from this process seeing kvindex's ``kv.visible`` for the last block to the
    waiter resuming (``single_flight_wake_*``; router and this subscriber share one
    event loop, so a waiter that resumed first counts 0), and from publishing the seal
    to the waiter resuming, kvindex's ingest included (``*_seal_to_wake_*``)."""
    rng = np.random.default_rng(SEED + 3)
    seen: dict[bytes, float] = {}

    async def on_visible(msg: Any) -> None:
        ev = wire.decode(msg.data)
        if isinstance(ev, wire.BlocksVisible) and ev.node == writer.node:
            now = time.perf_counter()
            for h in wire.split_hashes(ev.block_hashes):
                seen.setdefault(h, now)

    sub = await bus.nc.subscribe(subjects.KV_VISIBLE, cb=on_visible)
    out: dict[str, dict[str, list[float]]] = {
        k: {"wake": [], "seal_to_wake": []} for k in ("push", "poll")}
    try:
        for i in range(2 * rounds):
            kind = "push" if i % 2 == 0 else "poll"
            raw = rng.bytes(WAKE_CHAIN_BLOCKS * wire.HASH_BYTES)
            chain = wire.split_hashes(raw)
            allocated, writing, sealed = writer.chain(chain, writing=True)
            for ev in (allocated, writing):
                await js.publish(subjects.kv_events(writer.node), wire.encode(ev))
            wait = Wait(node=writer.node, blocks=WAKE_CHAIN_BLOCKS, max_wait_ms=5_000)
            if kind == "push":
                waiter = asyncio.create_task(_resumed(router.await_prefix(
                    wait, ns, raw, f"wake-{i}")))
            else:
                waiter = asyncio.create_task(_resumed(_poll_prefix(bus, ns, raw, wait)))
            await asyncio.sleep(0.02)  # the waiter is waiting
            t_seal = time.perf_counter()
            await js.publish(subjects.kv_events(writer.node), wire.encode(sealed))
            t_resumed = await waiter
            # This subscriber may hear the event just after the router's: then the
            # waiter resumed no later than visibility was seen (0).
            for _ in range(100):
                if chain[-1] in seen:
                    break
                await asyncio.sleep(0.01)
            else:
                raise RuntimeError(f"round {i}: kvindex never said the prefix was visible")
            out[kind]["wake"].append(max(t_resumed - seen[chain[-1]], 0.0) * 1e3)
            out[kind]["seal_to_wake"].append((t_resumed - t_seal) * 1e3)
    finally:
        await sub.unsubscribe()
    push, poll = out["push"], out["poll"]
    wake, wake_poll = _stats(push["wake"]), _stats(poll["wake"])
    return {
        "single_flight_rounds": rounds,
        "single_flight_wake_p50_ms": wake["p50"],
        "single_flight_wake_p90_ms": wake["p90"],
        "single_flight_wake_p50_ms_poll": wake_poll["p50"],
        "single_flight_wake_p90_ms_poll": wake_poll["p90"],
        "single_flight_seal_to_wake_p50_ms": _stats(push["seal_to_wake"])["p50"],
        "single_flight_seal_to_wake_p50_ms_poll": _stats(poll["seal_to_wake"])["p50"],
    }


async def _resumed(waiting: Awaitable[None]) -> float:
    await waiting
    return time.perf_counter()


async def _poll_prefix(bus: Bus, ns: Namespace, hashes: bytes, wait: Wait) -> None:
    """The baseline: look kvindex up every 50 ms until the node shows the prefix."""
    end = time.monotonic() + wait.max_wait_ms / 1000
    while time.monotonic() < end:
        await asyncio.sleep(POLL_BASELINE_S)
        reply = await _lookup(bus, ns, hashes)
        if reply is not None and any(m.node == wait.node and m.num_blocks >= wait.blocks
                                     for m in reply.matches):
            return


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": len(xs), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3), "max": round(float(a.max()), 3),
            "mean": round(float(a.mean()), 3)}


def _lookup_missed(d: Decision) -> bool:
    """Whether the router decided without kvindex's answer (timeout or error)."""
    return d.lookup_missed


def _check(kind: str, d: Decision) -> str:
    """Why ``d`` is not the decision a ``kind`` ("warm" or "cold") prompt should get (""
    when it is); a decision made without kvindex's answer is counted apart (the router's
    designed fallback)."""
    reused = d.plan.reused_tokens
    if _lookup_missed(d):
        return ""
    if kind == "warm" and (d.path == "cold" or not reused):
        return f"warm prompt routed {d.path} reusing {reused} tokens ({d.route().describe()})"
    if kind == "cold" and reused:
        return f"cold prompt routed {d.path} reusing {reused} tokens ({d.route().describe()})"
    return ""


def _gc_collections() -> list[int]:
    return [s["collections"] for s in gc.get_stats()]


async def _sequential(router: RouterService, prompts: list[Prompt], n: int) -> dict:
    """``decide()`` one at a time, warm and cold alternating."""
    lat: dict[str, list[float]] = {"warm": [], "cold": []}
    paths: Counter[str] = Counter()
    errors: list[str] = []
    missed = 0
    # Start from a clean heap: setup's garbage must not be collected inside a timing.
    # Collections the decisions themselves cause count, as they would in service.
    gc.collect()
    before = _gc_collections()
    for i in range(n):
        p = prompts[i % len(prompts)]
        t0 = time.perf_counter_ns()
        d = await router.decide(p.request)
        lat[p.kind].append((time.perf_counter_ns() - t0) / 1e6)
        paths[f"{p.kind}->{d.path}"] += 1
        missed += _lookup_missed(d)
        if why := _check(p.kind, d):
            errors.append(why)
    gcs = [b - a for a, b in zip(before, _gc_collections(), strict=True)]
    both = _stats(lat["warm"] + lat["cold"])
    return {"decision_p50_ms": both["p50"], "decision_p90_ms": both["p90"],
            "decision_p99_ms": both["p99"], "decision_max_ms": both["max"],
            "decision_ms": {"all": both, "warm": _stats(lat["warm"]),
                            "cold": _stats(lat["cold"])},
            "sequential_decisions_per_s": round(1000 / both["mean"]),
            "paths": dict(sorted(paths.items())),
            "decision_errors": len(errors), "decision_error_examples": errors[:3],
            "decisions_without_kvindex_answer": missed,
            "gc_collections_during_sequential": gcs}


def _cpu_per(before: dict[str, float | None], pids: dict[str, int],
             decisions: int) -> dict[str, float | None]:
    """CPU ms each process spent per decision since ``before``."""
    return {name: round(used * 1000 / decisions, 3) if used is not None and decisions else None
            for name, used in cpu_used_since(before, pids).items()}


async def _throughput(router: RouterService, prompts: list[Prompt], concurrency: int,
                      seconds: float, pids: dict[str, int]) -> dict:
    """Closed loop: ``concurrency`` decisions in flight for ``seconds``."""
    lat: list[float] = []
    stop = 0.0

    async def loop(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter_ns()
            await router.decide(prompts[i % len(prompts)].request)
            lat.append((time.perf_counter_ns() - t) / 1e6)
            i += concurrency

    gc.collect()
    cpu0 = cpu_seconds_all(pids)
    t0 = time.perf_counter()
    stop = t0 + seconds
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    wall = time.perf_counter() - t0
    st = _stats(lat)
    return {"concurrency": concurrency, "decisions": len(lat),
            "decisions_per_s": round(len(lat) / wall), "latency_p50_ms": st["p50"],
            "latency_p99_ms": st["p99"], "cpu_ms_per_decision": _cpu_per(cpu0, pids, len(lat))}


async def _breakdown(router: RouterService, prompts: list[Prompt], n: int) -> dict:
    """Each part of ``decide()`` alone, on the same prompts and the same kvindex."""
    ns = router.model.namespace
    vocab = router.model.vocab_size
    timeout = router.cfg.lookup_timeout_ms / 1000
    parts: dict[str, list[float]] = {k: [] for k in (
        "request_decode", "validate", "hash", "lookup_warm", "lookup_cold",
        "policy_warm", "policy_cold", "decide")}
    lookup_errors = 0
    payloads = [wire.encode(p.request) for p in prompts]
    gc.collect()
    for i in range(n):
        k = i % len(prompts)
        p = prompts[k]
        t = time.perf_counter_ns()
        wire.decode(payloads[k], wire.GenerateRequest)
        parts["request_decode"].append((time.perf_counter_ns() - t) / 1e6)
        t = time.perf_counter_ns()
        tokens = wire.unpack_tokens(p.request.tokens or b"")
        if int(tokens.max()) >= vocab:
            raise AssertionError("a benchmark token is outside the vocabulary")
        parts["validate"].append((time.perf_counter_ns() - t) / 1e6)
        t = time.perf_counter_ns()
        hashes = block_hashes(ns, tokens)
        parts["hash"].append((time.perf_counter_ns() - t) / 1e6)
        t = time.perf_counter_ns()
        try:
            reply = await router.bus.request(
                subjects.KVINDEX_LOOKUP,
                wire.LookupRequest(request_id=p.request.request_id, namespace=ns.id,
                                   block_hashes=hashes),
                expect=wire.LookupReply, timeout=timeout)
        except CpdError:
            reply = None  # as the router takes it: a miss, timed like any other lookup
            lookup_errors += 1
        h = Hits.from_reply(reply)
        parts[f"lookup_{p.kind}"].append((time.perf_counter_ns() - t) / 1e6)
        t = time.perf_counter_ns()
        router.policy.decide(len(tokens), router.block_size, h,
                             router.nodes.live(time.monotonic()))
        parts[f"policy_{p.kind}"].append((time.perf_counter_ns() - t) / 1e6)
        # The whole decision right after its parts, so both see the same machine.
        t = time.perf_counter_ns()
        await router.decide(p.request)
        parts["decide"].append((time.perf_counter_ns() - t) / 1e6)
    st = {k: _stats(v) for k, v in parts.items()}
    lookup = _stats(parts["lookup_warm"] + parts["lookup_cold"])
    policy = _stats(parts["policy_warm"] + parts["policy_cold"])
    out = {"hash_ms_p50": st["hash"]["p50"], "hash_ms_p99": st["hash"]["p99"],
           "lookup_ms_p50": lookup["p50"], "lookup_ms_p99": lookup["p99"],
           "policy_ms_p50": policy["p50"], "policy_ms_p99": policy["p99"],
           "validate_ms_p50": st["validate"]["p50"],
           "request_decode_ms_p50": st["request_decode"]["p50"],
           "breakdown_lookup_errors": lookup_errors,
           "breakdown_ms": {**st, "lookup": lookup, "policy": policy}}
    out["parts_sum_ms_p50"] = round(st["validate"]["p50"] + st["hash"]["p50"]
                                    + lookup["p50"] + policy["p50"], 3)
    # decide() timed alongside its parts: what it costs beyond their sum.
    out["breakdown_decide_ms_p50"] = st["decide"]["p50"]
    return out


# ------------------------------------------------------------------- agent turns


class _Agents:
    """Which (session, turn) to send next: ``AGENT_OPEN_SESSIONS`` sessions open, one
    turn of each in flight at most, a finished session replaced by the next one."""

    def __init__(self, sessions: list[AgentSession]) -> None:
        self.sessions = sessions
        self.ready: deque[tuple[int, int]] = deque()
        self.turns_of: dict[int, int] = {}
        self.opened = 0
        self.exhausted = False
        # The first sessions end after staggered numbers of turns (AGENT_TURNS down to
        # 1), as if they had opened at different times: session openings, and with them
        # the turns the memo cannot know, are spread over the pass, not bunched at its
        # start.
        for i in range(min(AGENT_OPEN_SESSIONS, len(sessions))):
            self._open(AGENT_TURNS - i * AGENT_TURNS // AGENT_OPEN_SESSIONS)

    def _open(self, turns: int) -> None:
        if self.opened == len(self.sessions):
            self.exhausted = True
            return
        self.turns_of[self.opened] = turns
        self.ready.append((self.opened, 0))
        self.opened += 1

    def take(self) -> tuple[int, int] | None:
        """The next turn to send; None once a session could not be replaced (the pass
        ends there rather than draining with fewer sessions in flight)."""
        if self.exhausted or not self.ready:
            return None
        return self.ready.popleft()

    def done(self, sid: int, turn: int) -> None:
        if turn + 1 < self.turns_of[sid]:
            self.ready.append((sid, turn + 1))
        else:
            self._open(AGENT_TURNS)


def _memo_counts(memo: BlockHasher) -> dict[str, int]:
    return {"hits": memo.hits, "misses": memo.misses, "blocks_reused": memo.blocks_reused,
            "blocks_computed": memo.blocks_computed}


async def _agent_turns(router: RouterService, sessions: list[AgentSession],
                       concurrency: int, pids: dict[str, int]) -> dict:
    """One pass of agent turns with ``concurrency`` decisions in flight; the router's
    memo must be fresh."""
    agents = _Agents(sessions)
    lat: list[float] = []
    paths: Counter[str] = Counter()
    errors: list[str] = []
    missed = 0

    async def loop() -> None:
        nonlocal missed
        while (item := agents.take()) is not None:
            sid, turn = item
            req = sessions[sid].request(sid, turn)
            t = time.perf_counter_ns()
            d = await router.decide(req)
            lat.append((time.perf_counter_ns() - t) / 1e6)
            agents.done(sid, turn)
            paths[f"agent->{d.path}"] += 1
            missed += _lookup_missed(d)
            if why := _check("warm", d):
                errors.append(why)

    gc.collect()
    cpu0 = cpu_seconds_all(pids)
    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    st = _stats(lat)
    memo = _memo_counts(router.hash_memo)
    blocks = memo["blocks_reused"] + memo["blocks_computed"]
    return {"concurrency": concurrency, "decisions": len(lat),
            "sessions_opened": agents.opened, "decisions_per_s": round(len(lat) / wall),
            "latency_ms": st, "cpu_ms_per_decision": _cpu_per(cpu0, pids, len(lat)),
            "hash_memo": {**memo, "reuse_ratio": round(memo["blocks_reused"] / blocks, 4)
                          if blocks else 0.0,
                          "stored_bytes": router.hash_memo.stored_bytes,
                          "stored_prompts": len(router.hash_memo)},
            "paths": dict(sorted(paths.items())), "decision_errors": len(errors),
            "decision_error_examples": errors[:3],
            "decisions_without_kvindex_answer": missed}


async def _agent_passes(router: RouterService, sessions: list[AgentSession],
                        memo_bytes: int, pids: dict[str, int]) -> dict:
    """The agent-turn mix with the memo enabled: one at a time, then 32 in flight, each
    pass from an empty memo (as after a router restart)."""
    passes = []
    for concurrency in (1, AGENT_CONCURRENCY):
        router.hash_memo = BlockHasher(memo_bytes)
        passes.append(await _agent_turns(router, sessions, concurrency, pids))
    one, many = passes
    router_cpu = many["cpu_ms_per_decision"].get("router")
    return {
        "agent_turns": {
            "first_turn_tokens": AGENT_FIRST_TOKENS, "tokens_per_turn": AGENT_TURN_TOKENS,
            "turns_per_session": AGENT_TURNS, "open_sessions": AGENT_OPEN_SESSIONS,
            "sessions": len(sessions), "hash_memo_bytes": memo_bytes,
            "sequential": one, "throughput": many,
        },
        "decision_p50_ms_agent_turns": one["latency_ms"]["p50"],
        "decision_p99_ms_agent_turns": one["latency_ms"]["p99"],
        "decisions_per_s_agent_turns": many["decisions_per_s"],
        "router_cpu_bound_decisions_per_s_agent_turns": (round(1000 / router_cpu)
                                                         if router_cpu else None),
        "hash_memo_reuse_ratio": many["hash_memo"]["reuse_ratio"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench router``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 100K blocks (tests, CI)")
    parser.add_argument("--blocks", type=int,
                        help="kvindex size in blocks (default 1M; --quick 100K)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench router``'s flags."""
    return run(settings(), quick=args.quick, blocks=args.blocks)
