"""``cpd bench plan --fidelity``: the planner against the real services on the same
workload (docs/benchmarks/plan.md, "Fidelity").

One ``cpd bench sweep`` (NATS, kvindex, router and workers as processes, sim engines,
real UCX) and one ``cpd plan`` on one seed, with the same topologies, workload, preset,
loads, phases, SLO, client in-flight cap and worker settings; then
:func:`tools.plan.fidelity.compare`. The sweep takes about 40 minutes on a 2-core host,
so ``--sweep-json`` compares against sweeps already run (``cpd bench sweep --json``;
several of one configuration are merged), planning with that configuration.

The plan's network is the data plane the sweep had: sim engines move a scaled-down
copy of each block's bytes (``sim.kv_scale_down``) over this host's UCX, so a pull
takes what the host's data plane takes, not what the preset's KV bytes would take on
the planner's default network. The plan runs at the rate the sweep's pulls achieved
(:func:`data_plane_gbps`: tokens pulled × the preset's KV bytes per token ÷ their load
time), as it runs with the services' measured latency constants.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import msgspec

from cpd.ops.config import Settings
from cpd.protocol.errors import CpdError
from cpd.sim.costmodel import PRESETS
from tools.bench import sweep
from tools.bench.hostinfo import load_average, machine_info
from tools.bench.loaddriver import Phases
from tools.plan import fidelity, planner, search
from tools.plan.search import PlanConfig

# The recorded sweep's protocol (docs/benchmarks/sweep.md, "1D, coding agent") with a
# 60 s steady phase (200 there): 40 minutes of real services, not an hour and a half.
PRESET = "b200-tp4-llama-3.1-8b-fp8"
LADDER = (0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6)
PHASES = Phases(ramp_s=30.0, settle_s=60.0, steady_s=60.0)
LONG_PREFILL_TOKEN_THRESHOLD = 2048
STOP_AFTER = 1
TIME_SCALE = 1.0
# --quick (the tests'): CPD-1D at a load below saturation, short phases.
QUICK_TOPOLOGIES = ("CPD-1D",)
QUICK_LADDER = (0.4,)
QUICK_PHASES = Phases(ramp_s=10.0, settle_s=10.0, steady_s=20.0)


def sweep_config(settings: Settings, *, quick: bool) -> sweep.SweepConfig:
    """The sweep the benchmark runs (the recorded protocol, or its quick version)."""
    labels = QUICK_TOPOLOGIES if quick else fidelity.TOPOLOGIES
    return sweep.SweepConfig(
        preset=PRESET, time_scale=TIME_SCALE,
        qps_per_gpu=QUICK_LADDER if quick else LADDER,
        phases=QUICK_PHASES if quick else PHASES,
        topologies=tuple(sweep.BY_LABEL[x] for x in labels),
        ttft_slo_s=settings.sim.ttft_slo_s, progress=False,
        stop_after_unsustainable=STOP_AFTER, floor_qps_per_gpu=None,
        long_prefill_token_threshold=LONG_PREFILL_TOKEN_THRESHOLD, keep_requests=True)


def data_plane_gbps(sweep_result: dict) -> float | None:
    """The network the sweep's pulls saw, in the preset's bytes (GB/s, as
    ``--network-gbps``): every point's ``remote_load`` summed; ``None`` when it pulled
    nothing or was recorded without them."""
    tokens, wall_s = 0, 0.0
    for top in sweep_result.get("topologies", {}).values():
        for point in top.get("points", ()):
            load = point.get("remote_load") or {}
            tokens += int(load.get("tokens", 0))
            wall_s += float(load.get("wall_s", 0.0))
    c = sweep_result.get("config", {})
    if tokens <= 0 or wall_s <= 0 or c.get("preset") not in PRESETS:
        return None
    simulated_s = wall_s * float(c.get("time_scale") or 1.0)
    return round(tokens * PRESETS[c["preset"]].kv_bytes_per_token / simulated_s / 1e9, 2)


def merged(results: list[dict]) -> dict:
    """Sweeps of one configuration run apart (e.g. the pd topologies and CPD-1D) as one
    result: their topologies together. A typed error if their configurations differ
    other than in the topologies."""
    if not results:
        raise CpdError("no sweep result to compare with")
    first = results[0]
    out = {**first, "config": dict(first.get("config", {})),
           "topologies": dict(first.get("topologies", {}))}
    for r in results[1:]:
        c = r.get("config", {})
        if _but_topologies(c) != _but_topologies(out["config"]):
            raise CpdError("the sweep results have different configurations")
        out["topologies"].update(r.get("topologies", {}))
        out["wall_s"] = (out.get("wall_s") or 0) + (r.get("wall_s") or 0)
        out["config"]["topologies"] = [*out["config"].get("topologies", []),
                                       *c.get("topologies", [])]
    return out


def _but_topologies(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "topologies"}


def plan_config(settings: Settings, sweep_result: dict, jobs: int) -> PlanConfig:
    """The plan of one seed with the sweep's own configuration (its JSON ``config``) and
    its data plane's rate (:func:`data_plane_gbps`, else the planner's default)."""
    c = sweep_result["config"]
    try:
        tops = tuple(sweep.BY_LABEL[x] for x in c["topologies"]
                     if x in sweep_result["topologies"])
        worker = msgspec.structs.replace(
            settings.worker,
            long_prefill_token_threshold=int(c.get("long_prefill_token_threshold") or 0))
        return PlanConfig(
            topologies=tops, workload=c["workload"],
            trace=Path(c["trace"]) if c.get("trace") else None,
            trace_block_size=sweep.MOONCAKE_BLOCK_TOKENS, preset=c["preset"],
            slo_ttft_p90_s=float(c["ttft_slo_s"]), seeds=1,
            phases=Phases(ramp_s=float(c["ramp_s"]), settle_s=float(c["settle_s"]),
                          steady_s=float(c["steady_s"])),
            ladder=tuple(float(q) for q in c["qps_per_gpu"]),
            stop_after=c.get("stop_after_unsustainable"),
            max_inflight=int(c["max_inflight"]), jobs=jobs,
            network_gbps=data_plane_gbps(sweep_result) or PlanConfig.network_gbps,
            settings=msgspec.structs.replace(settings, worker=worker))
    except (KeyError, TypeError, ValueError) as e:
        raise CpdError(f"not a cpd bench sweep result: {e!r}") from None


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CpdError(f"cannot read the sweep result {path}: {e}") from None


def services_latency(cfg: PlanConfig, real: dict) -> dict[str, dict]:
    """Per topology whose sweep kept its requests: at its lowest such load, the same
    requests planned with no delay around the engines against the services'
    (:func:`tools.plan.fidelity.services_latency`), and that load."""
    zero = dataclasses.replace(cfg, dispatch_s=0.0, relay_s=0.0, handoff_s=0.0)
    out: dict[str, dict] = {}
    for top in cfg.topologies:
        kept = [p for p in real["topologies"][top.label]["points"]
                if isinstance(p.get("request_log"), dict)]
        if not kept:
            continue
        low = min(kept, key=lambda p: p["target_qps_per_gpu"])
        q = float(low["target_qps_per_gpu"])
        _, res = search.run_probe(zero, top, q, seed=0)
        plan = {r.request_id: tuple(sweep.request_record(r)[:2]) for r in res.results}
        out[top.label] = {"qps_per_gpu": q,
                          **(fidelity.services_latency(low["request_log"], plan) or {})}
    return out


def run(settings: Settings, *, quick: bool = False, sweep_json: list[str] | None = None,
        jobs: int = 0) -> dict:
    """Run (or read and merge) the sweep, plan the same, compare; the JSON-able result."""
    load_before = load_average()
    t0 = time.perf_counter()
    if sweep_json:
        real = merged([_read(p) for p in sweep_json])
    else:
        real = sweep.run(settings, sweep_config(settings, quick=quick))
    sweep_s = time.perf_counter() - t0
    cfg = plan_config(settings, real, jobs)
    t1 = time.perf_counter()
    plan = planner.run(cfg)
    plan_s = time.perf_counter() - t1
    out = fidelity.compare(real, plan, labels=[t.label for t in cfg.topologies])
    return {
        **out,
        "services_latency": services_latency(cfg, real),
        "quick": quick,
        "sweep_json": sweep_json,
        "config": real["config"],
        "sweep_wall_s": round(sweep_s, 1) if not sweep_json else real.get("wall_s"),
        "plan_wall_s": round(plan_s, 2),
        "plan": {"dispatch_s": cfg.dispatch_s, "relay_s": cfg.relay_s,
                 "handoff_s": cfg.handoff_s, "network_gbps": cfg.network_gbps,
                 "network_from_sweep": data_plane_gbps(real) is not None},
        "host": machine_info() | {"load_average_before": load_before,
                                  "load_average_after": load_average()},
    }


__all__ = ["data_plane_gbps", "merged", "plan_config", "run", "services_latency",
           "sweep_config"]
