"""Waves: how CPD's elastic split follows a sudden change of traffic, in simulated time.

A steady coding-agent load (0.6 QPS/GPU on CPD-1D, the paper's preset) gets a wave of
fresh prompts for a minute (:class:`cpd.sim.workloads.Wave`), twice:

* **A cold wave**: 3 QPS of 64K-token first turns. Run with the router as configured
  (a cold prompt overflows to the prefill tier when it finishes sooner there by more
  than ``router.overflow_margin_ms``; a warm one to the pre-prefill tier the same way)
  and with the split fixed (no overflow: each tier keeps its own work).
* **A long-output wave**: 2 QPS of 4K-token prompts with 2,048-token answers, which
  fills the decode pool. Run with prefill-side nodes that decode too
  (``worker.serve_decode``, ``router.decode_lend_at``) and without.

Per window of arrivals (before, during and after the wave): warm and cold TTFT p90
(from the scheduled arrival: a request the client holds back waits), the share of cold
first turns prefilled on the prefill tier, the requests whose decode stayed on their
prefill node, and TPOT p50. Deterministic: one seed, simulated time.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import numpy as np

from cpd.ops.config import Settings
from cpd.sim.workloads import Wave, merge, wave
from tools.bench.loaddriver import Phases, Result
from tools.bench.sweep import Topology
from tools.plan.cluster import simulate
from tools.plan.search import PlanConfig, cluster_config, router_for, topology, workload

# 30 s ramp and 30 s settle, then four minutes: the wave arrives in the middle.
PHASES = Phases(ramp_s=30.0, settle_s=30.0, steady_s=240.0)
WINDOWS = {"before": (60.0, 120.0), "during": (120.0, 180.0), "after": (210.0, 300.0)}
BASE_QPS_PER_GPU = 0.6
COLD_WAVE = Wave(start_s=120.0, end_s=180.0, qps=3.0, prompt_len=65_536, output_len=128,
                 seed=9)
LONG_OUTPUT_WAVE = Wave(start_s=120.0, end_s=180.0, qps=2.0, prompt_len=4_096,
                        output_len=2_048, seed=9)
DECODE_LEND_AT = 16
# An overflow margin no plan beats: each tier keeps its own work.
_FIXED_MARGIN_MS = 1e12


@dataclass(frozen=True)
class _Run:
    label: str
    settings: Settings
    wave: Wave


def _p(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def window_stats(results: list[Result], roles: dict[str, str], start_s: float,
                 end_s: float) -> dict[str, Any]:
    """What the requests arriving in ``[start_s, end_s)`` saw."""
    rs = [r for r in results if start_s <= r.arrival_s < end_s]
    done = [r for r in rs if r.first_token_s is not None]
    warm = [r.first_token_s - r.arrival_s for r in done if r.turn > 0]  # type: ignore[operator]
    cold = [r for r in rs if r.turn == 0]
    cold_ttft = [r.first_token_s - r.arrival_s for r in done if r.turn == 0]  # type: ignore[operator]
    on_prefill = sum(roles.get(r.prefill_node) == "prefill" for r in cold)
    tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in done
            if r.finish_s is not None and r.output_tokens > 1]
    return {"requests": len(rs), "unfinished": sum(r.finish_s is None for r in rs),
            "warm_ttft_p90_s": _p(warm, 90), "cold_ttft_p90_s": _p(cold_ttft, 90),
            "cold": len(cold),
            "cold_on_prefill_share": round(on_prefill / len(cold), 3) if cold else None,
            "decode_lent": sum(bool(r.decode_node) and r.decode_node == r.prefill_node
                               for r in rs),
            "tpot_p50_ms": None if not tpot else round(float(np.median(tpot)) * 1e3, 3)}


def _settings(base: Settings, *, overflow_margin_ms: float | None = None,
              lend: bool = False) -> Settings:
    router = base.router
    if overflow_margin_ms is not None:
        router = msgspec.structs.replace(router, overflow_margin_ms=overflow_margin_ms)
    worker = base.worker
    if lend:
        router = msgspec.structs.replace(router, decode_lend_at=DECODE_LEND_AT)
        worker = msgspec.structs.replace(worker, serve_decode=True)
    return msgspec.structs.replace(base, router=router, worker=worker)


def _simulate(run: _Run, top: Topology) -> dict[str, dict[str, Any]]:
    cfg = PlanConfig(topologies=(top,), phases=PHASES, seeds=1, settings=run.settings)
    base = workload(cfg, round(BASE_QPS_PER_GPU * top.gpus(cfg.cost.gpus), 6), 0)
    reqs = merge(base, wave(run.wave, run.settings.cache.block_size))
    res = simulate(cluster_config(cfg, top), router_for(cfg, top), reqs)
    roles = top.nodes()
    return {name: window_stats(res.results, roles, a, b) for name, (a, b) in WINDOWS.items()}


def _moved(w: dict[str, dict[str, Any]]) -> bool:
    """More of the cold work on the prefill tier during the wave than before and after."""
    share = {k: w[k]["cold_on_prefill_share"] or 0.0 for k in WINDOWS}
    return share["during"] > max(share["before"], share["after"])


def run(settings: Settings | None = None) -> dict[str, Any]:
    """Both waves, each with CPD's elastic split and without; the JSON-able result."""
    base = settings or Settings()
    slo = PlanConfig(topologies=()).slo_ttft_p90_s
    top = topology("cpd", 1, 1, 1)
    runs = [_Run("cold_wave", _settings(base), COLD_WAVE),
            _Run("cold_wave_fixed_split", _settings(base, overflow_margin_ms=_FIXED_MARGIN_MS),
                 COLD_WAVE),
            _Run("long_output_wave", _settings(base, lend=True), LONG_OUTPUT_WAVE),
            _Run("long_output_wave_no_lending", _settings(base), LONG_OUTPUT_WAVE)]
    t0 = time.perf_counter()
    out: dict[str, Any] = {r.label: _simulate(r, top) for r in runs}
    cold, long_ = out["cold_wave"], out["long_output_wave"]
    within = [w["during"]["warm_ttft_p90_s"] for w in (cold, long_)]
    lent = {k: long_[k]["decode_lent"] for k in WINDOWS}
    out.update(
        topology=top.label, base_qps_per_gpu=BASE_QPS_PER_GPU, windows=WINDOWS,
        waves={"cold": asdict(COLD_WAVE), "long_output": asdict(LONG_OUTPUT_WAVE)},
        decode_lend_at=DECODE_LEND_AT, slo_ttft_p90_s=slo,
        met={"warm_within_slo": all(x is not None and x <= slo for x in within),
             "split_moves_and_back": _moved(cold),
             "lending_follows_the_wave": lent["during"] > 0 and lent["after"] == 0
             and lent["before"] == 0},
        wall_s=round(time.perf_counter() - t0, 2))
    out["met_all"] = all(out["met"].values())
    return out
