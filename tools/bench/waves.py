"""The waves of :mod:`tools.plan.waves` on the real services (``cpd bench plan --waves
--services``).

The same traffic as the planner's runs (the steady coding-agent load with its wave, the
same seed), played open loop by the sweep's load driver against NATS, kvindex, the
router and sim workers as processes (:class:`tools.bench.sweep.SimCluster`, the sweep's
settings, at time scale 1: a run takes its five simulated minutes of wall time), and
counted by the same windows. Only the runs with CPD's elastic mechanisms on: the planner
has the fixed baselines beside them.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from cpd.ops.config import Settings
from tools.bench.loaddriver import drive
from tools.bench.sweep import SimCluster, SweepConfig
from tools.plan.waves import PHASES, RUNS, TOPOLOGY, WaveRun, plan_config, requests, windows

# The runs with the elastic mechanisms on (the moving split, decode lent).
SERVICE_RUNS = ("cold_wave", "long_output_wave")


async def _run(run: WaveRun, base: Settings, tmp: Path, progress: bool
               ) -> dict[str, dict[str, Any]]:
    cfg = plan_config(run, base)
    sweep = SweepConfig(preset=cfg.preset, time_scale=1.0, phases=PHASES,
                        topologies=(TOPOLOGY,), progress=progress,
                        long_prefill_token_threshold=base.worker.long_prefill_token_threshold,
                        extra_env=run.env())
    cluster = SimCluster(TOPOLOGY, sweep, tmp / run.label)
    cluster.tmp.mkdir(parents=True, exist_ok=True)
    try:
        await cluster.start()
        assert cluster.client is not None
        results = await drive(cluster.client, requests(run, cfg), time_scale=1.0,
                              max_inflight=cfg.max_inflight, progress=progress,
                              label=run.label)
    finally:
        await cluster.stop()
    return windows(results)


def run(settings: Settings, *, progress: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """Each of :data:`SERVICE_RUNS` on its own fresh cluster: its windows."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="cpd-waves-") as tmp:
        for r in RUNS:
            if r.label in SERVICE_RUNS:
                out[r.label] = asyncio.run(_run(r, settings, Path(tmp), progress))
    return out
