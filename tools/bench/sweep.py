"""``cpd bench sweep``: the paper's Figure 4 (seed article §6) on the real services with
simulated engines (docs/architecture.md, "Engines", docs/sim.md).

Topologies, at equal GPU count (every node is one engine of ``cost.gpus`` GPUs, 4 for
the presets; the seed article: "2P1D/2P2D: two prefill nodes and one or two decode
nodes, all requests sharing the same prefill capacity; CPD-1D/2D: a dedicated
pre-prefill tier, one ordinary prefill tier and one or two decode nodes"):

==========  ===========================================  ==========  =====
topology    nodes                                        policy      GPUs
==========  ===========================================  ==========  =====
2P1D        2 prefill + 1 decode                         pd-rr/pd-kv  12
CPD-1D      1 pre-prefill + 1 prefill + 1 decode         cpd          12
2P2D        2 prefill + 2 decode                         pd-rr/pd-kv  16
CPD-2D      1 pre-prefill + 1 prefill + 2 decode         cpd          16
==========  ===========================================  ==========  =====

Each topology run starts its own NATS, kvindex, router and sim workers (processes) and
keeps them for all of its offered loads; between loads the engines' prefix caches are
reset and the workload's content is moved to ids no earlier load used
(:func:`bench.loaddriver.fresh_content`), so every point starts cold. Offered QPS/GPU
goes over ``qps_per_gpu`` with a ramp and a steady phase (simulated seconds, played
``time_scale`` times faster). Sustainable QPS/GPU is computed the same way for every
topology (:func:`cpd.sim.analysis.sustainable_qps_per_gpu`); the analytic bound
(prefill capacity ÷ prefill work per request with one shared cache) is beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from cpd.ops.config import Settings
from cpd.protocol.errors import CpdError
from cpd.sim.analysis import DEFAULT_TTFT_SLO_S, RunSummary, analytic_bound, sustainable_qps_per_gpu
from cpd.sim.costmodel import DEFAULT_PRESET, CostModel, preset
from cpd.sim.workloads import CodingAgentConfig, WorkloadRequest, coding_agent, mooncake, poisson
from tools.bench.loaddriver import (
    DEFAULT_MAX_INFLIGHT,
    Phases,
    Result,
    drive,
    fresh_content,
    report,
)
from tools.bench.registry import SettingsFactory
from tools.bench.simcluster import SimCluster as BaseSimCluster

Workload = Literal["coding-agent", "mooncake"]

# The paper's protocol: 0.4-1.6 QPS/GPU in steps of 0.2, 30 s ramp, 600 s steady; and
# an unmeasured settle phase for the ramp's cold first turns (docs/sim.md).
FULL_QPS_PER_GPU = (0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6)
FULL_PHASES = Phases(ramp_s=30.0, steady_s=600.0, settle_s=60.0)
QUICK_QPS_PER_GPU = (0.4, 0.8)
# The headline keys are also given at these TTFT p90 SLOs: the 2 s and the 3 s
# that puts the analytic 2P1D saturation at the paper's 0.75-0.8 QPS/GPU (docs/sim.md).
REPORTED_SLOS_S = (2.0, 3.0)
# Below the paper's ladder: run only for a topology that cannot sustain 0.4.
FLOOR_QPS_PER_GPU = 0.2
QUICK_PHASES = Phases(ramp_s=1.0, steady_s=4.0)
QUICK_TIME_SCALE = 3.0
# A prompt travels as packed uint32 in one NATS message (≤ 900 KiB with its block
# hashes and headers): sessions end before outgrowing this many tokens.
MAX_CONTEXT_TOKENS = 200_000
# Mooncake conversation prompts are shorter: their trace mix is re-timed at the offered
# rate, in trace order (neighbouring turns share prefixes).
MOONCAKE_BLOCK_TOKENS = 512
# Per worker: 256 MiB of 4 KiB slots is 16.7 M tokens, about the host DRAM (2 TB) of a
# 4×B200 node at 128 KiB of KV per token for the 8B preset.
ARENA_BYTES = 256 << 20
WORKLOAD_SEED = 7
# Decode streams 16 tokens per message: what the sweep measures is TTFT and throughput,
# and per-token messages on three hops were most of the decode node's and router's CPU.
STREAM_INTERVAL = 16


@dataclass(frozen=True)
class Topology:
    """A set of nodes and the routing policy that drives them."""

    name: str
    policy: Literal["cpd", "pd-kv", "pd-rr"]
    preprefill: int
    prefill: int
    decode: int

    @property
    def label(self) -> str:
        return self.name if self.policy == "cpd" else f"{self.name} {self.policy}"

    @property
    def prefill_nodes(self) -> int:
        return self.preprefill + self.prefill

    def nodes(self) -> dict[str, str]:
        """node id → role."""
        out = {f"pp{i}": "preprefill" for i in range(self.preprefill)}
        out |= {f"p{i}": "prefill" for i in range(self.prefill)}
        return out | {f"d{i}": "decode" for i in range(self.decode)}

    def gpus(self, per_node: int) -> int:
        return per_node * (self.prefill_nodes + self.decode)


TOPOLOGIES = (
    Topology("2P1D", "pd-rr", 0, 2, 1), Topology("2P1D", "pd-kv", 0, 2, 1),
    Topology("CPD-1D", "cpd", 1, 1, 1),
    Topology("2P2D", "pd-rr", 0, 2, 2), Topology("2P2D", "pd-kv", 0, 2, 2),
    Topology("CPD-2D", "cpd", 1, 1, 2),
)
QUICK_TOPOLOGIES = (TOPOLOGIES[0], TOPOLOGIES[2])
# Every topology has two prefill-side nodes; 1D ones three nodes in all, 2D ones four.
PREFILL_SIDE_NODES = 2
NODES_1D, NODES_2D = 3, 4
BY_LABEL = {t.label: t for t in TOPOLOGIES}


@dataclass(frozen=True)
class SweepConfig:
    """What one sweep runs."""

    workload: Workload = "coding-agent"
    trace: Path | None = None
    preset: str = DEFAULT_PRESET
    time_scale: float = 1.0
    qps_per_gpu: tuple[float, ...] = FULL_QPS_PER_GPU
    phases: Phases = FULL_PHASES
    topologies: tuple[Topology, ...] = TOPOLOGIES
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    progress: bool = True
    # After this many unsustainable loads in a row, a topology's higher loads are skipped
    # (None: run them all). Sustainable QPS/GPU only counts loads below the first
    # unsustainable one, so 1 changes no headline key; the plots lose the overload tail.
    stop_after_unsustainable: int | None = None
    # When a topology's lowest load is not sustainable, this lower one is run too.
    floor_qps_per_gpu: float | None = FLOOR_QPS_PER_GPU
    # Every worker's engine caps a prefill's tokens per step at this while other requests
    # are eligible (worker.long_prefill_token_threshold; 0: off), in every topology alike.
    long_prefill_token_threshold: int = 0
    # Settings for every process of the cluster, as CPD_<SECTION>__<FIELD> variables.
    extra_env: dict[str, str] = field(default_factory=dict)
    # Each point keeps its requests (``request_log``: id → :func:`request_record`), for
    # pairing them with the planner's (``cpd bench plan --fidelity``).
    keep_requests: bool = False


def config_for(settings: Settings, *, quick: bool = False, workload: Workload = "coding-agent",
               trace: str | None = None, preset_name: str | None = None,
               time_scale: float | None = None, qps: str | None = None,
               steady_s: float | None = None, ramp_s: float | None = None,
               settle_s: float | None = None, topologies: str | None = None,
               progress: bool = True, stop_after: int | None = None) -> SweepConfig:
    """The sweep of the CLI options (``None``: the quick or full protocol's value)."""
    if workload == "mooncake" and not trace:
        raise CpdError("--workload mooncake needs --trace FILE (a Mooncake JSONL trace)")
    if stop_after is not None and stop_after < 1:
        raise CpdError("--stop-after must be >= 1")
    phases = QUICK_PHASES if quick else FULL_PHASES
    phases = Phases(ramp_s=phases.ramp_s if ramp_s is None else ramp_s,
                    steady_s=phases.steady_s if steady_s is None else steady_s,
                    settle_s=phases.settle_s if settle_s is None else settle_s)
    tops = QUICK_TOPOLOGIES if quick else TOPOLOGIES
    if topologies:
        try:
            tops = tuple(BY_LABEL[x.strip()] for x in topologies.split(",") if x.strip())
        except KeyError as e:
            raise CpdError(f"unknown topology {e}; known: {sorted(BY_LABEL)}") from None
    return SweepConfig(
        workload=workload, trace=Path(trace) if trace else None,
        preset=preset_name or settings.sim.preset,
        time_scale=time_scale or (QUICK_TIME_SCALE if quick else settings.sim.time_scale),
        qps_per_gpu=(tuple(float(x) for x in qps.split(",")) if qps
                     else QUICK_QPS_PER_GPU if quick else FULL_QPS_PER_GPU),
        phases=phases, topologies=tops, ttft_slo_s=settings.sim.ttft_slo_s,
        progress=progress, stop_after_unsustainable=stop_after,
        floor_qps_per_gpu=None if quick else FLOOR_QPS_PER_GPU,
        long_prefill_token_threshold=settings.worker.long_prefill_token_threshold)


def make_workload(cfg: SweepConfig, total_qps: float, block_size: int) -> list[WorkloadRequest]:
    """The requests of one offered load (simulated seconds, ramp included)."""
    duration = cfg.phases.duration_s
    if cfg.workload == "mooncake":
        assert cfg.trace is not None
        mix = mooncake(cfg.trace, block_tokens=MOONCAKE_BLOCK_TOKENS)
        return poisson(total_qps, duration, mix, seed=WORKLOAD_SEED)
    return coding_agent(CodingAgentConfig(
        qps=total_qps, duration_s=duration, ramp_s=cfg.phases.ramp_s, seed=WORKLOAD_SEED,
        block_tokens=block_size, max_context_tokens=MAX_CONTEXT_TOKENS))


# ------------------------------------------------------------------------ the cluster


class SimCluster(BaseSimCluster):
    """NATS, kvindex, router and sim workers of one topology, as processes
    (:class:`tools.bench.simcluster.SimCluster` with the sweep's settings)."""

    def __init__(self, topology: Topology, cfg: SweepConfig, tmp: Path) -> None:
        super().__init__(topology.nodes(), tmp, label=topology.label, env={
            "CPD_SIM__PRESET": cfg.preset, "CPD_SIM__TIME_SCALE": str(cfg.time_scale),
            "CPD_ROUTER__POLICY": topology.policy,
            "CPD_DATAPLANE__ARENA_BYTES": str(ARENA_BYTES),
            "CPD_WORKER__STREAM_INTERVAL": str(STREAM_INTERVAL),
            "CPD_WORKER__LONG_PREFILL_TOKEN_THRESHOLD": str(cfg.long_prefill_token_threshold),
            **cfg.extra_env})
        self.topology = topology
        self.cfg = cfg


# ------------------------------------------------------------------------- the sweep


def floor_load(first_qps_per_gpu: float, sustained: bool, floor: float | None
               ) -> float | None:
    """The load to measure below the ladder after a topology's first point, if any: only
    when that point was the ladder's lowest (or lower) and was not sustained, so "not even
    its lowest load" becomes a measured number instead of 0 (and a ratio against it is
    defined). A sweep asked to start higher up (a point to check) does not look below."""
    if sustained or floor is None or not floor < first_qps_per_gpu <= FULL_QPS_PER_GPU[0]:
        return None
    return floor


async def run_topology(topology: Topology, cfg: SweepConfig, tmp: Path,
                       workloads: dict[float, list[WorkloadRequest]]) -> dict:
    """Every offered load on one topology; returns its points and sustainable QPS/GPU."""
    cost = preset(cfg.preset)
    gpus = topology.gpus(cost.gpus)
    cluster = SimCluster(topology, cfg, tmp / topology.label.replace(" ", "-"))
    cluster.tmp.mkdir(parents=True, exist_ok=True)
    points: list[dict] = []
    skipped: list[float] = []
    misses = 0
    try:
        await cluster.start()
        for q in cfg.qps_per_gpu:
            if cfg.stop_after_unsustainable is not None and misses >= cfg.stop_after_unsustainable:
                skipped.append(q)
                continue
            points.append(await _measure(cluster, topology, cfg, gpus, q, workloads[q],
                                         len(points)))
            misses = 0 if points[-1]["sustainable"] else misses + 1
            floor = (floor_load(q, points[-1]["sustainable"], cfg.floor_qps_per_gpu)
                     if len(points) == 1 else None)
            if floor is not None and floor in workloads:
                points.insert(0, await _measure(cluster, topology, cfg, gpus, floor,
                                                workloads[floor], len(points)))
    finally:
        await cluster.stop()
    summaries = [_summary(p) for p in points]
    # Offered = what arrived in the steady window (bench.loaddriver.report); the target
    # of the largest sustained point is reported beside it.
    best = sustainable_qps_per_gpu(summaries)
    target = max((p["target_qps_per_gpu"] for p in points
                  if p["sustainable"] and p["offered_qps_per_gpu"] <= best), default=0.0)
    return {"topology": topology.name, "policy": topology.policy, "gpus": gpus,
            "nodes": topology.nodes(), "points": points, "skipped_qps_per_gpu": skipped,
            "sustainable_qps_per_gpu": round(best, 4),
            "sustainable_target_qps_per_gpu": target}


async def _measure(cluster: SimCluster, topology: Topology, cfg: SweepConfig, gpus: int,
                   q: float, workload: list[WorkloadRequest], run: int) -> dict:
    """One offered load on a running cluster, from cold caches and unseen content."""
    assert cluster.client is not None
    await cluster.reset_caches()
    requests = fresh_content(workload, run)
    cpu0, t0 = _host_cpu_s(cluster), time.monotonic()
    results = await drive(cluster.client, requests, time_scale=cfg.time_scale,
                          progress=cfg.progress, label=f"{topology.label} @ {q:.1f} QPS/GPU")
    wall = time.monotonic() - t0
    point = report(results, target_qps=q * gpus, gpus=gpus, ttft_slo_s=cfg.ttft_slo_s,
                   phases=cfg.phases)
    # Cores this host spent on the run (all services and the driver): near the core
    # count, the host, not the modelled cluster, sets the numbers.
    point["host_cores_busy"] = round((_host_cpu_s(cluster) - cpu0) / wall, 2)
    point["cpu_s_by_process"] = cluster.cpu_seconds()
    if cfg.keep_requests:
        point["request_log"] = {r.request_id: request_record(r, cfg.time_scale) for r in results}
    if cfg.progress:
        print(f"{topology.label} @ {q:.1f} QPS/GPU: achieved "
              f"{point['achieved_qps_per_gpu']:.2f}, TTFT p50 {point['ttft_p50_s']} "
              f"p90 {point['ttft_p90_s']} s, errors {point['errors']}",
              file=sys.stderr, flush=True)
    return point


def request_record(r: Result, time_scale: float = 1.0) -> list[float | int | None]:
    """One request as a point keeps it: TTFT from its arrival (simulated s; None if it
    had no first token), the prompt tokens it computed, and the part of its TTFT the
    router did not see (simulated s: the client's trips to the router and back; None
    without the router's timings, which are wall ms)."""
    if r.first_token_s is None or r.error is not None:
        return [None, r.tokens.computed, None]
    ttft = r.first_token_s - r.arrival_s
    router_ms = (r.timings or {}).get("ttft_ms")
    outside = (None if router_ms is None
               else round(ttft - (r.client_queue_s or 0.0) - router_ms / 1e3 * time_scale, 6))
    return [round(ttft, 6), r.tokens.computed, outside]


def _host_cpu_s(cluster: SimCluster) -> float:
    """CPU seconds used so far by the cluster's processes and this one (the driver)."""
    own = os.times()
    return sum(cluster.cpu_seconds().values()) + own.user + own.system


def _summary(point: dict) -> RunSummary:
    """A point's summary back from its JSON form (null percentiles are ∞)."""
    fields = {k: point[k] for k in RunSummary.__dataclass_fields__}
    for k in ("ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "tpot_p50_s"):
        if fields[k] is None:
            fields[k] = float("inf")
    return RunSummary(**fields)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def headline(result: dict, cfg: SweepConfig) -> dict:
    """The issue's keys from the per-topology results (``None`` where a topology or a
    point did not run), at the sweep's SLO; ``by_slo`` has the sustainable QPS/GPU and
    the ratios again at each of :data:`REPORTED_SLOS_S` (a point's sustainability is
    its achieved ratio and TTFT p90, so any SLO can be read from the same run)."""
    tops = result["topologies"]
    low = min(cfg.qps_per_gpu)

    def sustained(label: str, slo: float) -> float | None:
        if label not in tops:
            return None
        return sustainable_qps_per_gpu(
            [replace(_summary(p), ttft_slo_s=slo) for p in tops[label]["points"]])

    def p50_at_low(label: str) -> float | None:
        if label not in tops:
            return None
        return next((p["ttft_p50_s"] for p in tops[label]["points"]
                     if abs(p["target_qps_per_gpu"] - low) < 1e-6), None)

    bound = result["analytic_bound_qps_per_gpu"].get("1D")

    def keys(slo: float) -> dict:
        cpd = sustained("CPD-1D", slo)
        return {
            "cpd_over_pd_rr": _ratio(cpd, sustained("2P1D pd-rr", slo)),
            "cpd_over_pd_kv": _ratio(cpd, sustained("2P1D pd-kv", slo)),
            "cpd_over_pd_rr_2d": _ratio(sustained("CPD-2D", slo), sustained("2P2D pd-rr", slo)),
            "cpd_over_pd_kv_2d": _ratio(sustained("CPD-2D", slo), sustained("2P2D pd-kv", slo)),
            "bound_fraction": _ratio(cpd, bound),
            "sustainable_qps_per_gpu": {label: sustained(label, slo) for label in tops},
        }

    main = keys(cfg.ttft_slo_s)
    del main["sustainable_qps_per_gpu"]
    return {
        **main,
        "low_load_p50_ratio": _ratio(p50_at_low("CPD-1D"), p50_at_low("2P1D pd-rr")),
        "low_load_qps_per_gpu": low,
        "by_slo": {f"{slo:g}": keys(slo)
                   for slo in sorted({cfg.ttft_slo_s, *REPORTED_SLOS_S})},
    }


def run(settings: Settings, cfg: SweepConfig, out_dir: Path | None = None,
        on_topology: Callable[[dict], None] | None = None) -> dict:
    """Run the sweep; write the markdown table (and the plots, with matplotlib) to
    ``out_dir`` when given; return the JSON result. ``on_topology`` gets the result so
    far after each topology (a sweep of the full protocol runs for hours: the CLI keeps
    a partial JSON file)."""
    t0 = time.monotonic()
    cost = preset(cfg.preset)
    block_size = settings.cache.block_size
    # Offered load is per GPU, so a 16-GPU topology gets a busier workload than a 12-GPU
    # one; topologies of one size share theirs (the same requests at the same times).
    cache: dict[float, list[WorkloadRequest]] = {}

    def workload(total_qps: float) -> list[WorkloadRequest]:
        if total_qps not in cache:
            cache[total_qps] = make_workload(cfg, total_qps, block_size)
        return cache[total_qps]

    tmp = Path(tempfile.mkdtemp(prefix="cpd-sweep-"))
    result: dict = {"config": {
        "workload": cfg.workload, "trace": str(cfg.trace) if cfg.trace else None,
        "preset": cfg.preset, "time_scale": cfg.time_scale,
        "qps_per_gpu": list(cfg.qps_per_gpu), "ramp_s": cfg.phases.ramp_s,
        "steady_s": cfg.phases.steady_s, "settle_s": cfg.phases.settle_s,
        "ttft_slo_s": cfg.ttft_slo_s,
        "max_inflight": DEFAULT_MAX_INFLIGHT, "gpus_per_node": cost.gpus,
        "stop_after_unsustainable": cfg.stop_after_unsustainable,
        "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
        "topologies": [t.label for t in cfg.topologies]}, "topologies": {}}
    try:
        for topology in cfg.topologies:
            gpus = topology.gpus(cost.gpus)
            extra = () if cfg.floor_qps_per_gpu is None else (cfg.floor_qps_per_gpu,)
            loads = {q: workload(q * gpus) for q in (*cfg.qps_per_gpu, *extra)}
            result["topologies"][topology.label] = asyncio.run(
                run_topology(topology, cfg, tmp, loads))
            if on_topology is not None:
                on_topology(result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    top = max(cfg.qps_per_gpu)
    result["analytic_bound_qps_per_gpu"] = {
        name: _bound(workload(top * gpus), cost, gpus)
        for name, gpus in (("1D", NODES_1D * cost.gpus), ("2D", NODES_2D * cost.gpus))}
    result.update(headline(result, cfg))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        table = out_dir / "sweep.md"
        table.write_text(markdown(result))
        result["table"] = str(table)
        result["plots"] = plot(result, out_dir)
    return result


def _bound(requests: list[WorkloadRequest], cost: CostModel, gpus: int) -> float:
    """Analytic bound (QPS/GPU): two prefill-side nodes with one shared cache (CPD's best
    case), on the workload at the highest offered load."""
    return round(analytic_bound(requests, cost, prefill_nodes=PREFILL_SIDE_NODES,
                                total_gpus=gpus).qps_per_gpu, 3)


# ------------------------------------------------------------------------ reporting


def markdown(result: dict) -> str:
    """The sweep as a markdown table (one row per topology and offered load)."""
    c = result["config"]
    lines = [f"Workload {c['workload']}, preset `{c['preset']}`, time scale {c['time_scale']}, "
             f"ramp {c['ramp_s']} s + settle {c.get('settle_s', 0.0)} s + steady "
             f"{c['steady_s']} s (simulated), TTFT SLO "
             f"{c['ttft_slo_s']} s on p90"
             + (f", long_prefill_token_threshold {c['long_prefill_token_threshold']}"
                if c.get("long_prefill_token_threshold") else "") + ".", "",
             "| topology | GPUs | target QPS/GPU | offered | achieved | goodput | TTFT p50 s | "
             "TTFT p90 s | prefill tok/s/GPU | decode tok/s/GPU | errors | sustainable |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, t in result["topologies"].items():
        for p in t["points"]:
            lines.append(
                f"| {label} | {t['gpus']} | {p['target_qps_per_gpu']:.2f} | "
                f"{p['offered_qps_per_gpu']:.2f} | "
                f"{p['achieved_qps_per_gpu']:.2f} | {p['goodput_qps_per_gpu']:.2f} | "
                f"{_fmt(p['ttft_p50_s'])} | {_fmt(p['ttft_p90_s'])} | "
                f"{p['prefill_tokens_per_s_per_gpu']:.0f} | "
                f"{p['decode_tokens_per_s_per_gpu']:.0f} | {p['errors']} | "
                f"{'yes' if p['sustainable'] else 'no'} |")
    lines += ["", "| topology | sustainable QPS/GPU | analytic bound QPS/GPU | loads not run "
              "(past saturation) |", "|---|---|---|---|"]
    bounds = result["analytic_bound_qps_per_gpu"]
    for label, t in result["topologies"].items():
        key = "2D" if "2D" in label else "1D"
        skipped = ", ".join(f"{q:.1f}" for q in t.get("skipped_qps_per_gpu", [])) or "none"
        lines.append(f"| {label} | {t['sustainable_qps_per_gpu']:.2f} | {bounds[key]:.2f} | "
                     f"{skipped} |")
    lines += ["", ", ".join(f"`{k}` {result[k]}" for k in (
        "cpd_over_pd_rr", "cpd_over_pd_kv", "low_load_p50_ratio", "bound_fraction")), ""]
    for slo, keys in result.get("by_slo", {}).items():
        lines += [f"At a TTFT p90 SLO of {slo} s: " + ", ".join(
            f"`{k}` {keys[k]}" for k in ("cpd_over_pd_rr", "cpd_over_pd_kv", "bound_fraction"))
            + "; sustainable QPS/GPU " + ", ".join(
            f"{label} {_fmt(v)}" for label, v in keys["sustainable_qps_per_gpu"].items()), ""]
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "∞" if v is None else f"{v:.2f}"


_PANELS = (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p90_s", "TTFT p90 (s)"),
           ("achieved_qps_per_gpu", "achieved QPS/GPU"),
           ("prefill_tokens_per_s_per_gpu", "prefill tokens/s/GPU"),
           ("decode_tokens_per_s_per_gpu", "decode tokens/s/GPU"),
           ("goodput_qps_per_gpu", "goodput QPS/GPU (TTFT ≤ SLO)"))


def plot(result: dict, out_dir: Path) -> list[str]:
    """Figure 4's layout, one PNG per decode count (1D, 2D): TTFT p50 and p90 against
    offered QPS/GPU, achieved QPS/GPU, prefill and decode throughput per GPU (and
    goodput). Empty when matplotlib is not installed (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for group in ("1D", "2D"):
        tops = {k: v for k, v in result["topologies"].items() if group in k}
        if not tops:
            continue
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for ax, (key, title) in zip(axes.flat, _PANELS, strict=True):
            for label, t in tops.items():
                xs = [p["target_qps_per_gpu"] for p in t["points"]]
                ys = [p[key] if p[key] is not None else float("nan") for p in t["points"]]
                line, = ax.plot(xs, ys, marker="o", label=label)
                if key == "achieved_qps_per_gpu":  # what actually arrived in the window
                    ax.plot(xs, [p["offered_qps_per_gpu"] for p in t["points"]], ls="--",
                            color=line.get_color(), alpha=0.6, label=f"{label} offered")
            if key.startswith("ttft"):
                ax.axhline(result["config"]["ttft_slo_s"], color="grey", ls="--", lw=0.8)
                ax.set_yscale("log")
            if key.endswith("qps_per_gpu"):
                lim = max(result["config"]["qps_per_gpu"])
                ax.plot([0, lim], [0, lim], color="grey", ls=":", lw=0.8)
            ax.set_title(title)
            ax.set_xlabel("target QPS/GPU")
            ax.grid(alpha=0.3)
        axes.flat[0].legend()
        axes.flat[2].legend(fontsize="small")
        c = result["config"]
        fig.suptitle(f"CPD vs P/D ({group}), {c['workload']}, {c['preset']}, "
                     f"time scale {c['time_scale']}")
        fig.tight_layout()
        path = out_dir / f"sweep-{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench sweep``'s flags (docs/sim.md, "``cpd bench sweep``")."""
    parser.add_argument("--quick", action="store_true",
                        help="2P1D pd-rr and CPD-1D at two loads, short phases (tests, CI)")
    parser.add_argument("--workload", choices=["coding-agent", "mooncake"],
                        default="coding-agent", help="the request mix")
    parser.add_argument("--trace", help="Mooncake JSONL trace (--workload mooncake)")
    parser.add_argument("--preset", help="sim cost preset (default: sim.preset)")
    parser.add_argument("--time-scale", type=float,
                        help="simulated seconds per wall second (default: sim.time_scale)")
    parser.add_argument("--qps", help="offered QPS/GPU, comma-separated "
                                      "(default 0.4,0.6,...,1.6)")
    parser.add_argument("--ramp-s", type=float, help="ramp phase, simulated s (30)")
    parser.add_argument("--steady-s", type=float, help="steady phase, simulated s (600)")
    parser.add_argument("--settle-s", type=float,
                        help="unmeasured phase at the target rate between ramp and steady, "
                             "simulated s (60)")
    parser.add_argument("--topologies", help="comma-separated, e.g. '2P1D pd-rr,CPD-1D'")
    parser.add_argument("--stop-after", type=int,
                        help="skip a topology's higher loads after N unsustainable ones in "
                             "a row (default: run every load)")
    parser.add_argument("--out", help="folder for the table and plots "
                                      "(default: the --json file's folder)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench sweep``'s flags. With ``--json PATH`` the result so far is
    kept in ``PATH.partial`` after each topology (a full sweep runs for hours) and
    removed once the whole result is back."""
    s = settings()
    cfg = config_for(s, quick=args.quick, workload=args.workload, trace=args.trace,
                     preset_name=args.preset, time_scale=args.time_scale, qps=args.qps,
                     steady_s=args.steady_s, ramp_s=args.ramp_s, settle_s=args.settle_s,
                     topologies=args.topologies, stop_after=args.stop_after)
    out = Path(args.out) if args.out else (Path(args.json).parent if args.json else None)
    partial = Path(f"{args.json}.partial") if args.json else None
    if partial is not None:  # before an hour of load, not after it
        partial.parent.mkdir(parents=True, exist_ok=True)
    result = run(s, cfg, out, on_topology=(
        None if partial is None else
        lambda r: partial.write_text(json.dumps(r, indent=2, default=str))))
    if partial is not None:
        partial.unlink(missing_ok=True)
    return result


__all__ = ["TOPOLOGIES", "SimCluster", "SweepConfig", "Topology", "add_arguments", "config_for",
           "headline", "make_workload", "markdown", "plot", "request_record", "run", "run_args",
           "run_topology"]
