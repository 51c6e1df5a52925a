"""Routing policy, table-driven: each rule of docs/architecture.md, "Routing" and the §10 rows the
router
handles (kvindex unavailable → miss; pre-prefill queue too long → overflow)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import pytest

from cpd.protocol import wire
from cpd.protocol.wire import RouteReason
from services.router.cost import LoadCost, PrefillCost
from services.router.hits import Hits
from services.router.policy import NoCapacity, NodeLoad, PolicyConfig, Router, choose_decode
from services.router.queueing import remaining_ms, wait_ms

BS = 256
N = 40 * BS + 100  # a 10,340-token prompt: 40 full blocks and a partial one
# ~1 s to prefill 10K tokens; 4 KiB of KV per token (the tiny local model).
COST = PrefillCost(fixed_ms=5, per_token_ms=0.08, per_token_ctx_ms=2e-6)
LOAD = LoadCost(kv_bytes_per_token=4096, per_transfer_ms=0.5)


def nodes(**over: dict) -> list[NodeLoad]:
    """Two nodes of each role, idle unless ``over`` says otherwise: ``ahead_ms`` is work
    the router sent the node since its last report (a queue of that many ms, first come
    first served), ``gone`` leaves the node out, any other key is a NodeLoad field."""
    base = {"pp0": "preprefill", "pp1": "preprefill", "p0": "prefill", "p1": "prefill",
            "d0": "decode", "d1": "decode"}
    out = []
    for name, role in base.items():
        kw = {"bandwidth_gbps": 2.0} | over.get(name, {})
        if kw.pop("gone", False):
            continue
        ahead = kw.pop("ahead_ms", 0.0)
        out.append(NodeLoad(node=name, role=role, dispatched_ms=(ahead,) if ahead else (),
                            **kw))
    return out


BUSY = {n: {"ahead_ms": 3000} for n in ("pp0", "pp1", "p0", "p1")}
COLD_BUSY = {n: {"ahead_ms": 3000} for n in ("pp0", "pp1")}


@dataclass
class Case:
    name: str
    hits: Hits
    loads: dict = field(default_factory=dict)
    path: str = ""
    node: str = ""
    gpu: int = 0
    dram: int = 0
    disk: int = 0
    remote: int = 0
    remote_node: str = ""
    wait: bool = False
    config: dict = field(default_factory=dict)
    # None: the reason of the path (warm → WARM, cold → COLD); set for every overflow.
    reason: RouteReason | None = None


CASES = [
    Case("no prefix: cold to the idler pre-prefill node", Hits(),
         loads={"pp0": {"ahead_ms": 500}}, path="cold", node="pp1"),
    Case("local DRAM hit: warm on that prefill node", Hits(dram={"p1": 36}),
         path="warm", node="p1", dram=36 * BS),
    Case("remote hit on a busy pre-prefill node's DRAM: warm, loaded over UCX",
         Hits(dram={"pp0": 38}), loads={"p0": {"ahead_ms": 50}, "pp0": {"ahead_ms": 10}},
         path="warm", node="p1", remote=38 * BS, remote_node="pp0"),
    Case("local beats remote at equal queues", Hits(dram={"p0": 30, "pp0": 30}),
         path="warm", node="p0", dram=30 * BS),
    Case("GPU hit beats a DRAM hit elsewhere", Hits(gpu={"p1": 36}, dram={"p0": 36}),
         path="warm", node="p1", gpu=36 * BS),
    Case("local GPU then a longer remote run", Hits(gpu={"p0": 20}, dram={"pp1": 38}),
         loads={"pp1": {"ahead_ms": 10}}, path="warm", node="p0", gpu=20 * BS,
         remote=18 * BS, remote_node="pp1"),
    Case("loading slower than recomputing: cold", Hits(dram={"pp0": 38}),
         loads={"p0": {"bandwidth_gbps": 1e-5}, "p1": {"bandwidth_gbps": 1e-5}},
         path="cold", reason=RouteReason.COLD),
    Case("reuse below the threshold: cold", Hits(dram={"p0": 10}), path="cold"),
    Case("kvindex unavailable is a miss (§10)", Hits(ok=False), path="cold",
         reason=RouteReason.KVINDEX_UNAVAILABLE),
    Case("pre-prefill queue too long: cold overflows to prefill (§10)", Hits(),
         loads={"pp0": {"ahead_ms": 9000}, "pp1": {"ahead_ms": 8000}},
         path="overflow", node="p0", reason=RouteReason.PREPREFILL_BUSY),
    Case("prefill tier saturated: warm overflows to pre-prefill", Hits(dram={"pp1": 38}),
         loads={"p0": {"ahead_ms": 9000}, "p1": {"ahead_ms": 9000}},
         path="overflow", node="pp1", dram=38 * BS, reason=RouteReason.PREFILL_BUSY),
    Case("no pre-prefill node: cold goes to prefill", Hits(),
         loads={"pp0": {"gone": True}, "pp1": {"gone": True}}, path="overflow", node="p0",
         reason=RouteReason.NO_PREPREFILL),
    Case("no prefill node: warm goes to the pre-prefill node holding the prefix",
         Hits(dram={"pp1": 38}), loads={"p0": {"gone": True}, "p1": {"gone": True}},
         path="overflow", node="pp1", dram=38 * BS, reason=RouteReason.NO_PREFILL),
    Case("same prefix being computed, pre-prefill queued: wait for it (single-flight)",
         Hits(pending={"pp0": 40}), loads=COLD_BUSY, path="overflow", wait=True,
         reason=RouteReason.PREPREFILL_BUSY),
    Case("same prefix being computed, everything queued: wait, same latency, half the work",
         Hits(pending={"pp0": 40}), loads=BUSY, path="cold", wait=True),
    Case("same prefix being computed, warm tier far busier: compute now",
         Hits(pending={"pp0": 40}), loads={"p0": {"ahead_ms": 5000}, "p1": {"ahead_ms": 5000}},
         path="cold"),
    Case("single-flight off", Hits(pending={"pp0": 40}), loads=COLD_BUSY, path="overflow",
         config={"single_flight": False}, reason=RouteReason.PREPREFILL_BUSY),
    Case("small pending prefix (still cold after it): no wait", Hits(pending={"pp0": 8}),
         loads=COLD_BUSY, path="overflow", reason=RouteReason.PREPREFILL_BUSY),
    Case("some reuse but pre-prefill idle: no overflow", Hits(dram={"p0": 10}),
         path="cold", node="pp0"),
    Case("local disk hit: warm on that node, read back and loaded",
         Hits(disk={"p1": 36}), path="warm", node="p1", disk=36 * BS),
    Case("local DRAM, then the rest of the prefix from the same node's disk",
         Hits(dram={"p1": 20}, disk={"p1": 36}), path="warm", node="p1", dram=20 * BS,
         disk=16 * BS),
    Case("a peer's disk past its DRAM: loaded over UCX", Hits(dram={"pp0": 10},
         disk={"pp0": 38}), loads={"pp0": {"ahead_ms": 10}}, path="warm", node="p0",
         remote=38 * BS, remote_node="pp0"),
    Case("disk reads slower than recomputing: cold", Hits(disk={"p0": 38, "pp0": 38}),
         config={"disk_bandwidth_gbps": 1e-5}, path="cold"),
    Case("slow disk, its DRAM part still loads", Hits(dram={"p0": 30}, disk={"p0": 38}),
         config={"disk_bandwidth_gbps": 1e-5}, path="warm", node="p0", dram=30 * BS),
    Case("a peer's measured disk rate, not the configured one, prices its disk",
         Hits(disk={"pp0": 38}), loads={"pp0": {"disk_gbps": 1e-5}}, path="cold"),
    Case("a fast measured disk beats a configured slow one", Hits(disk={"pp0": 38}),
         loads={"pp0": {"disk_gbps": 4.0, "ahead_ms": 10}}, config={"disk_bandwidth_gbps": 1e-5},
         path="warm", node="p0", remote=38 * BS, remote_node="pp0"),
    Case("an idle pre-prefill node's own GPU hit: warm there, no transfer",
         Hits(gpu={"pp0": 38}, dram={"pp0": 38}), path="warm", node="pp0", gpu=38 * BS,
         reason=RouteReason.IDLE_PREPREFILL_HIT),
    Case("an idle pre-prefill node's own DRAM beats a peer's load",
         Hits(dram={"pp1": 38}), path="warm", node="pp1", dram=38 * BS,
         reason=RouteReason.IDLE_PREPREFILL_HIT),
    Case("a pre-prefill node with work keeps its tier for cold prompts: loaded over UCX",
         Hits(gpu={"pp0": 38}, dram={"pp0": 38}), loads={"pp0": {"ahead_ms": 10}},
         path="warm", node="p0", remote=38 * BS, remote_node="pp0"),
    Case("a prefill node's own hit is as cheap: it stays on the prefill tier",
         Hits(dram={"p1": 38, "pp0": 38}), path="warm", node="p1", dram=38 * BS),
    Case("warm_on_idle_preprefill off: loaded over UCX",
         Hits(gpu={"pp0": 38}, dram={"pp0": 38}), config={"warm_on_idle_preprefill": False},
         path="warm", node="p0", remote=38 * BS, remote_node="pp0"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpd_policy(case: Case) -> None:
    router = Router(PolicyConfig(**case.config), COST, LOAD)
    d = router.decide(N, BS, case.hits, nodes(**case.loads))
    assert d.path == case.path, d.reason
    if case.node:
        assert d.plan.node == case.node, d.reason
    assert (d.plan.gpu_tokens, d.plan.dram_tokens, d.plan.disk_tokens,
            d.plan.remote_tokens) == (case.gpu, case.dram, case.disk, case.remote)
    assert d.plan.remote_node == case.remote_node
    assert d.plan.computed_tokens == N - d.plan.reused_tokens
    assert (d.wait is not None) == case.wait
    want = case.reason or {"warm": RouteReason.WARM, "cold": RouteReason.COLD}[case.path]
    assert d.reason is want
    route = d.route()
    assert (route.reason, route.reusable_tokens, route.planned_reused_tokens) == (
        want, d.reusable_tokens, d.plan.reused_tokens)
    assert route.describe()  # every code has words
    assert d.lookup_missed is route.lookup_missed is (not case.hits.ok)
    if d.path == "cold":
        assert d.plan.role == "preprefill"
    assert d.decode_node == "d0"


@pytest.mark.parametrize(("loads", "path", "loaded", "gbps", "measured"), [
    # Measured fast: loaded, and the route names the price it won on.
    ({"pp0": {"ahead_ms": 10}}, "warm", True, 2.0, True),
    # Measured slow: recomputed (cold), and the route says why with the measured rate.
    ({"p0": {"bandwidth_gbps": 1e-5}, "p1": {"bandwidth_gbps": 1e-5}}, "cold", False,
     1e-5, True),
    # Never measured: priced at the configured default (1 GB/s), and says so.
    ({"pp0": {"ahead_ms": 10}, "p0": {"bandwidth_gbps": 0.0},
      "p1": {"bandwidth_gbps": 0.0}}, "warm", True, 1.0, False),
])
def test_a_route_carries_the_price_of_the_peer_load_it_took_or_declined(
        loads: dict, path: str, loaded: bool, gbps: float, measured: bool) -> None:
    d = Router(PolicyConfig(), COST, LOAD).decide(N, BS, Hits(dram={"pp0": 38}),
                                                  nodes(**loads))
    r = d.route()
    assert r.path == path
    p = r.peer_load
    assert p is not None
    assert (p.peer, p.tokens, p.gbps, p.measured, p.loaded) == (
        "pp0", 38 * BS, gbps, measured, loaded)
    assert (p.load_ms < p.compute_ms) is loaded
    assert p.load_ms == pytest.approx(LOAD.ms(38 * BS, gbps), abs=1e-3)
    assert (r.remote_node == "pp0") is loaded
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=wire.Route).peer_load == p
    assert r.describe()


def test_a_route_with_no_peer_holding_more_carries_no_peer_price() -> None:
    r = Router(PolicyConfig(), COST, LOAD).decide(N, BS, Hits(dram={"p1": 36}),
                                                  nodes()).route()
    assert r.peer_load is None


def test_load_sources_describe_the_plan() -> None:
    router = Router(PolicyConfig(), COST, LOAD)
    # pp1 has work: it keeps its tier for cold prompts, and p0 loads from it.
    d = router.decide(N, BS, Hits(gpu={"p0": 10}, dram={"p0": 20, "pp1": 38}),
                      nodes(pp1={"ahead_ms": 10}))
    assert d.plan.node == "p0"
    assert list(d.plan.sources) == [
        wire.LoadSource(node="p0", tier=wire.Tier.DRAM, first_block=10, num_blocks=10),
        wire.LoadSource(node="pp1", tier=wire.Tier.DRAM, first_block=20, num_blocks=18),
    ]
    r = d.route()
    assert (r.policy, r.path, r.prefill_node, r.decode_node) == ("cpd", "warm", "p0", "d0")
    assert (r.tokens.gpu, r.tokens.dram, r.tokens.remote, r.tokens.computed) == \
        (10 * BS, 10 * BS, 18 * BS, N - 38 * BS)


def test_load_sources_name_their_runs_and_capabilities_not_checksums() -> None:
    """Each source names its node's run of blocks and the node's capability; the router
    neither asks kvindex for checksums nor passes any on (the puller asks kvindex while
    the bytes travel), and a GPU match is never a source."""
    hits = Hits.from_reply(wire.LookupReply(num_blocks=38, matches=[
        wire.TierMatch("pp1", wire.Tier.DRAM, 38, b"c1"),
        wire.TierMatch("p0", wire.Tier.DRAM, 20, b"c0"),
        wire.TierMatch("p0", wire.Tier.GPU, 10)]))
    d = Router(PolicyConfig(), COST, LOAD).decide(N, BS, hits, nodes(pp1={"ahead_ms": 10}))
    assert [(s.node, s.first_block, s.num_blocks, s.capability, s.checksums)
            for s in d.plan.sources] == [("p0", 10, 10, b"c0", b""), ("pp1", 20, 18, b"c1", b"")]
    assert hits.source("p1", 0, 3).capability == b""


async def test_the_routers_lookup_asks_for_no_checksums() -> None:
    """kvindex finds a checksum per matched block and node when asked (a warm 100K-token
    prompt held by two nodes: 0.19 ms of kvindex's time); the router does not ask."""
    from cpd.ops.config import load_settings
    from cpd.protocol.hashing import Namespace
    from services.router.service import RouterService

    sent: list[wire.Message] = []

    class _Bus:
        async def request(self, subject: str, msg: wire.Message, **_: object
                          ) -> wire.LookupReply:
            sent.append(msg)
            return wire.LookupReply(num_blocks=1, matches=[
                wire.TierMatch("pp0", wire.Tier.DRAM, 1, b"cap")])

    router = RouterService(load_settings(environ={}))
    router.bus = _Bus()  # type: ignore[assignment]
    ns = Namespace(model_id="m", model_revision="r", tokenizer_hash="t", kv_dtype="auto",
                   block_size=BS)
    hits = await router._lookup(ns, b"h" * 16, "r1")
    assert hits.dram == {"pp0": 1} and hits.caps == {"pp0": b"cap"}
    (asked,) = sent
    assert isinstance(asked, wire.LookupRequest) and not asked.checksums


def test_a_disk_source_names_its_tier() -> None:
    hits = Hits.from_reply(wire.LookupReply(num_blocks=38, matches=[
        wire.TierMatch("pp0", wire.Tier.DISK, 38, b"cap"),
        wire.TierMatch("pp0", wire.Tier.DRAM, 12, b"cap")]))
    assert (hits.dram, hits.disk, hits.served) == ({"pp0": 12}, {"pp0": 38}, {"pp0": 38})
    d = Router(PolicyConfig(), COST, LOAD).decide(N, BS, hits, nodes())
    (src,) = d.plan.sources
    assert (src.node, src.tier, src.first_block, src.num_blocks, src.capability) == (
        "pp0", wire.Tier.DISK, 0, 38, b"cap")
    assert hits.source("pp0", 0, 12).tier is wire.Tier.DRAM


def test_the_last_token_is_always_computed() -> None:
    router = Router(PolicyConfig(), COST, LOAD)
    d = router.decide(4 * BS, BS, Hits(dram={"p0": 4}), nodes())
    assert d.plan.dram_tokens == 3 * BS and d.plan.computed_tokens == BS


def test_decode_choice_and_missing_roles() -> None:
    assert choose_decode(nodes()) == "d0"
    assert choose_decode(nodes(d0={"in_flight": 1})) == "d1"
    assert choose_decode(nodes(d0={"in_flight": 5}, d1={"in_flight": 2})) == "d1"
    with pytest.raises(NoCapacity):
        choose_decode(nodes(d0={"gone": True}, d1={"gone": True}))
    only_decode = [n for n in nodes() if n.role == "decode"]
    for name in ("cpd", "pd-kv", "pd-rr"):
        with pytest.raises(NoCapacity):
            Router(PolicyConfig(name=name), COST, LOAD).decide(N, BS, Hits(), only_decode)


def test_pd_rr_cycles_over_every_prefill_capable_node() -> None:
    router = Router(PolicyConfig(name="pd-rr"), COST, LOAD)
    picks = [router.decide(N, BS, Hits(dram={"pp0": 38}), nodes()).plan.node
             for _ in range(8)]
    assert picks == ["p0", "p1", "pp0", "pp1"] * 2
    d = router.decide(N, BS, Hits(gpu={"p1": 30}, dram={"pp0": 38}), nodes())
    assert d.plan.remote_tokens == 0 and d.plan.dram_tokens == 0  # no loads in the baseline


def test_pd_kv_weighs_local_cache_against_queue_but_never_loads_remotely() -> None:
    router = Router(PolicyConfig(name="pd-kv"), COST, LOAD)
    d = router.decide(N, BS, Hits(gpu={"p1": 36}), nodes())
    assert d.plan.node == "p1" and d.plan.gpu_tokens == 36 * BS
    d = router.decide(N, BS, Hits(gpu={"p1": 36}), nodes(p1={"ahead_ms": 60_000}))
    assert d.plan.node != "p1"
    d = router.decide(N, BS, Hits(dram={"pp0": 38}), nodes(pp0={"ahead_ms": 60_000}))
    assert d.plan.remote_tokens == 0


def test_cost_model_fit_recovers_its_coefficients() -> None:
    true = PrefillCost(fixed_ms=4.0, per_token_ms=0.07, per_token_ctx_ms=3e-6)
    samples = [(n, c, true.ms(n, c)) for n in (256, 1024, 4096, 8192) for c in (0, 4096, 16384)]
    fit = PrefillCost.fit(samples)
    for n, c, ms in samples:
        assert fit.ms(n, c) == pytest.approx(ms, rel=1e-6)
    assert LOAD.ms(0, 1.0) == 0 and LOAD.ms(1000, 0) == float("inf")
    assert LOAD.ms(1000, 4.096) == pytest.approx(0.5 + 1.0)


def test_queue_estimates_first_come_first_served_and_with_shared_steps() -> None:
    cost = PrefillCost(fixed_ms=0, per_token_ms=0.01, per_token_ctx_ms=0)
    held = [wire.PrefillWork(100_000, 0, 400.0), wire.PrefillWork(2_000, 0, 100.0),
            wire.PrefillWork(50_000, 0)]  # the last one still loads its prefix
    # FCFS: only the oldest has progressed; a new prefill waits for all of it.
    assert remaining_ms(held, cost, False) == [600.0, 20.0, 500.0]
    assert wait_ms([600.0, 20.0, 500.0], 20.0, False) == 1120.0
    # Shared steps: the two in the engine progressed side by side (time / 2 each), and
    # each held prefill delays a new one by at most the new one's own length.
    assert remaining_ms(held, cost, True) == [800.0, 0.0, 500.0]
    assert wait_ms([800.0, 0.0, 500.0], 20.0, True) == 40.0
    assert wait_ms([800.0, 0.0, 500.0], 1000.0, True) == 1300.0
    assert remaining_ms([wire.PrefillWork(1_000, 0, 5_000.0)], cost, False) == [0.0]
    assert wait_ms([], 10.0, True) == 0.0


# The sim's 8B preset, roughly (ms): a 100K-token cold prefill ~1 s, a 2K warm suffix at
# 120K context ~35 ms.
SIM = PrefillCost(fixed_ms=2, per_token_ms=0.00357, per_token_ctx_ms=1.3e-7)
COLD_N, WARM_CTX = 100_000, 120_000


def _held(*works: tuple[int, int, float]) -> tuple[wire.PrefillWork, ...]:
    return tuple(wire.PrefillWork(n, c, e) for n, c, e in works)


@pytest.mark.parametrize("shares", [False, True])
def test_a_warm_request_behind_a_cold_prefill_overflows_only_without_shared_steps(
        shares: bool) -> None:
    # Both prefill nodes are computing an overflowed cold prompt; the pre-prefill node
    # holds the session's prefix and is idle.
    busy = {"prefills": _held((COLD_N, 0, 100.0)), "shares_steps": shares}
    loads = {"p0": busy, "p1": busy, "pp1": {"gone": True}}
    n = WARM_CTX + 2_000
    d = Router(PolicyConfig(), SIM, LOAD).decide(
        n, BS, Hits(gpu={"p0": WARM_CTX // BS}, dram={"pp0": WARM_CTX // BS}),
        nodes(**loads))
    if shares:  # the suffix shares steps with the cold prompt: ~2x its own time
        assert (d.path, d.plan.node) == ("warm", "p0"), d.reason
        assert d.plan.queue_ms == pytest.approx(d.plan.compute_ms)
    else:  # it would wait out the cold prompt's remaining ~0.9 s
        assert (d.path, d.plan.node) == ("overflow", "pp0"), d.reason


def test_a_cold_request_overflows_to_a_prefill_node_that_only_holds_short_work() -> None:
    # The pre-prefill node computes two colds; the prefill node holds warm suffixes.
    loads = {"pp0": {"prefills": _held((COLD_N, 0, 50.0), (COLD_N, 0, 0.0)),
                     "shares_steps": True},
             "pp1": {"gone": True},
             "p0": {"prefills": _held((2_000, WARM_CTX, 5.0), (2_000, WARM_CTX, 0.0)),
                    "shares_steps": True},
             "p1": {"gone": True}}
    d = Router(PolicyConfig(), SIM, LOAD).decide(COLD_N, BS, Hits(), nodes(**loads))
    assert (d.path, d.plan.node) == ("overflow", "p0"), d.reason
    # With the pre-prefill node idle, the cold prompt stays in its tier.
    loads["pp0"] = {"prefills": (), "shares_steps": True}
    d = Router(PolicyConfig(), SIM, LOAD).decide(COLD_N, BS, Hits(), nodes(**loads))
    assert (d.path, d.plan.node) == ("cold", "pp0"), d.reason


def test_requests_dispatched_since_the_last_report_count_as_held_work() -> None:
    router = Router(PolicyConfig(), SIM, LOAD)
    idle = NodeLoad(node="p0", role="prefill", prefills=())
    after = NodeLoad(node="p0", role="prefill", prefills=(), dispatched_ms=(300.0, 5.0))
    assert router.queue_ms(idle, 50.0) == 0.0
    assert router.queue_ms(after, 50.0) == 305.0
    assert router.queue_ms(NodeLoad(node="p0", role="prefill", prefills=(),
                                    dispatched_ms=(300.0, 5.0), shares_steps=True),
                           50.0) == 55.0



def test_every_configurable_policy_is_a_class_behind_one_protocol() -> None:
    from typing import get_args

    from services.router.policy import POLICIES, PolicyName, RoutingPolicy

    assert set(POLICIES) == set(get_args(PolicyName))
    for name, cls in POLICIES.items():
        assert issubclass(cls, RoutingPolicy) and cls.name == name
        router = Router(PolicyConfig(name=name), COST, LOAD)  # type: ignore[arg-type]
        assert isinstance(router.policy, cls)
        assert router.decide(N, BS, Hits(), nodes()).policy == name


@pytest.mark.parametrize("seed", range(20))
def test_each_node_plans_from_its_best_peer_as_a_scan_of_every_peer_would(seed: int) -> None:
    """The router finds the two longest DRAM hits once per decision; every node's plan
    uses the best peer that is not itself, ties to the larger name, exactly as scanning
    every peer for every node does."""
    rng = random.Random(seed)
    peers = [f"n{i}" for i in range(rng.randint(0, 12))]
    hits = Hits(dram={p: rng.choice([0, 3, 10, 40, 41, 60]) for p in peers})
    router = Router(PolicyConfig(), COST, LOAD)
    router.decide(N, BS, hits, nodes())  # a decision starts its own memo
    cap = (N - 1) // BS * BS
    for node in [*peers, "other"]:
        want = max(((min(b * BS, cap), p) for p, b in hits.dram.items() if p != node),
                   default=(0, ""))
        assert router._best_peer(hits, cap, BS, node) == want, node
