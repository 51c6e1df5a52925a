"""``cpd bench soak``: the fault harness's cluster under steady load for a long time,
with a fault every few rounds, watching what must stay bounded.

The load is the fault harness's (closed-loop clients over the router's two replicas,
real services on simulated engines), in rounds of ``round_s`` seconds; every
``fault_every``-th round injects the next fault of ``faults`` (a ``kill -9`` the
supervisor restarts from, a NATS restart), the others run quiet. Every round is checked
as a fault scenario is (lost requests, wrong tokens, unsealed or invisible reads, the
live index against a rebuild from the stream), and after each round every process is
sampled: resident memory and open files per node, the arena bytes each worker holds
(its load report), and the blocks and locations kvindex holds.

Growth per hour is a least-squares slope over the run's second half (after the caches
filled), per node over its current incarnation only (a restarted node starts afresh).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench.faults import FaultConfig, Rig, check_scenarios, fault_rig, run_in_tmp
from tools.bench.registry import SettingsFactory

DEFAULT_FAULTS = ("kill-prefill", "kill-decode", "kill-kvindex", "kill-router",
                  "kill-preprefill", "nats-restart")
"""The faults a soak cycles through, one every ``fault_every`` rounds."""



@dataclass(frozen=True)
class SoakConfig:
    """What one soak run does."""

    minutes: float = 30.0
    concurrency: int = 100          # requests kept in flight: half the harness's load
    round_s: float = 20.0           # load per round (wall seconds)
    fault_every: int = 4            # every 4th round injects a fault (~80 s apart)
    faults: tuple[str, ...] = DEFAULT_FAULTS
    progress: bool = True

    def fault_config(self) -> FaultConfig:
        """The harness's configuration of one round."""
        return FaultConfig(scenarios=(), concurrency=self.concurrency,
                           duration_s=self.round_s, inject_at_s=min(6.0, self.round_s / 3),
                           fault_s=min(5.0, self.round_s / 4), fuzz=False,
                           progress=self.progress)

    def round_name(self, i: int) -> str:
        """Round ``i``'s scenario: the next fault every ``fault_every`` rounds."""
        if (i + 1) % self.fault_every:
            return "baseline"
        return self.faults[((i + 1) // self.fault_every - 1) % len(self.faults)]


def proc_sample(pid: int) -> dict[str, float] | None:
    """Process ``pid``'s resident MiB (``rss_mib``), of which private anonymous memory
    (``anon_mib``: its heap, where a leak grows) and shared memory (``shmem_mib``: the
    arena, counted once per mapping of it, so a process that maps its arena twice
    counts the pages it touched through each), and its open files; ``None`` if it is
    gone."""
    try:
        with open(f"/proc/{pid}/status") as f:  # one read: the three agree
            kib = {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in f)
                   if k in ("VmRSS", "RssAnon", "RssShmem")}
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None
    return {"rss_mib": round(kib.get("VmRSS", 0) / 1024, 1),
            "anon_mib": round(kib.get("RssAnon", 0) / 1024, 1),
            "shmem_mib": round(kib.get("RssShmem", 0) / 1024, 1), "open_files": fds}


async def sample(rig: Rig, t_s: float, kvindex: dict) -> list[dict]:
    """One sample per process of the cluster (and NATS) at ``t_s`` seconds into the
    run: memory and files, the node's arena bytes, kvindex's blocks and locations."""
    cluster = rig.cluster
    assert cluster.client is not None
    arena = {}
    try:
        status = await cluster.client.status()
        arena = {n.node: n.dram_used_bytes for n in status.nodes}
    except Exception:  # a router being restarted: the sample goes without arena bytes
        pass
    pids = {node: p.popen.pid for node, p in cluster.procs.items() if p.popen is not None}
    if cluster.nats is not None and cluster.nats.proc is not None:
        pids["nats"] = cluster.nats.proc.pid
    out = []
    for node, pid in sorted(pids.items()):
        got = proc_sample(pid)
        if got is None:
            continue
        row: dict[str, Any] = {"t_s": round(t_s, 1), "node": node, "pid": pid, **got}
        if node in arena:
            row["arena_bytes"] = arena[node]
        if node == "kvi":
            row["kvindex_blocks"] = kvindex.get("blocks", 0)
            row["kvindex_locations"] = kvindex.get("locations", 0)
        out.append(row)
    return out


def per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, value)`` points, per hour; ``None`` with
    fewer than three points or no spread in time."""
    if len(points) < 3:
        return None
    t = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if np.ptp(t) <= 0:
        return None
    slope = np.polyfit(t, y, 1)[0]
    return round(float(slope) * 3600, 2)


_GROWING = ("rss_mib", "anon_mib", "shmem_mib", "open_files", "arena_bytes",
            "kvindex_blocks", "kvindex_locations")


def growth(samples: list[dict], since_s: float) -> dict[str, dict[str, float | None]]:
    """Per node, each sampled quantity's growth per hour over the samples after
    ``since_s`` of its last incarnation (its last pid)."""
    out: dict[str, dict[str, float | None]] = {}
    for node in sorted({s["node"] for s in samples}):
        mine = [s for s in samples if s["node"] == node]
        last = [s for s in mine if s["pid"] == mine[-1]["pid"] and s["t_s"] >= since_s]
        out[node] = {k: per_hour([(s["t_s"], s[k]) for s in last if k in s])
                     for k in _GROWING if any(k in s for s in last)}
    return out


async def run_async(cfg: SoakConfig, tmp: Path) -> dict:
    """Run the soak in ``tmp``; the JSON result."""
    check_scenarios(cfg.faults)
    fcfg = cfg.fault_config()
    rounds: list[dict] = []
    samples: list[dict] = []
    t0 = time.monotonic()
    async with fault_rig(fcfg, tmp) as rig:
        i = 0
        while time.monotonic() - t0 < cfg.minutes * 60:
            row = await rig.scenario(cfg.round_name(i), i, fcfg)
            t = time.monotonic() - t0
            rounds.append({"round": i, "t_s": round(t, 1), **{k: row[k] for k in (
                "scenario", "sent", "completed_ok_ratio", "lost", "wrong_tokens",
                "unsealed_served", "invisible_reads", "kvindex_consistent", "recovery_s",
                "ttft_before_ms", "ttft_during_ms")}})
            samples += await sample(rig, t, row["kvindex"])
            i += 1
    wall = time.monotonic() - t0
    return summarize(cfg, rounds, samples, wall)


def summarize(cfg: SoakConfig, rounds: list[dict], samples: list[dict],
              wall_s: float) -> dict:
    """The result: totals over every round, growth per hour, the rounds and samples."""
    return {
        "config": asdict(cfg),
        "wall_s": round(wall_s, 1),
        "rounds_run": len(rounds),
        "faults_injected": sum(r["scenario"] != "baseline" for r in rounds),
        "sent": sum(r["sent"] for r in rounds),
        "lost": sum(r["lost"] for r in rounds),
        "wrong_tokens": sum(r["wrong_tokens"] for r in rounds),
        "unsealed_served": sum(r["unsealed_served"] for r in rounds),
        "invisible_reads": sum(r["invisible_reads"] for r in rounds),
        "kvindex_consistent": all(r["kvindex_consistent"] for r in rounds),
        "min_completed_ok_ratio": min((r["completed_ok_ratio"] for r in rounds),
                                      default=None),
        "growth_per_hour": growth(samples, wall_s / 2),
        "rounds": rounds,
        "samples": samples,
    }


def markdown(result: dict) -> str:
    """Growth per hour per node, then the totals."""
    keys = list(_GROWING)
    lines = ["| node | " + " | ".join(f"{k} / h" for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for node, g in result["growth_per_hour"].items():
        lines.append(f"| {node} | " + " | ".join(
            "—" if g.get(k) is None else f"{g[k]:+g}" for k in keys) + " |")
    lines += ["", ", ".join(f"`{k}` {json.dumps(result[k])}" for k in (
        "rounds_run", "faults_injected", "sent", "lost", "wrong_tokens", "unsealed_served",
        "invisible_reads", "kvindex_consistent", "min_completed_ok_ratio")), ""]
    return "\n".join(lines)


def run(cfg: SoakConfig) -> dict:
    """Run the soak in a temporary folder; returns the JSON result."""
    return run_in_tmp(functools.partial(run_async, cfg), "cpd-soak-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench soak``'s flags."""
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long to run (default 30)")
    parser.add_argument("--concurrency", type=int, default=100,
                        help="requests kept in flight (default 100: half of the fault "
                             "harness's load)")
    parser.add_argument("--fault-every", type=int, default=4,
                        help="inject a fault every N rounds of 20 s (default 4)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench soak``'s flags; the growth table goes to stderr."""
    result = run(SoakConfig(minutes=args.minutes, concurrency=args.concurrency,
                            fault_every=args.fault_every))
    print(markdown(result), file=sys.stderr)
    return result


__all__ = ["DEFAULT_FAULTS", "SoakConfig", "add_arguments", "growth", "markdown",
           "per_hour", "run", "run_args", "run_async", "summarize"]
