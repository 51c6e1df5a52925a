"""The ``cpd plan`` command line (docs/plan.md, "Command")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cpd.ops.config import Settings
from cpd.protocol.errors import CpdError
from cpd.sim.costmodel import PRESETS
from tools.bench.loaddriver import Phases
from tools.plan.planner import paper
from tools.plan.search import (
    DEFAULT_PHASES,
    QUICK_PHASES,
    PlanConfig,
    topology,
    within_budget,
)

QUICK_SEEDS = 3
QUICK_RESOLUTION = 0.1
DEFAULT_GPUS = 12


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``cpd plan``."""
    p = sub.add_parser("plan", help="size the pre-prefill, prefill and decode pools from "
                                    "a workload or trace, in simulated time")
    p.add_argument("--workload", choices=["coding-agent", "mooncake", "poisson"],
                   default="coding-agent")
    p.add_argument("--trace", help="a Mooncake/AIPerf JSONL trace (timestamp, input_length, "
                                   "output_length, hash_ids), re-timed as Poisson arrivals")
    p.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per hash id of the trace (Mooncake: 512)")
    p.add_argument("--preset", help="cost preset of the prefill-side nodes "
                                    "(default b200-tp4-llama-3.1-8b-fp8)")
    p.add_argument("--decode-preset", help="cost preset of the decode nodes (default: --preset)")
    p.add_argument("--gpus", type=int, help=f"GPU budget: every split of it into pools "
                                            f"(default {DEFAULT_GPUS})")
    p.add_argument("--topologies", help="instead of --gpus: e.g. '2P1D pd-kv,CPD-1D,"
                                        "CPD-2:1:1' (CPD-PP:P:D, or PpDd with a policy)")
    p.add_argument("--slo-ttft-p90", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, help="TPOT p50 SLO in seconds (default none)")
    p.add_argument("--seeds", type=int, help="workload seeds (default 5; --quick 3)")
    p.add_argument("--qps", help="a fixed ladder of target QPS/GPU instead of bisection")
    p.add_argument("--ramp-s", type=float)
    p.add_argument("--settle-s", type=float)
    p.add_argument("--steady-s", type=float)
    p.add_argument("--max-inflight", type=int, default=PlanConfig.max_inflight,
                   help="requests the client keeps out at once; the rest queue at the "
                        f"client, in TTFT (default {PlanConfig.max_inflight}, the paper's)")
    p.add_argument("--dispatch-ms", type=float, default=PlanConfig.dispatch_s * 1e3,
                   help="the services' latency from the client's send to the prefill "
                        "engine, ms (default: measured on the reference host)")
    p.add_argument("--relay-ms", type=float, default=PlanConfig.relay_s * 1e3,
                   help="from a worker's token to the client, ms (default: measured)")
    p.add_argument("--network-gbps", type=float, default=50.0,
                   help="KV bandwidth into each node from peers, GB/s (default 50)")
    p.add_argument("--arena-gb", type=float, default=PlanConfig.dram_bytes / 1e9,
                   help="host DRAM of each worker's block arena, GB of modelled KV; it "
                        "evicts by dataplane.eviction (default "
                        f"{PlanConfig.dram_bytes / 1e9:,.0f})")
    p.add_argument("--disk-gb", type=float, default=0.0,
                   help="each worker's disk tier below its arena, GB of modelled KV, read "
                        "at router.disk_bandwidth_gbps (default 0: none)")
    p.add_argument("--jobs", type=int, default=0, help="processes (default: usable CPUs)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's experiment: 2P1D, 2P2D (pd-rr, pd-kv), CPD-1D, "
                        "CPD-2D at 0.4-1.6 QPS/GPU, 30 s ramp, 600 s steady")
    p.add_argument("--quick", action="store_true", help="short phases, 3 seeds, coarse")
    p.add_argument("--json", metavar="PATH", help="also write the result here")
    p.add_argument("--out", help="folder for plan.md and plan.png (default: --json's folder)")
    p.set_defaults(func=cmd_plan)


def parse_topologies(text: str) -> tuple:
    """``'2P1D pd-kv,CPD-1D,CPD-2:1:1'`` as topologies."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, policy = item.partition(" ")
        try:
            if name.startswith("CPD-"):
                spec = name[4:]
                if spec.endswith("D") and spec[:-1].isdigit():
                    out.append(topology("cpd", 1, 1, int(spec[:-1])))
                else:
                    pp, pf, dc = (int(x) for x in spec.split(":"))
                    out.append(topology("cpd", pp, pf, dc))
            else:
                pf, dc = name.rstrip("D").split("P")
                if policy not in ("pd-rr", "pd-kv"):
                    raise ValueError
                out.append(topology(policy, 0, int(pf), int(dc)))
        except ValueError:
            raise CpdError(f"cannot read topology {item!r}: use e.g. '2P1D pd-kv', "
                           f"'CPD-1D' or 'CPD-2:1:1'") from None
    if not out:
        raise CpdError("--topologies names no topology")
    return tuple(out)


def config_for(settings: Settings, args: argparse.Namespace) -> PlanConfig:
    """The plan of the command line."""
    preset = args.preset or "b200-tp4-llama-3.1-8b-fp8"
    for name in (preset, args.decode_preset or preset):
        if name not in PRESETS:
            raise CpdError(f"unknown cost preset {name!r}; known: {sorted(PRESETS)}")
    if args.workload == "mooncake" and not args.trace:
        raise CpdError("--workload mooncake needs --trace FILE")
    gpn = PRESETS[preset].gpus
    if args.topologies:
        tops = parse_topologies(args.topologies)
    else:
        try:
            tops = within_budget(args.gpus or DEFAULT_GPUS, gpn)
        except ValueError as e:
            raise CpdError(str(e)) from None
    phases = QUICK_PHASES if args.quick else DEFAULT_PHASES
    phases = Phases(ramp_s=phases.ramp_s if args.ramp_s is None else args.ramp_s,
                    settle_s=phases.settle_s if args.settle_s is None else args.settle_s,
                    steady_s=phases.steady_s if args.steady_s is None else args.steady_s)
    cfg = PlanConfig(
        topologies=tops, workload=args.workload,
        trace=Path(args.trace) if args.trace else None,
        trace_block_size=args.trace_block_size, preset=preset,
        decode_preset=args.decode_preset or "", slo_ttft_p90_s=args.slo_ttft_p90,
        slo_tpot_s=args.slo_tpot,
        seeds=args.seeds or (QUICK_SEEDS if args.quick else 5), phases=phases,
        ladder=tuple(float(x) for x in args.qps.split(",")) if args.qps else None,
        resolution=QUICK_RESOLUTION if args.quick else PlanConfig.resolution,
        network_gbps=args.network_gbps, max_inflight=args.max_inflight,
        dram_bytes=int(args.arena_gb * 1e9), disk_bytes=int(args.disk_gb * 1e9),
        dispatch_s=args.dispatch_ms / 1e3,
        relay_s=args.relay_ms / 1e3, jobs=args.jobs, settings=settings)
    if args.paper:
        cfg = paper(cfg)
    if cfg.seeds < 1:
        raise CpdError("--seeds must be >= 1")
    if cfg.max_inflight < 1:
        raise CpdError("--max-inflight must be >= 1")
    if cfg.dram_bytes < 0 or cfg.disk_bytes < 0:
        raise CpdError("--arena-gb and --disk-gb must be >= 0")
    if cfg.dispatch_s < 0 or cfg.relay_s < 0:
        raise CpdError("--dispatch-ms and --relay-ms must be >= 0")
    return cfg


def cmd_plan(args: argparse.Namespace) -> int:
    """Run the plan; print the table and verdict, write JSON, table and plot."""
    from tools.cli import _settings, _write_json
    from tools.plan import planner, report

    cfg = config_for(_settings(args), args)

    def progress(label: str, seed: int, r: dict) -> None:
        print(f"{label} seed {seed}: sustainable {r['sustainable_qps_per_gpu']:.2f} QPS/GPU "
              f"({len(r['points'])} probes)", file=sys.stderr, flush=True)

    result = planner.run(cfg, progress)
    out = Path(args.out) if args.out else (Path(args.json).parent if args.json else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table = out / "plan.md"
        table.write_text(report.markdown(result))
        result["table"] = str(table)
        result["plots"] = report.plot(result, out)
    _write_json(result, args.json)
    print(report.markdown(result), file=sys.stderr)
    return 0


__all__ = ["add_parser", "cmd_plan", "config_for", "parse_topologies"]
