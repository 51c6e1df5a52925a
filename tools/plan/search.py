"""What ``cpd plan`` evaluates: topologies within a GPU budget, each at offered loads
found by bisection (or a given ladder), over several workload seeds (docs/plan.md).

A **probe** is one simulated run (:mod:`tools.plan.cluster`) of one topology at one
target QPS/GPU on one seed's workload, summarised by the load driver's own
:func:`tools.bench.loaddriver.report`, so a point here and a point of
``cpd bench sweep`` are the same figures by the same code. A topology's
**sustainable QPS/GPU** on a seed is the largest target whose probe is sustainable
(achieved ≥ 95 % of offered, TTFT p90 within the SLO, TPOT p50 within its SLO when
one is set), with every lower probe sustainable too: found by stepping up a coarse
ladder to the first failure and bisecting between it and the last success, to
``resolution``. Probes of different (topology, seed) pairs run in parallel processes.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from cpd.engines.profile import SimProfile
from cpd.ops.config import Settings
from cpd.ops.cpuset import usable_cpus
from cpd.protocol.roles import Role
from cpd.sim.costmodel import CostModel, preset
from cpd.sim.scheduler import SchedulerConfig
from cpd.sim.workloads import (
    CodingAgentConfig,
    WorkloadRequest,
    coding_agent,
    mooncake,
    poisson,
)
from services.router.configured import make_policy
from services.router.cost import PrefillCost
from services.router.policy import Router
from tools.bench.loaddriver import Phases, report
from tools.bench.sweep import MAX_CONTEXT_TOKENS, WORKLOAD_SEED, Topology
from tools.plan.cluster import (
    DISPATCH_S,
    HANDOFF_S,
    RELAY_S,
    ClusterConfig,
    NodeSpec,
    SimResult,
    simulate,
)

Workload = Literal["coding-agent", "mooncake", "poisson"]

# The paper's phases (the sweep's full protocol); shorter ones for bisection probes.
PAPER_PHASES = Phases(ramp_s=30.0, steady_s=600.0, settle_s=60.0)
DEFAULT_PHASES = Phases(ramp_s=30.0, steady_s=300.0, settle_s=60.0)
QUICK_PHASES = Phases(ramp_s=10.0, steady_s=90.0, settle_s=10.0)
# Bisection: the coarse ladder's step, its top, and the finest step it refines to.
LADDER_STEP = 0.2
LADDER_TOP = 4.0
DEFAULT_RESOLUTION = 0.02
# Student's t at 97.5 % for 1..30 degrees of freedom (95 % two-sided intervals).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
POLICIES = ("pd-rr", "pd-kv", "cpd")


@dataclass(frozen=True)
class PlanConfig:
    """Everything one plan evaluates."""

    topologies: tuple[Topology, ...]
    workload: Workload = "coding-agent"
    trace: Path | None = None
    trace_block_size: int = 512
    preset: str = "b200-tp4-llama-3.1-8b-fp8"
    decode_preset: str = ""
    slo_ttft_p90_s: float = 2.0
    slo_tpot_s: float | None = None
    seeds: int = 5
    phases: Phases = DEFAULT_PHASES
    # A fixed ladder of target QPS/GPU instead of bisection (the paper's protocol).
    ladder: tuple[float, ...] | None = None
    resolution: float = DEFAULT_RESOLUTION
    # Stop a ladder after this many unsustainable loads in a row (None: run them all).
    stop_after: int | None = 1
    network_gbps: float = 50.0
    dram_bytes: int = 2 << 40
    disk_bytes: int = 0    # each worker's disk tier (0: none)
    max_inflight: int = 24
    dispatch_s: float = DISPATCH_S
    relay_s: float = RELAY_S
    handoff_s: float = HANDOFF_S
    # Poisson workload without a trace: fresh prompts of this shape.
    prompt_tokens: int = 8_192
    output_tokens: int = 128
    jobs: int = 0          # worker processes (0: the usable CPUs)
    settings: Settings = field(default_factory=Settings)

    @property
    def cost(self) -> CostModel:
        return preset(self.preset)

    @property
    def decode_cost(self) -> CostModel:
        return preset(self.decode_preset or self.preset)


# ------------------------------------------------------------------ topologies


def topology(policy: str, preprefill: int, prefill: int, decode: int) -> Topology:
    """A topology named as the sweep names its own (2P1D, CPD-1D), else by its counts."""
    if policy == "cpd":
        name = (f"CPD-{decode}D" if preprefill == 1 and prefill == 1
                else f"CPD-{preprefill}:{prefill}:{decode}")
        return Topology(name, "cpd", preprefill, prefill, decode)  # type: ignore[arg-type]
    return Topology(f"{prefill}P{decode}D", policy, 0, prefill, decode)  # type: ignore[arg-type]


def within_budget(gpus: int, gpus_per_node: int,
                  policies: Sequence[str] = POLICIES) -> tuple[Topology, ...]:
    """Every split of ``gpus // gpus_per_node`` nodes into the pools of each policy:
    P + D for the P/D baselines, pre-prefill + prefill + D for CPD (each pool ≥ 1)."""
    n = gpus // gpus_per_node
    if n < 2:
        raise ValueError(f"{gpus} GPUs make {n} node(s) of {gpus_per_node}: need at least 2")
    out = []
    for policy in policies:
        if policy == "cpd":
            out += [topology("cpd", pp, p, n - pp - p)
                    for pp in range(1, n - 1) for p in range(1, n - pp)]
        else:
            out += [topology(policy, 0, p, n - p) for p in range(1, n)]
    return tuple(out)


# -------------------------------------------------------------------- workloads


@functools.lru_cache(maxsize=4)
def _trace(path: str, block_tokens: int) -> tuple[WorkloadRequest, ...]:
    return tuple(mooncake(path, block_tokens=block_tokens))


def workload(cfg: PlanConfig, total_qps: float, seed: int) -> tuple[WorkloadRequest, ...]:
    """The requests of one probe: ``total_qps`` over the phases, from ``seed``."""
    if cfg.workload == "mooncake" and cfg.trace is None:
        raise ValueError("the mooncake workload needs a trace")
    return _workload(cfg.workload, str(cfg.trace) if cfg.trace else "", cfg.trace_block_size,
                     cfg.phases, cfg.settings.cache.block_size, cfg.prompt_tokens,
                     cfg.output_tokens, total_qps, WORKLOAD_SEED + seed)


@functools.lru_cache(maxsize=8)
def _workload(kind: str, trace: str, trace_block_size: int, phases: Phases, block_size: int,
              prompt_tokens: int, output_tokens: int, total_qps: float,
              seed: int) -> tuple[WorkloadRequest, ...]:
    duration = phases.duration_s
    if kind == "coding-agent":
        return tuple(coding_agent(CodingAgentConfig(
            qps=total_qps, duration_s=duration, ramp_s=phases.ramp_s, seed=seed,
            block_tokens=block_size, max_context_tokens=MAX_CONTEXT_TOKENS)))
    if trace:
        return tuple(poisson(total_qps, duration, _trace(trace, trace_block_size), seed=seed))
    return tuple(poisson(total_qps, duration, seed=seed, prompt_len=prompt_tokens,
                         output_len=output_tokens, block_tokens=block_size))


# ----------------------------------------------------------------------- probes


def planner_settings(cfg: PlanConfig, top: Topology) -> Settings:
    """The settings of a deployment of ``top`` that the plan models: the plan's own with
    the topology's policy, the sim engine at real time on the plan's presets, arena
    slots of the modelled KV bytes (no scale-down), and the router's bandwidth seeds at
    the modelled network and host link (what its workers would measure)."""
    s = cfg.settings
    return msgspec.structs.replace(
        s,
        router=msgspec.structs.replace(
            s.router, policy=top.policy, default_bandwidth_gbps=cfg.network_gbps,
            host_bandwidth_gbps=cfg.cost.host_link_bytes_s / 1e9),
        sim=msgspec.structs.replace(s.sim, preset=cfg.preset,
                                    decode_preset=cfg.decode_preset, time_scale=1.0,
                                    kv_scale_down=1),
        dataplane=msgspec.structs.replace(s.dataplane, block_bytes=0),
        worker=msgspec.structs.replace(s.worker, engine="sim"))


def router_for(cfg: PlanConfig, top: Topology) -> Router:
    """The router a router service of :func:`planner_settings` would run."""
    settings = planner_settings(cfg, top)
    return make_policy(settings, SimProfile(settings))


def cluster_config(cfg: PlanConfig, top: Topology) -> ClusterConfig:
    """The simulated cluster of ``top`` under the plan's settings."""
    s = cfg.settings
    cost, dcost = cfg.cost, cfg.decode_cost
    nodes = tuple(NodeSpec(name, role, dcost if role == Role.DECODE else cost)
                  for name, role in top.nodes().items())
    sched = SchedulerConfig(max_num_batched_tokens=s.sim.max_num_batched_tokens,
                            max_num_seqs=s.sim.max_num_seqs, block_size=s.cache.block_size,
                            long_prefill_token_threshold=s.worker.long_prefill_token_threshold)
    return ClusterConfig(
        nodes=nodes, scheduler=sched, async_kv_load=s.worker.async_kv_load,
        block_size=s.cache.block_size, gpu_cache_blocks=s.sim.gpu_cache_blocks or None,
        dram_bytes=cfg.dram_bytes, eviction=s.dataplane.eviction,
        decode_copies_first=s.dataplane.decode_copies_first,
        disk_bytes=cfg.disk_bytes, disk_gbps=s.router.disk_bandwidth_gbps,
        # The elastic boundary is CPD's: the P/D baselines stand for today's systems.
        prefill_decodes=s.worker.serve_decode and top.policy == "cpd",
        network_gbps=cfg.network_gbps, report_interval_s=s.worker.load_report_interval_s,
        max_inflight=cfg.max_inflight, dispatch_s=cfg.dispatch_s, relay_s=cfg.relay_s,
        handoff_s=cfg.handoff_s)


def prefill_cost(cfg: PlanConfig) -> PrefillCost:
    """The router's prefill cost: the preset's coefficients (simulated ms)."""
    return PrefillCost(*cfg.cost.prefill_coefficients_ms())


def run_probe(cfg: PlanConfig, top: Topology, qps_per_gpu: float, seed: int,
              *, record_decisions: int = 0) -> tuple[dict, SimResult]:
    """One simulated run; its report (the sweep's point fields) and the raw result."""
    gpus = top.gpus(cfg.cost.gpus)
    reqs = workload(cfg, round(qps_per_gpu * gpus, 6), seed)
    res = simulate(cluster_config(cfg, top), router_for(cfg, top), reqs,
                   record_decisions=record_decisions)
    point = report(res.results, target_qps=qps_per_gpu * gpus, gpus=gpus,
                   ttft_slo_s=cfg.slo_ttft_p90_s, phases=cfg.phases)
    if cfg.slo_tpot_s is not None and point["sustainable"]:
        tpot = point.get("tpot_p50_s")
        point["sustainable"] = tpot is not None and tpot <= cfg.slo_tpot_s
    point["events"] = res.events
    point["simulated_requests"] = len(reqs)
    return point, res


def _slim(point: dict) -> dict:
    """A probe's point without the per-path breakdown (kept only for the best load)."""
    return {k: v for k, v in point.items() if k != "by_path"}


def sustainable_search(cfg: PlanConfig, top: Topology, seed: int) -> dict:
    """One topology on one seed: its probes and sustainable QPS/GPU (module doc)."""
    points: list[dict] = []

    def probe(q: float) -> bool:
        point, _ = run_probe(cfg, top, q, seed)
        points.append(point)
        return bool(point["sustainable"])

    best = 0.0
    if cfg.ladder is not None:
        # As the sweep counts: only loads below the first unsustainable one.
        failed = False
        misses = 0
        for q in cfg.ladder:
            if cfg.stop_after is not None and misses >= cfg.stop_after:
                break
            ok = probe(q)
            if ok and not failed:
                best = q
            failed |= not ok
            misses = 0 if ok else misses + 1
    else:
        lo, hi = 0.0, None
        q = LADDER_STEP
        while q <= LADDER_TOP + 1e-9:
            if not probe(q):
                hi = q
                break
            lo, q = q, round(q + LADDER_STEP, 6)
        if hi is not None:
            while hi - lo > cfg.resolution + 1e-9:
                mid = round((lo + hi) / 2, 6)
                lo, hi = (mid, hi) if probe(mid) else (lo, mid)
        best = lo
    points.sort(key=lambda p: p["target_qps_per_gpu"])
    at_best = next((p for p in points if abs(p["target_qps_per_gpu"] - best) < 1e-6), None)
    # As the sweep reports it: what arrived at the largest sustained target.
    return {"seed": seed, "sustainable_target_qps_per_gpu": best,
            "sustainable_qps_per_gpu": at_best["offered_qps_per_gpu"] if at_best else 0.0,
            "at_sustainable": at_best, "points": [_slim(p) for p in points],
            "simulated_requests": sum(p["simulated_requests"] for p in points)}


def _task(args: tuple[PlanConfig, Topology, int]) -> tuple[str, int, dict, float]:
    cfg, top, seed = args
    t0 = os.times()
    out = sustainable_search(cfg, top, seed)
    t1 = os.times()
    return top.label, seed, out, (t1.user - t0.user) + (t1.system - t0.system)


def evaluate(cfg: PlanConfig,
             progress: Callable[[str, int, dict], None] | None = None
             ) -> tuple[dict[str, list[dict]], float]:
    """Every topology on every seed: per label the per-seed searches (seed order), and
    the CPU seconds they took."""
    tasks = [(cfg, top, seed) for top in cfg.topologies for seed in range(cfg.seeds)]
    jobs = cfg.jobs or len(usable_cpus())
    out: dict[str, list[dict]] = {t.label: [] for t in cfg.topologies}
    cpu = 0.0
    results: Iterable[tuple[str, int, dict, float]]
    if jobs <= 1 or len(tasks) == 1:
        results = map(_task, tasks)
        for label, seed, r, c in results:
            out[label].append(r)
            cpu += c
            if progress:
                progress(label, seed, r)
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            for label, seed, r, c in pool.map(_task, tasks):
                out[label].append(r)
                cpu += c
                if progress:
                    progress(label, seed, r)
    for runs in out.values():
        runs.sort(key=lambda r: r["seed"])
    return out, cpu


# ------------------------------------------------------------------ statistics


def interval(values: Sequence[float]) -> dict:
    """Mean and 95 % confidence interval (Student's t) of per-seed values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    mean = float(np.mean(xs))
    if len(xs) < 2:
        return {"mean": round(mean, 4), "ci95": None, "n": 1}
    half = (_T975[min(len(xs) - 1, len(_T975)) - 1] * float(np.std(xs, ddof=1))
            / math.sqrt(len(xs)))
    # Loads and their ratios are never negative.
    return {"mean": round(mean, 4),
            "ci95": [round(max(mean - half, 0.0), 4), round(mean + half, 4)], "n": len(xs)}


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-seed ratios (paired: the same seed's workload on both sides) and their
    interval; a seed where the denominator sustained nothing is left out."""
    return interval([a / b for a, b in zip(num, den, strict=True) if b])
