"""``cpd bench plan``: how fast the planner (``cpd plan``) is (docs/benchmarks/plan.md).

Two runs, in this process, timed in wall seconds and CPU seconds (the process's and its
reaped children's: the planner's searches run in worker processes):

* **the paper's protocol** as ``cpd plan --paper`` runs it (the sweep's six topologies,
  0.4–1.6 QPS/GPU, 30 s ramp, 600 s steady), on one workload seed, through
  :func:`tools.plan.planner.run` with the configuration the command line builds;
* **one large cluster**: a single simulation of 256 nodes split in the proportions of
  the paper's CPD-2D, at 100 QPS for 600 simulated seconds of steady load.

``--quick`` runs a much smaller version of each, with the same keys. ``--fidelity``
compares the planner with the real services instead (:mod:`tools.bench.fidelity`), and
``--waves`` runs CPD's elastic split under waves of traffic (:mod:`tools.plan.waves`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from cpd.ops.config import Settings
from cpd.ops.cpuset import usable_cpus
from cpd.protocol.errors import CpdError
from tools.bench.hostinfo import load_average, machine_info
from tools.bench.loaddriver import Phases
from tools.bench.registry import SettingsFactory
from tools.bench.sweep import BY_LABEL, Topology
from tools.plan import planner
from tools.plan.cli import config_for
from tools.plan.search import PlanConfig, run_probe, topology

# Targets on the reference machine (2 cores), wall seconds.
PAPER_TARGET_S = 60.0
LARGE_TARGET_S = 300.0
# The paper's protocol on one seed: ``--paper`` sets topologies, loads and phases only.
PAPER_SEEDS = 1
# The large cluster: the paper's CPD-2D (1 pre-prefill : 1 prefill : 2 decode) scaled up.
LARGE_SHAPE = BY_LABEL["CPD-2D"]
LARGE_NODES = 256
LARGE_QPS = 100.0
LARGE_PHASES = Phases(ramp_s=30.0, steady_s=600.0)
# The client's in-flight cap scales with the cluster (the planner's 24 is sized for the
# paper's 3–4 nodes; 24 out at once would starve 256 nodes at 100 QPS).
INFLIGHT_PER_NODE = 8
# --quick: two topologies at two loads for 60 s; 32 nodes at the same load per GPU.
QUICK_TOPOLOGIES = ("2P1D pd-kv", "CPD-1D")
QUICK_LADDER = (0.4, 0.8)
QUICK_PHASES = Phases(ramp_s=10.0, steady_s=60.0)
QUICK_NODES = 32
QUICK_LARGE_PHASES = Phases(ramp_s=10.0, steady_s=60.0)


def _split(nodes: int, ratio: Sequence[int]) -> tuple[int, ...]:
    """``nodes`` split into pools in proportion to ``ratio``: largest remainders, ties to
    the earlier pool, every pool at least one node."""
    if nodes < len(ratio) or min(ratio) < 1:
        raise ValueError(f"cannot split {nodes} nodes as {tuple(ratio)}")
    total = sum(ratio)
    exact = [nodes * r / total for r in ratio]
    out = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(ratio)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[:max(0, nodes - sum(out))]:
        out[i] += 1
    while sum(out) > nodes:  # a pool raised to one node: take it from the largest
        out[out.index(max(out))] -= 1
    return tuple(out)


def _met(seconds: float, target_s: float) -> bool:
    """Whether a run of ``seconds`` meets a wall-time target of ``target_s``."""
    return seconds <= target_s


def _cpu_now() -> float:
    """CPU seconds of this process and its reaped children so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _timed(fn: Callable[[], dict]) -> tuple[dict, float, float]:
    """``fn()``'s result, its wall seconds and its CPU seconds (children included)."""
    cpu0, t0 = _cpu_now(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, _cpu_now() - cpu0


def paper_config(settings: Settings, jobs: int, quick: bool) -> PlanConfig:
    """The plan ``cpd plan --paper --seeds 1 --jobs JOBS`` builds; ``quick``: fewer
    topologies and loads, shorter phases."""
    from tools.cli import build_parser

    args = build_parser().parse_args(
        ["plan", "--paper", "--seeds", str(PAPER_SEEDS), "--jobs", str(jobs)])
    cfg = config_for(settings, args)
    if quick:
        cfg = replace(cfg, topologies=tuple(BY_LABEL[x] for x in QUICK_TOPOLOGIES),
                      ladder=QUICK_LADDER, phases=QUICK_PHASES)
    return cfg


def _jobs_used(cfg: PlanConfig) -> int:
    """The worker processes :func:`tools.plan.search.evaluate` starts (1: none)."""
    tasks = len(cfg.topologies) * cfg.seeds
    jobs = cfg.jobs or len(usable_cpus())
    return 1 if jobs <= 1 or tasks == 1 else min(jobs, tasks)


def run_paper(cfg: PlanConfig) -> dict:
    """The paper's protocol through the planner's API: wall, CPU, requests, probes."""
    result, wall, cpu = _timed(lambda: planner.run(cfg))
    probes = sum(len(s["points"]) for t in result["topologies"].values() for s in t["seeds"])
    p = cfg.phases
    return {
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "simulated_requests": result["simulated_requests"], "probes": probes,
        "jobs": _jobs_used(cfg), "seeds": cfg.seeds,
        "topologies": [t.label for t in cfg.topologies], "ladder": list(cfg.ladder or ()),
        "phases": {"ramp_s": p.ramp_s, "settle_s": p.settle_s, "steady_s": p.steady_s},
        "sustainable_qps_per_gpu": {label: t["sustainable_qps_per_gpu"]["mean"]
                                    for label, t in result["topologies"].items()},
        "planner_wall_s": result["wall_s"], "planner_cpu_s": result["cpu_s"],
    }


def large_topology(nodes: int) -> Topology:
    """A CPD topology of ``nodes`` nodes in the proportions of the paper's CPD-2D."""
    pp, pf, dc = _split(nodes, (LARGE_SHAPE.preprefill, LARGE_SHAPE.prefill,
                                LARGE_SHAPE.decode))
    return topology("cpd", pp, pf, dc)


def run_large(settings: Settings, nodes: int, qps: float, phases: Phases) -> dict:
    """One simulation of a ``nodes``-node CPD cluster at ``qps`` (one probe of the
    planner: the workload, the simulation, its report)."""
    top = large_topology(nodes)
    cfg = PlanConfig(topologies=(top,), seeds=1, phases=phases, jobs=1,
                     max_inflight=INFLIGHT_PER_NODE * nodes, settings=settings)
    gpus = top.gpus(cfg.cost.gpus)
    (point, res), wall, cpu = _timed(lambda: run_probe(cfg, top, qps / gpus, 0))
    completed = sum(r.error is None and r.finish_s is not None for r in res.results)
    return {
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "simulated_requests": point["simulated_requests"], "completed_requests": completed,
        "events": res.events, "jobs": 1, "topology": top.label, "nodes": nodes,
        "split": {"preprefill": top.preprefill, "prefill": top.prefill,
                  "decode": top.decode},
        "split_from": LARGE_SHAPE.label, "gpus": gpus, "qps": qps,
        "max_inflight": cfg.max_inflight,
        "phases": {"ramp_s": phases.ramp_s, "settle_s": phases.settle_s,
                   "steady_s": phases.steady_s},
        "sustainable": point["sustainable"], "ttft_p90_s": point.get("ttft_p90_s"),
        "achieved_qps_per_gpu": point["achieved_qps_per_gpu"],
    }


def run(settings: Settings, *, quick: bool = False, jobs: int = 0) -> dict:
    """Measure both runs; returns the JSON-able result (docs/benchmarks/plan.md)."""
    load_before = load_average()
    paper = run_paper(paper_config(settings, jobs, quick))
    large = run_large(settings, QUICK_NODES if quick else LARGE_NODES,
                      LARGE_QPS * (QUICK_NODES / LARGE_NODES if quick else 1.0),
                      QUICK_LARGE_PHASES if quick else LARGE_PHASES)
    requests = paper["simulated_requests"] + large["simulated_requests"]
    cpu = paper["cpu_s"] + large["cpu_s"]
    return {
        "quick": quick,
        "paper_protocol_s": paper["wall_s"],
        "paper_protocol_target_s": PAPER_TARGET_S,
        "paper_protocol_met": _met(paper["wall_s"], PAPER_TARGET_S),
        "paper_protocol": paper,
        "large_cluster_s": large["wall_s"],
        "large_cluster_target_s": LARGE_TARGET_S,
        "large_cluster_met": _met(large["wall_s"], LARGE_TARGET_S),
        "large_cluster": large,
        "sim_requests_per_cpu_s": round(requests / cpu, 1) if cpu > 0 else None,
        "simulated_requests": requests,
        "cpu_s": round(cpu, 2),
        "jobs": paper["jobs"],
        "host": machine_info() | {"load_average_before": load_before,
                                  "load_average_after": load_average()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench plan``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="2 topologies at 2 loads for 60 s; a 32-node cluster for 60 s "
                             "(--fidelity: CPD-1D at 0.4 QPS/GPU, 10 + 10 + 20 s)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="processes of the paper's protocol (default: usable CPUs)")
    parser.add_argument("--fidelity", action="store_true",
                        help="instead: the planner against cpd bench sweep on the same "
                             "workload, loads and phases (the sweep runs for about 40 minutes)")
    parser.add_argument("--waves", action="store_true",
                        help="instead: CPD-1D's elastic split under a wave of cold prompts "
                             "and one of long outputs, with and without it (seconds)")
    parser.add_argument("--services", action="store_true",
                        help="with --waves: the elastic runs on the real services too "
                             "(sim engines at time scale 1: about 12 minutes)")
    parser.add_argument("--sweep-json", metavar="PATH", nargs="+",
                        help="--fidelity against these cpd bench sweep results (one "
                             "configuration, merged) instead of running one")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench plan``'s flags, with the common ``--config``/``--set``."""
    if args.sweep_json and not args.fidelity:
        raise CpdError("--sweep-json goes with --fidelity")
    if args.waves:
        if args.fidelity or args.quick:
            raise CpdError("--waves runs on its own (no --fidelity, no --quick)")
        from tools.plan import waves

        out = waves.run(settings())
        if args.services:
            from tools.bench import waves as services

            out["services"] = got = services.run(settings())
            out["services_met"] = waves.met(got, out["slo_ttft_p90_s"])
        return out
    if args.services:
        raise CpdError("--services goes with --waves")
    if args.fidelity:
        from tools.bench import fidelity

        return fidelity.run(settings(), quick=args.quick, sweep_json=args.sweep_json,
                            jobs=args.jobs)
    return run(settings(), quick=args.quick, jobs=args.jobs)
