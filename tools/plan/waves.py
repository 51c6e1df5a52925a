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
from cpd.sim.workloads import Wave, WorkloadRequest, merge, wave
from tools.bench.loaddriver import Phases, Result
from tools.cluster import override_env
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
class WaveRun:
    """One run: a wave on the steady load, with CPD's elastic mechanisms as configured,
    the split held fixed, or decode lent."""

    label: str
    wave: Wave
    fixed_split: bool = False
    lend: bool = False

    def overrides(self) -> dict[tuple[str, str], object]:
        """The run's settings: (section, field) → value."""
        out: dict[tuple[str, str], object] = {}
        if self.fixed_split:
            out[("router", "overflow_margin_ms")] = _FIXED_MARGIN_MS
        if self.lend:
            out |= {("worker", "serve_decode"): True,
                    ("router", "decode_lend_at"): DECODE_LEND_AT}
        return out

    def env(self) -> dict[str, str]:
        """The run's settings as ``CPD_<SECTION>__<FIELD>`` variables (a services run's)."""
        return override_env(f"{sec}.{name}={str(v).lower() if isinstance(v, bool) else v}"
                            for (sec, name), v in self.overrides().items())

    def settings(self, base: Settings) -> Settings:
        """``base`` with the run's settings (the planner's)."""
        sections: dict[str, dict[str, object]] = {}
        for (sec, name), v in self.overrides().items():
            sections.setdefault(sec, {})[name] = v
        return msgspec.structs.replace(base, **{
            sec: msgspec.structs.replace(getattr(base, sec), **fields)
            for sec, fields in sections.items()})


RUNS = (WaveRun("cold_wave", COLD_WAVE),
        WaveRun("cold_wave_fixed_split", COLD_WAVE, fixed_split=True),
        WaveRun("long_output_wave", LONG_OUTPUT_WAVE, lend=True),
        WaveRun("long_output_wave_no_lending", LONG_OUTPUT_WAVE))
TOPOLOGY = topology("cpd", 1, 1, 1)


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


def requests(run: WaveRun, cfg: PlanConfig) -> list[WorkloadRequest]:
    """The run's traffic: the steady load on :data:`TOPOLOGY` with its wave."""
    base = workload(cfg, round(BASE_QPS_PER_GPU * TOPOLOGY.gpus(cfg.cost.gpus), 6), 0)
    return merge(base, wave(run.wave, cfg.settings.cache.block_size))


def plan_config(run: WaveRun, base: Settings) -> PlanConfig:
    """The planner's configuration of ``run``."""
    return PlanConfig(topologies=(TOPOLOGY,), phases=PHASES, seeds=1,
                      settings=run.settings(base))


def windows(results: list[Result]) -> dict[str, dict[str, Any]]:
    """:func:`window_stats` of every window of :data:`WINDOWS`."""
    roles = TOPOLOGY.nodes()
    return {name: window_stats(results, roles, a, b) for name, (a, b) in WINDOWS.items()}


def _simulate(run: WaveRun, base: Settings) -> dict[str, dict[str, Any]]:
    cfg = plan_config(run, base)
    res = simulate(cluster_config(cfg, TOPOLOGY), router_for(cfg, TOPOLOGY),
                   requests(run, cfg))
    return windows(res.results)


def met(out: dict[str, Any], slo_s: float) -> dict[str, bool]:
    """Whether warm requests stayed within the SLO during both waves, the cold split
    moved and came back, and decode was lent during the long-output wave alone."""
    cold, long_ = out["cold_wave"], out["long_output_wave"]
    within = [w["during"]["warm_ttft_p90_s"] for w in (cold, long_)]
    lent = {k: long_[k]["decode_lent"] for k in WINDOWS}
    return {"warm_within_slo": all(x is not None and x <= slo_s for x in within),
            "split_moves_and_back": _moved(cold),
            "lending_follows_the_wave": lent["during"] > 0 and lent["after"] == 0
            and lent["before"] == 0}


def _moved(w: dict[str, dict[str, Any]]) -> bool:
    """More of the cold work on the prefill tier during the wave than before and after."""
    share = {k: w[k]["cold_on_prefill_share"] or 0.0 for k in WINDOWS}
    return share["during"] > max(share["before"], share["after"])


def run(settings: Settings | None = None) -> dict[str, Any]:
    """Both waves, each with CPD's elastic mechanism and without; the JSON-able result."""
    base = settings or Settings()
    slo = PlanConfig(topologies=()).slo_ttft_p90_s
    t0 = time.perf_counter()
    out: dict[str, Any] = {r.label: _simulate(r, base) for r in RUNS}
    out.update(
        topology=TOPOLOGY.label, base_qps_per_gpu=BASE_QPS_PER_GPU, windows=WINDOWS,
        waves={"cold": asdict(COLD_WAVE), "long_output": asdict(LONG_OUTPUT_WAVE)},
        decode_lend_at=DECODE_LEND_AT, slo_ttft_p90_s=slo, met=met(out, slo),
        wall_s=round(time.perf_counter() - t0, 2))
    out["met_all"] = all(out["met"].values())
    return out
