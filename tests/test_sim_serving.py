"""The sim engine inside the real workers (``worker.engine = "sim"``): settings, the
namespace and limits the router and workers share, and an end-to-end run through real
NATS, kvindex, router and sim worker processes; plus the quick sweep's JSON."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from cpd.bus import StreamReader
from cpd.engines.profile import engine_profile, served_model
from cpd.ops.config import load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import ConfigError, CpdError, InvalidRequest, Overloaded
from cpd.protocol.hashing import block_hashes
from cpd.sim.costmodel import preset
from cpd.sim.workloads import block_token_ids
from services.router.configured import prefill_cost
from tools.bench.simcluster import SimCluster as BaseSimCluster
from tools.bench.sweep import (
    BY_LABEL,
    TOPOLOGIES,
    SimCluster,
    SweepConfig,
    config_for,
    headline,
    make_workload,
)

SIM = ["worker.engine=sim"]
T = TypeVar("T")
MOONCAKE_HEAD = (Path(__file__).parent / "data" / "mooncake"
                 / "conversation_trace_head200.jsonl")


def test_sim_settings_give_one_namespace_slot_size_and_cost_seeds() -> None:
    s = load_settings(environ={}, overrides=[*SIM, "sim.time_scale=4"])
    model = served_model(s)
    assert model.namespace == engine_profile(s).namespace()
    assert model.max_model_len == s.sim.max_model_len and model.vocab_size == 32_000
    # 8B preset: 128 KiB of KV per token, 256-token blocks, scaled down 8192 times.
    assert engine_profile(s).slot_bytes == 128 * 1024 * 256 // 8192
    fixed, per_token, per_ctx = preset(s.sim.preset).prefill_coefficients_ms()
    cost = prefill_cost(engine_profile(s))
    assert cost.per_token_ms == pytest.approx(per_token / 4)
    assert cost.fixed_ms == pytest.approx(fixed / 4)
    assert cost.per_token_ctx_ms == pytest.approx(per_ctx / 4)
    other = load_settings(environ={}, overrides=[*SIM, "sim.preset=h200-tp4-llama-3.1-8b"])
    assert engine_profile(other).namespace().id != model.namespace.id
    with pytest.raises(InvalidRequest):
        model.encode("text needs a tokenizer")
    assert model.detokenizer().push([1, 2, 3]) == ""


async def _until(probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool],
                 timeout_s: float = 10.0) -> T:
    """Poll ``probe`` until ``ok`` holds of its answer (events reach kvindex async)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await probe()
        if ok(got) or asyncio.get_running_loop().time() > deadline:
            assert ok(got), got
            return got
        await asyncio.sleep(0.05)


def test_cache_tenant_salt_salts_the_deployment_namespace() -> None:
    plain = served_model(load_settings(environ={}, overrides=SIM))
    salted = served_model(load_settings(
        environ={"CPD_CACHE__TENANT_SALT": "blue"}, overrides=SIM))
    assert salted.namespace.tenant_salt == "blue"
    assert salted.namespace.id != plain.namespace.id
    assert salted.namespace_for("acme").id != plain.namespace_for("acme").id


def test_unknown_sim_preset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sim preset"):
        load_settings(environ={}, overrides=["sim.preset=b300-imaginary"])


def test_decode_workers_may_use_their_own_preset() -> None:
    s = load_settings(environ={}, overrides=[*SIM, "sim.decode_preset=b200-dp4-llama-3.1-8b"])
    assert engine_profile(s).cost_model("decode").name == "b200-dp4-llama-3.1-8b"
    assert engine_profile(s).cost_model("prefill").name == s.sim.preset


@pytest.mark.timeout(90)
async def test_sim_workers_serve_cold_then_warm_with_identical_tokens(tmp_path: Path) -> None:
    """CPD-1D on sim workers: a new prompt goes cold to the pre-prefill node, the same
    prompt again goes warm to the prefill node pulling the prefix from pre-prefill's
    DRAM, and once more from the prefill node's own DRAM after its GPU cache is reset;
    the deterministic sim tokens are the same on every path."""
    cluster = SimCluster(BY_LABEL["CPD-1D"], SweepConfig(
        time_scale=1.0, progress=False,
        extra_env={"CPD_ROUTER__WARM_ON_IDLE_PREPREFILL": "false"}), tmp_path)
    try:
        await cluster.start()
        client = cluster.client
        assert client is not None
        prompt = [*block_token_ids(list(range(1, 41)), 256).tolist(), 7, 8, 9]  # 10,243
        reports = await client.bus.nc.subscribe(subjects.load("preprefill", "pp0"))
        cold = await client.generate(prompt, max_tokens=8, ignore_eos=True)
        assert cold.route.path == "cold" and cold.route.prefill_node == "pp0"
        # Its load reports listed the prefill while pp0 held it (priced by the router
        # like the new request), and nothing once it was done.
        held = []
        while reports.pending_msgs or not held or held[-1]:
            report = wire.decode((await reports.next_msg(timeout=5)).data, wire.LoadReport)
            assert report.prefill_token_cap == 0
            held.append([(w.new_tokens, w.context_tokens) for w in report.prefills])
        await reports.unsubscribe()
        assert [(len(prompt), 0)] in held and held[-1] == []
        assert cold.route.tokens.computed == len(prompt) and cold.route.decode_node == "d0"
        assert len(cold.token_ids) == 8
        # Like vLLM's KV events, the engine's GPU prefix cache reaches kvindex.
        ns = engine_profile(load_settings(environ={}, overrides=SIM)).namespace()
        hashes = block_hashes(ns, prompt)

        async def gpu_blocks() -> dict[str, int]:
            reply = await client.bus.request(
                subjects.KVINDEX_LOOKUP, wire.LookupRequest(namespace=ns.id,
                                                            block_hashes=hashes),
                expect=wire.LookupReply)
            return {m.node: m.num_blocks for m in reply.matches if m.tier == wire.Tier.GPU}

        await _until(lambda: gpu_blocks(), lambda got: got.get("pp0") == 40)
        warm = await client.generate(prompt, max_tokens=8, ignore_eos=True)
        assert warm.route.path == "warm" and warm.route.prefill_node == "p0"
        assert warm.route.tokens.remote == 10_240 and warm.route.tokens.computed == 3
        assert warm.token_ids == cold.token_ids
        await cluster.client.bus.request(subjects.admin("prefill", "p0"),
                                         wire.ResetCache(reason="test"), expect=wire.Accepted)
        await _until(lambda: gpu_blocks(), lambda got: "p0" not in got)  # reset: cleared
        local = await client.generate(prompt, max_tokens=8, ignore_eos=True)
        assert local.route.prefill_node == "p0" and local.route.tokens.dram == 10_240
        assert local.token_ids == cold.token_ids
        # Workers heart-beat and report load like vLLM workers do.
        status = await client.status()
        assert {n.node for n in status.nodes} == {"pp0", "p0", "d0"}
        assert all(n.alive and n.dram_total_bytes for n in status.nodes)
        assert status.namespace == engine_profile(
            load_settings(environ={}, overrides=SIM)).namespace().id
    finally:
        await cluster.stop()


@pytest.mark.timeout(90)
async def test_a_burst_of_dispatches_is_bounded_at_acceptance(tmp_path: Path) -> None:
    """A worker holding ``max_queued_requests`` refuses the next dispatch up front (the
    router routes around it) and never fails one it has already accepted: every
    accepted request counts from its acceptance, not from when its task starts."""
    cluster = BaseSimCluster({"p0": "prefill", "d0": "decode"}, tmp_path, env={
        "CPD_WORKER__MAX_QUEUED_REQUESTS": "2", "CPD_SIM__TIME_SCALE": "0.05"})
    try:
        await cluster.start()
        assert cluster.client is not None
        bus = cluster.client.bus
        ns = engine_profile(load_settings(environ={}, overrides=SIM)).namespace()
        prompt = block_token_ids(list(range(100, 120)), 256).tolist()  # 5,120 tokens
        readers = [StreamReader(bus, idle_timeout=30) for _ in range(4)]

        async def dispatch(i: int) -> bool:
            req = wire.PrefillRequest(
                request_id=f"burst-{i}", reply_to=await readers[i].open(),
                tokens=wire.pack_tokens(prompt), namespace=ns.id,
                sampling=wire.SamplingParams(max_tokens=4, ignore_eos=True),
                block_hashes=block_hashes(ns, prompt), decode_node="d0",
                deadline_unix_ms=int(time.time() * 1000) + 60_000)
            try:
                await bus.request(subjects.run("prefill", "p0"), req, expect=wire.Accepted)
                return True
            except Overloaded:
                return False

        accepted = await asyncio.gather(*(dispatch(i) for i in range(4)))
        assert sorted(accepted) == [False, False, True, True]
        for reader, ok in zip(readers, accepted, strict=True):
            if ok:  # raises the typed error if the worker failed it after accepting
                msgs = [m async for m in _until_final(reader)]
                assert isinstance(msgs[-1], wire.Final)
            await reader.close()
    finally:
        await cluster.stop()


async def _until_final(reader: StreamReader) -> AsyncIterator[wire.Message]:
    while True:
        msg = await reader.next(timeout=30)
        assert msg is not None
        yield msg
        if isinstance(msg, wire.Final):
            return


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_sweep_writes_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "new" / "sweep.json"  # a folder that does not exist yet
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "sweep", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("cpd_over_pd_rr", "cpd_over_pd_kv", "low_load_p50_ratio", "bound_fraction",
                "analytic_bound_qps_per_gpu", "topologies", "config", "by_slo"):
        assert key in result
    assert set(result["by_slo"]) == {"2", "3"}
    assert set(result["topologies"]) == {"2P1D pd-rr", "CPD-1D"}
    for t in result["topologies"].values():
        # --quick runs its two loads whatever happens (no floor load, no stop rule).
        assert len(t["points"]) == 2 and "sustainable_qps_per_gpu" in t
        assert all(p["requests"] > 0 for p in t["points"])
        assert all("warm" in p["by_path"] or "cold" in p["by_path"] for p in t["points"])
    assert Path(result["table"]).exists()


def test_topologies_compare_at_equal_gpu_count() -> None:
    gpus = {t.label: t.gpus(4) for t in TOPOLOGIES}
    assert gpus["2P1D pd-rr"] == gpus["2P1D pd-kv"] == gpus["CPD-1D"] == 12
    assert gpus["2P2D pd-rr"] == gpus["2P2D pd-kv"] == gpus["CPD-2D"] == 16
    assert BY_LABEL["CPD-1D"].nodes() == {"pp0": "preprefill", "p0": "prefill",
                                          "d0": "decode"}


def test_sweep_workloads_and_options() -> None:
    s = load_settings(environ={}, overrides=SIM)
    with pytest.raises(CpdError, match="--trace"):
        config_for(s, workload="mooncake")
    with pytest.raises(CpdError, match="unknown topology"):
        config_for(s, topologies="3P0D")
    with pytest.raises(CpdError, match="--stop-after"):
        config_for(s, stop_after=0)
    assert config_for(s).stop_after_unsustainable is None
    assert config_for(s, stop_after=1).stop_after_unsustainable == 1
    cfg = config_for(s, workload="mooncake", trace=str(MOONCAKE_HEAD), qps="0.5",
                     steady_s=10, ramp_s=0)
    reqs = make_workload(cfg, 6.0, 256)
    assert reqs and all(r.block_tokens == 512 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    quick = config_for(s, quick=True)
    assert quick.time_scale == 3.0 and len(quick.topologies) == 2
    agent = make_workload(quick, 4.8, 256)
    assert max(r.prompt_len for r in agent) < 200_000


def test_headline_keys_from_topology_results() -> None:
    def point(target: float, p90: float, p50: float = 0.5) -> dict:
        # 12 GPUs, everything offered achieved: only the TTFT p90 decides.
        qps = target * 12
        return {"target_qps_per_gpu": target, "offered_qps": qps, "achieved_qps": qps,
                "goodput_qps": qps, "gpus": 12, "requests": 100, "completed": 100,
                "errors": 0, "ttft_p50_s": p50, "ttft_p90_s": p90, "tpot_mean_s": 0.01,
                "tpot_p50_s": 0.01, "ttft_slo_s": 3.0}

    def top(*p90s: float, p50_low: float = 0.5) -> dict:
        points = [point(0.4 + 0.2 * i, p90, p50_low if i == 0 else 0.5)
                  for i, p90 in enumerate(p90s)]
        return {"sustainable_qps_per_gpu": 0.0, "points": points}

    # p90 at 0.4, 0.6, 0.8, 1.0, 1.2 QPS/GPU
    result = {"topologies": {"2P1D pd-rr": top(1.0, 2.5, 9.0),
                             "2P1D pd-kv": top(1.0, 1.5, 2.9, 9.0, p50_low=0.4),
                             "CPD-1D": top(0.5, 1.0, 1.5, 2.5, 9.0)},
              "analytic_bound_qps_per_gpu": {"1D": 1.32}}
    keys = headline(result, SweepConfig(qps_per_gpu=(0.4, 0.6, 0.8, 1.0, 1.2),
                                        ttft_slo_s=3.0))
    assert keys["cpd_over_pd_rr"] == pytest.approx(1.0 / 0.6, abs=1e-3)
    assert keys["cpd_over_pd_kv"] == pytest.approx(1.0 / 0.8, abs=1e-3)
    assert keys["low_load_p50_ratio"] == pytest.approx(1.0)
    assert keys["bound_fraction"] == pytest.approx(1.0 / 1.32, abs=1e-3)
    assert keys["cpd_over_pd_rr_2d"] is None
    # The same points read at a 2 s SLO: every topology sustains less.
    at2 = keys["by_slo"]["2"]
    assert at2["sustainable_qps_per_gpu"] == pytest.approx(
        {"2P1D pd-rr": 0.4, "2P1D pd-kv": 0.6, "CPD-1D": 0.8})
    assert at2["cpd_over_pd_rr"] == pytest.approx(2.0)
    assert keys["by_slo"]["3"]["cpd_over_pd_kv"] == keys["cpd_over_pd_kv"]
